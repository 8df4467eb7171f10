"""The wheel: built from a copy of the tree, it carries the stages, kernels, pipelines and the command.

The wheel is then unpacked (what installing a pure-Python wheel amounts to)
and imported by a fresh interpreter started with ``-I -S`` from another
folder: no site processing means the editable install of this checkout
cannot leak in; the venv's site-packages is added by hand for the
dependencies only.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TREE = ("pyproject.toml", "README.md", "flowkv", "stages", "kernels", "pipelines")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    source.mkdir()
    for name in TREE:
        origin = ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
        else:
            shutil.copy2(origin, source / name)
    out = work / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(out), str(source)],
        check=True, capture_output=True, timeout=600,
    )
    (built,) = out.glob("flowkv-*.whl")
    return built


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, tree in (("flowkv/stages", ROOT / "stages"), ("flowkv/kernels", ROOT / "kernels")):
        expected = {f"{folder}/{p.name}" for p in tree.glob("*.py")}
        assert expected and expected <= names, expected - names
    assert "flowkv/stages/basic.py" in names and "flowkv/kernels/__init__.py" in names
    for toml in (ROOT / "pipelines").glob("*.toml"):
        assert f"flowkv/pipelines/{toml.name}" in names
    assert "flowkv/pipelines/local-cpu.toml" in names
    for record in (ROOT / "pipelines" / "quality").glob("*.json"):  # the shipped pipelines' quality records
        assert f"flowkv/pipelines/quality/{record.name}" in names
    assert "flowkv/pipelines/quality/cpu-disk-int8.json" in names
    assert "flowkv/cli.py" in names and "flowkv/bench/runner.py" in names
    # Every sub-package of flowkv/ ships (a package missing from pyproject's list would not).
    for init in (ROOT / "flowkv").rglob("__init__.py"):
        assert f"flowkv/{init.relative_to(ROOT / 'flowkv').as_posix()}" in names, init
    assert not any(n.startswith(("tests/", "stages/", "kernels/", "pipelines/")) for n in names)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[console_scripts]" in text and "flowkv = flowkv.cli:main" in text


def test_unpacked_wheel_imports_from_elsewhere(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    deps = sysconfig.get_paths()["purelib"]
    probe = "\n".join([
        "import sys",
        f"sys.path[:0] = [{str(site)!r}, {deps!r}]",
        "import flowkv, flowkv.stages, flowkv.kernels",
        "from flowkv.pipeline import builtin_pipelines, load_pipeline",
        f"assert flowkv.__file__.startswith({str(site)!r}), flowkv.__file__",
        f"assert flowkv.stages.__file__.startswith({str(site)!r}), flowkv.stages.__file__",
        "found = builtin_pipelines()",
        f"assert str(found['local-cpu']).startswith({str(site)!r}), found",
        "p = load_pipeline('local-cpu')",
        "assert p.store[-1].info.func.__module__ == 'flowkv.stages.tiering'",
        "print(sorted(found))",
    ])
    done = subprocess.run([sys.executable, "-I", "-S", "-c", probe], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "'local-cpu'" in done.stdout


def test_redis_py_is_required_at_6_which_checks_tls_host_names_by_default():
    import tomllib
    from importlib.metadata import version

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (redis,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "redis"]
    # redis-py 5 made rediss:// connections without checking the server's host name unless asked.
    assert not redis.specifier.contains("5.3.1") and redis.specifier.contains("6.0.0"), str(redis)
    assert redis.specifier.contains(version("redis"))
