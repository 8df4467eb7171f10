"""Pipeline files that extend others: each built-in says only what differs, and loads to exactly what
it did when it was a whole copy; mistakes are reported in the file that has them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pipeline_snapshots import SNAPSHOTS, effective, read_snapshot

from flowkv.cli import main
from flowkv.pipeline import PipelineError, builtin_pipelines, load_pipeline

PIPELINES = Path(__file__).resolve().parent.parent / "pipelines"
LOCAL_CPU = str(builtin_pipelines()["local-cpu"])


# The blend pipelines ship without a separator (it depends on the tokenizer): they load with one set.
OVERRIDES = {"blend": {"blend.separator": [271, 198]}, "blend-disk": {"blend.separator": [271, 198]}}


@pytest.mark.parametrize("name", sorted(builtin_pipelines()))
def test_every_built_in_pipeline_loads_to_its_effective_settings_before_extends(name):
    assert (SNAPSHOTS / f"{name}.json").exists(), f"no snapshot of {name}: a new built-in needs one"
    pipeline = load_pipeline(name, overrides=OVERRIDES.get(name))
    assert json.loads(json.dumps(effective(pipeline))) == read_snapshot(name)


def test_built_in_files_hold_no_stage_table_their_parent_already_has():
    base = (PIPELINES / "local-cpu.toml").read_text()
    for path in PIPELINES.glob("*.toml"):
        if path.name == "local-cpu.toml":
            continue
        text = path.read_text()
        if "\n[[server.stages]]" in text:  # a node server's pipeline: it has none of an engine's lists to extend
            assert "extends" not in text and "[[store.stages]]" not in text, path
            continue
        assert text.count("\nextends = ") == 1, path
        assert "[layerwise]" not in text, path
        # The stages a child declares are what its replace puts in place of the parent's.
        for kind in ("store", "retrieve"):
            declared = text.count(f"[[{kind}.stages]]")
            assert declared == 0 or f"[{kind}]\nreplace = " in text, (path, kind)
    assert "extends" not in base


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_a_mistake_is_reported_in_the_file_that_has_it(tmp_path):
    parent = write(tmp_path, "parent.toml", (PIPELINES / "local-cpu.toml").read_text().replace(
        'capacity = "4GiB"', 'capacity = "4 gigs"'))
    child = write(tmp_path, "child.toml", 'extends = "parent.toml"\n\n[pipeline]\nname = "child"\nchunk_sise = 128\n')
    with pytest.raises(PipelineError) as caught:
        load_pipeline(child)
    where = {(Path(d.file).name, d.line, d.col): d.message for d in caught.value.diagnostics}
    capacity_line = parent.read_text().splitlines().index('capacity = "4 gigs"') + 1
    assert ("child.toml", 5, 1) in where and "did you mean 'chunk_size'" in where[("child.toml", 5, 1)]
    assert ("parent.toml", capacity_line, 1) in where and "capacity" in where[("parent.toml", capacity_line, 1)]


def test_a_stage_a_parent_declares_is_located_in_the_parent(tmp_path):
    child = write(tmp_path, "child.toml", f'extends = "{LOCAL_CPU}"\n\n[store]\nreplace = ["compress"]\n\n'
                  '[[store.stages]]\nuse = "compress"\ncodec = "lz4"\n')
    pipeline = load_pipeline(child)
    store = {spec.index: spec for spec in pipeline.store}
    assert store[4].location.file == str(child) and store[4].location.line == 6
    assert store[5].name == "put" and store[5].location.file == LOCAL_CPU
    assert [s.name for s in pipeline.store] == ["tokenize", "chunk-hash", "allocate", "gather", "compress", "put"]
    assert pipeline.extends == (LOCAL_CPU,)


def test_a_cycle_of_extends_is_an_error(tmp_path):
    write(tmp_path, "a.toml", 'extends = "b.toml"\n[pipeline]\nname = "a"\n')
    write(tmp_path, "b.toml", 'extends = "a.toml"\n[pipeline]\nname = "b"\n')
    with pytest.raises(PipelineError) as caught:
        load_pipeline(tmp_path / "a.toml")
    [diagnostic] = [d for d in caught.value.diagnostics if d.kind == "extends-cycle"]
    assert Path(diagnostic.file).name == "b.toml" and (diagnostic.line, diagnostic.col) == (1, 1)
    assert "a.toml -> " in diagnostic.message and diagnostic.message.endswith("a.toml")


def test_extends_names_a_built_in_or_a_file_and_says_which_when_it_finds_neither(tmp_path):
    child = write(tmp_path, "child.toml", 'extends = "local-cpo"\n')
    with pytest.raises(PipelineError, match=r"child.toml:1:1: extends = 'local-cpo': .*did you mean 'local-cpu'"):
        load_pipeline(child)


def test_replace_and_drop_that_match_nothing_say_what_the_parent_has(tmp_path):
    child = write(tmp_path, "child.toml", f'extends = "{LOCAL_CPU}"\n\n[tiers.disk]\ndrop = true\n\n'
                  '[store]\nreplace = ["put", "compress"]\n\n[[store.stages]]\nuse = "put"\n')
    with pytest.raises(PipelineError) as caught:
        load_pipeline(child)
    messages = {d.line: d.message for d in caught.value.diagnostics}
    assert "declares no tier 'disk' to drop" in messages[4]
    assert "no such consecutive stages (they are: tokenize, chunk-hash, allocate, gather, compress, put)" in messages[7]
    assert len(caught.value.diagnostics) == 2  # the parent's list stands: no errors that follow from the first
    with pytest.raises(PipelineError, match=r"\(they are: .*\); did you mean 'compress'\?"):
        load_pipeline(write(tmp_path, "typo.toml", f'extends = "{LOCAL_CPU}"\n[store]\nreplace = "compres"\n'))
    # Without extends, a replace is an unknown key that says what it needs.
    lone = write(tmp_path, "lone.toml", (PIPELINES / "local-cpu.toml").read_text() + '\n[store]\nreplace = ["put"]\n')
    with pytest.raises(PipelineError, match="works in a file that says extends"):
        load_pipeline(lone)


def test_a_tier_of_another_kind_replaces_the_parents_and_new_tiers_come_after_its_own(tmp_path):
    child = write(tmp_path, "child.toml", 'extends = "cpu-disk"\n\n[tiers.disk]\nkind = "redis"\n'
                  'url = "redis://127.0.0.1:1"\n\n[tiers.extra]\nkind = "disk"\npath = "extra"\ncapacity = "1MiB"\n')
    pipeline = load_pipeline(child)
    assert list(pipeline.tiers) == ["memory", "disk", "extra"]
    assert pipeline.tiers["disk"].kind == "redis" and not hasattr(pipeline.tiers["disk"].config, "path")


def test_an_inherited_quality_record_stays_the_parents(tmp_path):
    child = write(tmp_path, "mine.toml", 'extends = "cpu-disk-int8"\n[pipeline]\nname = "mine"\n')
    pipeline = load_pipeline(child)
    assert pipeline.quality.record == str(PIPELINES / "quality" / "cpu-disk-int8.json")


def test_show_says_which_file_each_setting_came_from(capsys):
    assert main(["pipeline", "show", "cpu-disk-zstd"]) == 0
    out = capsys.readouterr().out
    zstd, disk = str(PIPELINES / "cpu-disk-zstd.toml"), str(PIPELINES / "cpu-disk.toml")
    assert out.splitlines()[0] == f"# {zstd} (extends {disk} <- {LOCAL_CPU})"
    lines = {line.split(" = ")[0].strip(): line for line in out.splitlines() if " = " in line}
    assert lines["chunk_size"].endswith(f"# from {LOCAL_CPU}:6")
    assert lines["name"].endswith(f"# from {zstd}:{_line(zstd, 'name = ')}")
    assert f"# from {zstd}:{_line(zstd, 'path = ')}" in out  # the disk's path: the child's
    assert f"# from {disk}:{_line(disk, 'capacity = ')}" in out  # its capacity: cpu-disk's
    assert main(["pipeline", "show", "--json", "cpu-disk-zstd"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["extends"] == [disk, LOCAL_CPU]
    assert document["from"]["tiers.disk.timeout_s"] == f"{disk}:{_line(disk, 'timeout_s = ')}"


def _line(path: str, start: str) -> int:
    return next(i for i, line in enumerate(Path(path).read_text().splitlines(), 1) if line.startswith(start))
