"""The stage registry: built-ins, third-party entry points, "pkg.mod:name", decorator misuse.

Third-party stages are found through the real ``importlib.metadata``: either a
``*.dist-info`` folder with an ``entry_points.txt`` on ``sys.path`` (fast, in
this process), or the fixture distribution in ``fixtures/thirdparty_stage``
built and installed by pip into a temporary folder (a subprocess, so the
project's venv is never touched).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from flowkv import Runner, loads_pipeline, stage, tier
from flowkv.registry import (
    BUILTIN_STAGES,
    BUILTIN_TIERS,
    ENTRY_POINT_GROUP,
    RegistryError,
    available,
    resolve_stage,
    resolve_tier,
)

FIXTURE = Path(__file__).parent / "fixtures" / "thirdparty_stage"
PACKAGE = "flowkv_thirdparty_demo"


def add_distribution(site: Path, dist: str, entry_points: dict[str, str], *, with_package: bool = True,
                     group: str = ENTRY_POINT_GROUP) -> None:
    """Lay out an installed distribution by hand: a dist-info with entry points (+ the package)."""
    info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    lines = [f"[{group}]"] + [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    if with_package:
        shutil.copytree(FIXTURE / PACKAGE, site / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for hand-made distributions; their modules are forgotten after."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    sys.modules.pop(PACKAGE, None)


# -- built-ins ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILTIN_STAGES))
def test_every_builtin_stage_resolves_under_its_own_name(name):
    info = resolve_stage(name)
    assert info.name == name
    assert info.kinds and info.kinds <= {"store", "retrieve", "lookup", "server"}  # server: a node server's list
    assert attrs.has(info.config_cls)
    assert info.func.__doc__, f"stage '{name}' has no docstring"


@pytest.mark.parametrize("name", sorted(BUILTIN_TIERS))
def test_every_builtin_tier_kind_resolves(name):
    info = resolve_tier(name)
    assert info.name == name and attrs.has(info.config_cls)


def test_config_class_from_keyword_only_parameters():
    info = resolve_stage("take")
    assert [f.name for f in attrs.fields(info.config_cls)] == ["limit"]
    assert info.make_config(limit=3).limit == 3
    assert not info.takes_ctx
    with pytest.raises(TypeError):
        info.make_config()  # limit is required


def test_unknown_stage_suggests_a_builtin():
    with pytest.raises(RegistryError) as caught:
        resolve_stage("gahter")
    assert caught.value.kind == "unknown"
    assert "did you mean 'gather'?" in str(caught.value)


def test_dotted_names_missing_module_and_missing_attribute_differ():
    with pytest.raises(RegistryError) as missing_module:
        resolve_stage("flowkv_absent_pkg.sub:thing")
    with pytest.raises(RegistryError) as missing_attr:
        resolve_stage("flowkv.stages.basic:thing")
    assert missing_module.value.kind == "module-not-found"
    assert "pip install flowkv_absent_pkg" in str(missing_module.value)
    assert missing_attr.value.kind == "attribute-not-found"
    assert "has no attribute 'thing'" in str(missing_attr.value)
    assert "pip install" not in str(missing_attr.value)


def test_a_name_of_something_undeclared_says_which_decorator_it_lacks():
    # A stage function is no tier kind and a tier class no stage: each names its own decorator.
    with pytest.raises(RegistryError, match=r"not declared with @flowkv\.tier$") as not_tier:
        resolve_tier("flowkv.stages.basic:take")
    with pytest.raises(RegistryError, match=r"not declared with @flowkv\.stage$") as not_stage:
        resolve_stage(BUILTIN_TIERS["disk"])
    assert not_tier.value.kind == not_stage.value.kind == "misuse"
    with pytest.raises(RegistryError, match="unknown tier kind 'dsik'; did you mean 'disk'"):
        resolve_tier("dsik")


def test_malformed_dotted_name():
    with pytest.raises(RegistryError, match="not of the form 'pkg.module:name'"):
        resolve_stage("flowkv.stages.basic:")


# -- third-party stages through entry points ----------------------------------


def test_entry_point_stage_is_found_and_runs(site):
    add_distribution(site, "flowkv-thirdparty-demo", {"tag-items": f"{PACKAGE}:tag_items"})
    assert PACKAGE not in sys.modules
    pipeline = loads_pipeline('[[store.stages]]\nuse = "tag-items"\nlabel = "ours"\n')
    (spec,) = pipeline.store
    assert spec.info.name == "tag-items" and spec.info.func.__module__ == PACKAGE
    assert Runner(pipeline.store, kind="store", pipeline="t").run([1, 2]) == [("ours", 1), ("ours", 2)]
    installed = dict(available()["installed"])
    assert installed["tag-items"] == f"'flowkv-thirdparty-demo': {PACKAGE}:tag_items"


def test_the_old_entry_point_group_still_works_with_a_deprecation_warning(site):
    add_distribution(site, "flowkv-old-demo", {"tag-items": f"{PACKAGE}:tag_items"}, group="flowkv.stages")
    with pytest.warns(DeprecationWarning, match="'tag-items' comes from the entry-point group 'flowkv.stages' of "
                                                "distribution 'flowkv-old-demo'; register it under 'flowkv.plugins'"):
        info = resolve_stage("tag-items")
    assert info.name == "tag-items"
    assert dict(available()["installed"])["tag-items"] == f"'flowkv-old-demo': {PACKAGE}:tag_items"


def test_entry_points_are_loaded_only_when_used(site):
    add_distribution(site, "flowkv-thirdparty-demo", {"tag-items": f"{PACKAGE}:tag_items"})
    loads_pipeline('[[store.stages]]\nuse = "pass-through"\n')
    available()
    assert PACKAGE not in sys.modules


def test_entry_point_to_a_missing_module_gives_an_install_hint(site):
    add_distribution(site, "flowkv-broken-demo", {"ghost": "flowkv_ghost_pkg.stages:ghost"}, with_package=False)
    with pytest.raises(RegistryError) as caught:
        resolve_stage("ghost")
    assert caught.value.kind == "module-not-found"
    assert "pip install flowkv_ghost_pkg" in str(caught.value)


def test_two_entry_points_with_one_name_name_both_sources(site):
    add_distribution(site, "flowkv-demo-a", {"tag-items": f"{PACKAGE}:tag_items"})
    add_distribution(site, "flowkv-demo-b", {"tag-items": "flowkv_other_pkg:tag"}, with_package=False)
    with pytest.raises(RegistryError) as caught:
        resolve_stage("tag-items")
    message = str(caught.value)
    assert caught.value.kind == "duplicate"
    assert "two stages named 'tag-items'" in message
    for source in ("'flowkv-demo-a'", "'flowkv-demo-b'", f"{PACKAGE}:tag_items", "flowkv_other_pkg:tag"):
        assert source in message


def test_entry_point_shadowing_a_builtin_is_an_error(site):
    add_distribution(site, "flowkv-shadow-demo", {"take": f"{PACKAGE}:tag_items"})
    with pytest.raises(RegistryError) as caught:
        available()
    message = str(caught.value)
    assert caught.value.kind == "duplicate"
    assert "two stages named 'take'" in message
    assert "flowkv.stages.basic:take" in message and "'flowkv-shadow-demo'" in message
    # Looking up any name that is not a built-in meets the same error.
    with pytest.raises(RegistryError, match="two stages named 'take'"):
        resolve_stage("tag-items")


def test_fixture_distribution_built_and_installed_by_pip(tmp_path):
    """The real thing: pip builds the fixture's wheel and installs it; flowkv finds the stage."""
    source = tmp_path / "src"
    shutil.copytree(FIXTURE, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
           "--no-index", "--target", str(target), str(source)]
    subprocess.run(pip, check=True, capture_output=True, timeout=600)
    assert list(target.glob("flowkv_thirdparty_demo-0.1.0.dist-info/entry_points.txt"))
    pipeline_file = tmp_path / "third.toml"
    pipeline_file.write_text('[[store.stages]]\nuse = "tag-items"\n\n[[store.stages]]\nuse = "take"\nlimit = 1\n')
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}
    cli = [sys.executable, "-m", "flowkv.cli", "pipeline"]
    shown = subprocess.run(cli + ["show", "--json", str(pipeline_file)], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)
    assert shown.returncode == 0, shown.stderr
    (first, _take) = json.loads(shown.stdout)["store"]
    assert first["use"] == "tag-items" and first["label"] == "seen"
    assert first["stage"].startswith(f"{PACKAGE}.tag_items (")
    listed = subprocess.run(cli + ["list", "--json"], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=600)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["installed"]["tag-items"].startswith("'flowkv-thirdparty-demo'")


