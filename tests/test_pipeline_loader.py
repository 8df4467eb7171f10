"""Pipeline files: every kind of mistake is reported at its FILE:LINE:COL, all at once.

Each case writes a small TOML text whose mistake sits on a known line, loads it
through the public ``loads_pipeline`` / ``load_pipeline``, and checks the
diagnostic's kind, position and the words a user needs (the "did you mean").
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from flowkv.pipeline import (
    Diagnostic,
    PipelineError,
    builtin_pipelines,
    load_pipeline,
    loads_pipeline,
    resolve_source,
)

FIXTURES = Path(__file__).parent / "fixtures" / "pipelines"
FILE = "case.toml"


def diagnostics(text: str) -> list[Diagnostic]:
    """The diagnostics of a text that must fail to load."""
    with pytest.raises(PipelineError) as caught:
        loads_pipeline(textwrap.dedent(text).lstrip("\n"), file=FILE)
    found = caught.value.diagnostics
    assert found, "a PipelineError must carry at least one diagnostic"
    # The message is exactly the diagnostics, one FILE:LINE:COL per line.
    assert str(caught.value).splitlines() == [str(d) for d in found]
    return found


def only(text: str) -> Diagnostic:
    found = diagnostics(text)
    assert len(found) == 1, "\n".join(map(str, found))
    return found[0]


def at(diag: Diagnostic, line: int, col: int = 1) -> None:
    assert (diag.file, diag.line, diag.col) == (FILE, line, col), str(diag)
    assert str(diag).startswith(f"{FILE}:{line}:{col}: ")


# -- one mistake each ----------------------------------------------------------


def test_toml_syntax_error_points_at_the_bad_character():
    d = only(
        """
        [pipeline]
        name = "x"
        chunk_size = = 256
        """
    )
    assert d.kind == "syntax"
    at(d, 3, 14)  # the second '='
    assert "TOML syntax" in d.message
    assert "(at line" not in d.message  # the position is said once, in front


def test_unknown_section_suggests_the_close_one():
    d = only(
        """
        [pipeline]
        name = "x"

        [telemetri]
        exporter = "none"
        """
    )
    assert d.kind == "unknown-key"
    at(d, 4)
    assert "unknown section 'telemetri'" in d.message
    assert "did you mean 'telemetry'?" in d.message


def test_unknown_section_first_seen_in_an_array_of_tables_header():
    d = only(
        """
        [pipeline]
        name = "x"

        [[stor.stages]]
        use = "pass-through"
        """
    )
    at(d, 4)
    assert "did you mean 'store'?" in d.message


def test_unknown_key_in_pipeline_section():
    d = only(
        """
        [pipeline]
        name = "x"
        chunk_sise = 128
        """
    )
    assert d.kind == "unknown-key"
    at(d, 3)
    assert "unknown key 'chunk_sise'" in d.message
    assert "did you mean 'chunk_size'?" in d.message
    assert "valid keys:" in d.message


def test_wrong_type_of_a_value():
    d = only(
        """
        [pipeline]
        name = "x"
        save_partial_chunks = false
        chunk_size = "256"
        """
    )
    assert d.kind == "invalid-value"
    at(d, 4)
    assert "chunk_size" in d.message and "expected int, got str" in d.message


def test_bool_is_not_an_int():
    d = only("[pipeline]\nchunk_size = true\n")
    at(d, 2)
    assert "expected int, got bool" in d.message


def test_missing_use():
    d = only(
        """
        [[store.stages]]
        use = "pass-through"

        [[store.stages]]
        limit = 3
        """
    )
    assert d.kind == "missing-key"
    at(d, 4)  # the [[store.stages]] header of the second table
    assert "#2" in d.message and "'use'" in d.message


def test_use_that_is_not_a_string():
    d = only('[[store.stages]]\nuse = 3\n')
    assert d.kind == "invalid-value"
    at(d, 2)
    assert "'use' must be a string naming the stage, got int 3" in d.message


def test_unknown_stage_name_suggests_the_close_one():
    d = only(
        """
        [pipeline]
        name = "x"

        [[store.stages]]
        use = "pass-thru"
        """
    )
    assert d.kind == "unknown-stage"
    at(d, 5)
    assert "unknown stage 'pass-thru'" in d.message
    assert "did you mean 'pass-through'?" in d.message


def test_dotted_name_with_missing_module_gives_an_install_hint():
    d = only(
        """
        [[store.stages]]
        use = "flowkv_no_such_package.stages:compact"
        """
    )
    assert d.kind == "module-not-found"
    at(d, 2)
    assert "module 'flowkv_no_such_package' is not installed" in d.message
    assert "pip install flowkv_no_such_package" in d.message


def test_dotted_name_with_missing_attribute_names_the_module_file():
    d = only(
        """
        [[store.stages]]
        use = "flowkv.stages.basic:pass_thru"
        """
    )
    assert d.kind == "attribute-not-found"
    at(d, 2)
    assert "has no attribute 'pass_thru'" in d.message
    assert "basic.py" in d.message  # where it looked
    assert "pip install" not in d.message  # the module is there: no install hint


def test_dotted_name_of_a_function_that_is_not_a_stage():
    d = only('[[store.stages]]\nuse = "textwrap:dedent"\n')
    assert d.kind == "misuse"
    at(d, 2)
    assert "not declared with @flowkv.stage" in d.message


def test_unknown_key_in_stage_settings():
    d = only(
        """
        [[store.stages]]
        use = "take"
        limit = 2
        limt = 3
        """
    )
    assert d.kind == "unknown-key"
    at(d, 4)
    assert "stage 'take'" in d.message and "did you mean 'limit'?" in d.message


def test_missing_required_stage_setting():
    d = only(
        """
        [[store.stages]]
        use = "pass-through"

        [[store.stages]]
        use = "take"
        """
    )
    assert d.kind == "missing-key"
    at(d, 4)
    assert "stage 'take': missing required key 'limit'" in d.message


def test_stage_setting_of_the_wrong_type():
    d = only('[[store.stages]]\nuse = "take"\nlimit = "eight"\n')
    assert d.kind == "invalid-value"
    at(d, 3)
    assert "limit" in d.message


def test_stage_in_the_wrong_list():
    found = diagnostics(
        """
        [tiers.memory]
        kind = "memory"

        [[retrieve.stages]]
        use = "tokenize"

        [[retrieve.stages]]
        use = "compress"
        """
    )
    wrong = [d for d in found if "cannot run in a retrieve pipeline" in d.message]
    assert len(wrong) == 1
    assert wrong[0].kind == "graph"
    at(wrong[0], 8)
    assert "it runs in: store" in wrong[0].message


def test_stage_whose_needed_facet_no_earlier_stage_gives():
    d = only(
        """
        [tiers.memory]
        kind = "memory"

        [[store.stages]]
        use = "tokenize"

        [[store.stages]]
        use = "chunk-hash"

        [[store.stages]]
        use = "gather"
        """
    )
    assert d.kind == "graph"
    at(d, 11)
    assert "stage 'gather' needs buffer" in d.message
    assert "add 'allocate' before it" in d.message


def test_stage_referencing_an_undeclared_tier():
    d = only(
        """
        [tiers.memory]
        kind = "memory"

        [tiers.disk]
        path = "/tmp/flowkv-never-created"
        capacity = "1GiB"

        [[store.stages]]
        use = "tokenize"

        [[store.stages]]
        use = "chunk-hash"

        [[store.stages]]
        use = "allocate"

        [[store.stages]]
        use = "gather"

        [[store.stages]]
        use = "put"
        tiers = ["memory", "dsik"]
        """
    )
    assert d.kind == "unknown-tier"
    at(d, 22)
    assert "tier 'dsik' is not declared" in d.message
    assert "did you mean 'disk'?" in d.message


def test_undeclared_disk_tier_says_how_to_declare_it():
    found = diagnostics(
        """
        [tiers.memory]
        kind = "memory"

        [[store.stages]]
        use = "put"
        tiers = ["disk"]
        """
    )
    undeclared = [d for d in found if d.kind == "unknown-tier"]
    assert len(undeclared) == 1
    at(undeclared[0], 6)
    assert "tier 'disk' is not declared" in undeclared[0].message
    assert "[tiers.disk]" in undeclared[0].message


@pytest.mark.parametrize("size", ["4GB B", "lots", "4 GiBs", "-1GiB"])
def test_bad_size(size):
    d = only(f'[tiers.memory]\nkind = "memory"\ncapacity = "{size}"\n')
    assert d.kind == "invalid-value"
    at(d, 3)
    assert "capacity" in d.message and "invalid size" in d.message


def test_negative_integer_size():
    d = only('[tiers.memory]\nkind = "memory"\ncapacity = -3\n')
    at(d, 3)
    assert "cannot be negative" in d.message


@pytest.mark.parametrize("value", [0, -256])
def test_chunk_size_must_be_positive(value):
    d = only(f'[pipeline]\nname = "x"\nchunk_size = {value}\n')
    assert d.kind == "invalid-value"
    at(d, 3)
    assert f"chunk_size must be positive, got {value}" in d.message


def test_unknown_hash_function():
    d = only('[pipeline]\nname = "x"\nhash = "sha257"\n')
    assert d.kind == "invalid-value"
    at(d, 3)
    assert "unknown hash function 'sha257'" in d.message
    assert "sha256" in d.message


@pytest.mark.parametrize("value", [1.5, -0.1])
def test_sampling_out_of_range(value):
    d = only(f'[telemetry]\nexporter = "console"\nsampling = {value}\n')
    assert d.kind == "invalid-value"
    at(d, 3)
    assert "sampling must be between 0 and 1" in d.message


def test_otlp_without_endpoint():
    d = only('[pipeline]\nname = "x"\n\n[telemetry]\nexporter = "otlp"\n')
    assert d.kind == "missing-key"
    at(d, 5)
    assert "needs an endpoint" in d.message


def test_otlp_with_endpoint_loads():
    pipeline = loads_pipeline('[telemetry]\nexporter = "otlp"\nendpoint = "http://localhost:4317"\n')
    assert pipeline.telemetry.endpoint == "http://localhost:4317"


def test_unknown_exporter():
    d = only('[telemetry]\nexporter = "jaeger"\n')
    assert d.kind == "invalid-value"
    at(d, 2)
    assert "jaeger" in d.message


def test_unknown_tier_kind():
    d = only(
        """
        [tiers.fast]
        capacity = "1GiB"
        kind = "memroy"
        """
    )
    assert d.kind == "unknown-tier"
    at(d, 3)
    assert "tier 'fast'" in d.message and "did you mean 'memory'?" in d.message


def test_tier_without_kind_and_not_a_kind_name():
    d = only('[tiers.fast]\ncapacity = "1GiB"\n')
    assert d.kind == "missing-key"
    at(d, 1)
    assert "tier 'fast': missing required key 'kind'" in d.message


def test_unknown_key_in_tier_table():
    d = only(
        """
        [tiers.memory]
        kind = "memory"
        capacty = "1GiB"
        """
    )
    assert d.kind == "unknown-key"
    at(d, 3)
    assert "tier 'memory'" in d.message and "did you mean 'capacity'?" in d.message


def test_unknown_key_in_disk_tier_lists_its_own_and_guard_keys_apart():
    d = only(
        """
        [tiers.disk]
        path = "/tmp/flowkv-never-created"
        capacity = "1GiB"
        timeout_s = 0.5
        fsynk = true

        [tiers.memory]
        """
    )
    at(d, 5)
    assert "did you mean 'fsync'?" in d.message


def test_empty_tiers_table():
    d = only('[pipeline]\nname = "x"\n\n[tiers]\n')
    assert d.kind == "missing-key"
    at(d, 4)


# -- columns -----------------------------------------------------------------


def test_column_of_an_indented_key():
    d = only('[pipeline]\n    name = "x"\n    chunk_sise = 3\n')
    at(d, 3, 5)


def test_column_of_a_key_in_an_inline_table():
    d = only('[tiers]\nmemory = { kind = "memory", capacty = 3 }\n')
    at(d, 2, 29)
    assert "did you mean 'capacity'?" in d.message


def test_column_of_a_key_in_an_inline_stage_table():
    found = diagnostics('[store]\nstages = [ { use = "take", limt = 2 } ]\n')
    unknown = [d for d in found if d.kind == "unknown-key"]
    assert len(unknown) == 1
    at(unknown[0], 2, 28)


def test_positions_survive_crlf_multiline_strings_and_quoted_keys():
    text = (
        '[pipeline]\r\n'
        'description = """\r\n'
        '[not.a.table]\r\n'
        'chunk_sise = 1\r\n'
        '"""\r\n'
        '"hsh" = "sha256"\r\n'
    )
    with pytest.raises(PipelineError) as caught:
        loads_pipeline(text, file=FILE)
    (d,) = caught.value.diagnostics
    at(d, 6)
    assert "unknown key 'hsh'" in d.message