# -- decorator misuse ----------------------------------------------------------


def test_stage_that_is_not_a_generator_names_function_and_line():
    line = sys._getframe().f_lineno + 3
    with pytest.raises(RegistryError) as caught:

        @stage("not-a-generator")
        def returns_a_list(items):
            return list(items)

    message = str(caught.value)
    assert caught.value.kind == "misuse"
    assert "returns_a_list" in message and "must be a generator function" in message
    assert f"{__file__}:{line}" in message


def test_positional_setting_names_function_and_line():
    line = sys._getframe().f_lineno + 3
    with pytest.raises(RegistryError) as caught:

        @stage("positional-setting")
        def with_positional(items, limit=3):
            yield from items

    message = str(caught.value)
    assert "with_positional" in message and "setting 'limit' must be keyword-only" in message
    assert f"{__file__}:{line}" in message


def test_stage_without_an_item_parameter():
    with pytest.raises(RegistryError, match="first positional parameter"):

        @stage("no-items")
        def no_items(*, limit: int = 1):
            yield limit


def test_unknown_pipeline_kind():
    with pytest.raises(RegistryError, match=r"unknown pipeline kind\(s\) \['stroe'\]"):

        @stage("bad-kind", kinds=("stroe",))
        def bad_kind(items):
            yield from items


def test_a_stage_reads_only_tables_it_may_read():
    with pytest.raises(RegistryError, match=r"reads= names unknown table\(s\) \['blnd'\]; use \['blend'\]"):

        @stage("bad-reads", reads=("blnd",))
        def bad_reads(items):
            yield from items

    @stage("reads-blend", reads=("blend",))
    def reads_blend(items):
        yield from items

    assert reads_blend.__flowkv_stage__.reads == {"blend"}


def test_config_must_be_an_attrs_class():
    class Settings:
        limit = 3

    with pytest.raises(RegistryError, match="config= must be an attrs class"):

        @stage("bad-config", config=Settings)
        def bad_config(items, *, limit):
            yield from items

    with pytest.raises(RegistryError, match="config= must be an attrs class"):

        @tier("bad-tier", config=Settings)
        class BadTier:
            pass


def test_declared_stage_keeps_its_function_callable():
    @stage("double", kinds=("store",), needs={"span"}, gives={"span"})
    def double(items, *, ctx, factor: int = 2):
        for item in items:
            yield item * factor

    info = double.__flowkv_stage__
    assert info.takes_ctx and info.needs == {"span"} and info.kinds == {"store"}
    assert info.origin.startswith(f"{__name__}.")
    assert list(double(iter([1, 2]), ctx=None, factor=3)) == [3, 6]