# -- many mistakes at once ---------------------------------------------------


def test_every_error_of_a_file_is_reported_at_once():
    found = diagnostics(
        """
        [pipline]

        [pipeline]
        chunk_size = 0
        hsh = "sha256"

        [tiers.memory]
        kind = "memory"
        capacity = "4GB B"

        [[store.stages]]
        use = "take"

        [[store.stages]]
        use = "nope"

        [telemetry]
        sampling = 2.0
        """
    )
    got = [(d.line, d.kind) for d in found]
    assert got == [
        (1, "unknown-key"),  # [pipline]
        (4, "invalid-value"),  # chunk_size = 0, despite the unknown key beside it
        (5, "unknown-key"),  # hsh
        (9, "invalid-value"),  # capacity
        (11, "missing-key"),  # take without limit
        (15, "unknown-stage"),  # nope
        (18, "invalid-value"),  # sampling
    ], "\n".join(map(str, found))


def test_broken_fixture_file_reports_its_path():
    path = FIXTURES / "multi_errors.toml"
    with pytest.raises(PipelineError) as caught:
        load_pipeline(path)
    lines = [(d.line, d.kind) for d in caught.value.diagnostics]
    assert lines == [
        (4, "invalid-value"),
        (5, "unknown-key"),
        (9, "invalid-value"),
        (12, "unknown-stage"),
        (14, "missing-key"),
        (18, "missing-key"),
    ]
    assert all(d.file == str(path) for d in caught.value.diagnostics)


# -- what loads --------------------------------------------------------------


def test_defaults_are_filled_in():
    pipeline = loads_pipeline('[[store.stages]]\nuse = "take"\nlimit = 2\n')
    assert pipeline.name == "unnamed" and pipeline.source == "<string>"
    assert pipeline.chunk_size == 256
    assert pipeline.telemetry.exporter == "none" and pipeline.telemetry.sampling == 1.0
    (take,) = pipeline.store
    assert take.name == "take" and take.settings() == {"limit": 2}
    assert str(take.location) == "<string>:1:1"
    assert pipeline.retrieve == () and pipeline.lookup == ()


def test_sizes_become_bytes():
    pipeline = loads_pipeline('[tiers.memory]\nkind = "memory"\ncapacity = "64MiB"\n')
    assert pipeline.tiers["memory"].config.capacity == 64 * 2**20


def test_lookup_defaults_to_the_lookup_capable_head_of_retrieve():
    pipeline = load_pipeline("local-cpu")
    assert [s.name for s in pipeline.lookup] == ["tokenize", "chunk-hash", "lookup"]


def test_overrides_replace_settings_before_checking():
    text = (FIXTURES / "minimal.toml").read_text()
    pipeline = loads_pipeline(
        text, overrides={"chunk_size": 32, "tiers.memory.capacity": "1MiB", "telemetry.sampling": 0.25}
    )
    assert pipeline.chunk_size == 32
    assert pipeline.tiers["memory"].config.capacity == 2**20
    assert pipeline.telemetry.sampling == 0.25


def test_bad_override_is_reported():
    text = (FIXTURES / "minimal.toml").read_text()
    with pytest.raises(PipelineError) as caught:
        loads_pipeline(text, overrides={"pipeline.chunk_size": -1})
    assert [d.kind for d in caught.value.diagnostics] == ["invalid-value"]
    assert "chunk_size must be positive" in str(caught.value)
    with pytest.raises(PipelineError, match="'name' is not a table"):
        loads_pipeline(text, overrides={"pipeline.name.x": 1})


def test_load_pipeline_overrides_a_builtin():
    pipeline = load_pipeline("local-cpu", overrides={"chunk_size": 64})
    assert pipeline.chunk_size == 64 and pipeline.name == "local-cpu"


@pytest.mark.parametrize("name", sorted(builtin_pipelines()))
def test_every_builtin_pipeline_validates(name):
    pipeline = load_pipeline(name)
    assert pipeline.store and pipeline.retrieve and pipeline.tiers
    assert Path(pipeline.source).name == f"{name}.toml"


def test_builtins_include_local_cpu():
    assert "local-cpu" in builtin_pipelines()


# -- resolve_source ----------------------------------------------------------


def test_resolve_source_by_name_and_by_path(tmp_path, monkeypatch):
    assert resolve_source("local-cpu") == builtin_pipelines()["local-cpu"]
    own = tmp_path / "mine.toml"
    own.write_text("")
    assert resolve_source(own) == own
    assert resolve_source(str(own)) == own
    monkeypatch.chdir(tmp_path)
    assert resolve_source("mine.toml") == Path("mine.toml")


def test_resolve_source_unknown_name_suggests_and_lists_builtins():
    with pytest.raises(FileNotFoundError) as caught:
        resolve_source("local-cpo")
    message = str(caught.value)
    assert "no built-in pipeline named 'local-cpo'" in message
    assert "did you mean 'local-cpu'?" in message
    assert "local-cpu" in message.split("built-ins:")[1]


def test_resolve_source_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="pipeline file not found"):
        resolve_source(tmp_path / "absent.toml")
    with pytest.raises(FileNotFoundError, match="pipeline file not found"):
        resolve_source("some/dir/absent")


def test_tiers_without_a_memory_tier():
    d = only(
        """
        [tiers.disk]
        kind = "disk"
        path = "/tmp/flowkv-never-created"
        capacity = "1GiB"
        """
    )
    assert d.kind == "graph"
    assert "exactly one tier of kind 'memory' (found 0)" in d.message


def test_two_memory_tiers_point_at_the_second():
    d = only(
        """
        [tiers.fast]
        kind = "memory"

        [tiers.more]
        kind = "memory"
        """
    )
    at(d, 4)
    assert "found 2: fast, more" in d.message


def test_dumps_pipeline_reads_back():
    from flowkv.pipeline import dumps_pipeline

    text = dumps_pipeline(
        pipeline={"name": "built", "chunk_size": 64},
        tiers={"memory": {"kind": "memory", "capacity": "8MiB"}},
        store=["tokenize", "chunk-hash", "allocate", "gather", ("compress", {"codec": "zstd", "level": 1}),
               ("put", {"tiers": ["memory"]})],
        retrieve=["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"],
        sections={"telemetry": {"exporter": "none"}},
    )
    pipeline = loads_pipeline(text)
    assert pipeline.name == "built" and pipeline.chunk_size == 64
    assert [s.name for s in pipeline.store][-2:] == ["compress", "put"]
    compress = pipeline.store[4].settings()
    assert compress["codec"] == "zstd" and compress["level"] == 1
    assert pipeline.store[5].settings()["tiers"] == ["memory"]
    assert [s.name for s in pipeline.lookup] == ["tokenize", "chunk-hash", "lookup"]
