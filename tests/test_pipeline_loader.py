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


def mistake(name: str, text: str, kind: str, line: int, *says: str, col: int = 1, absent: tuple[str, ...] = ()):
    """One file with one mistake: the diagnostic's kind, FILE:LINE:COL, and words it must (not) say."""
    return pytest.param(text, kind, line, col, says, absent, id=name)


ONE_MISTAKE = [
    mistake(
        "toml-syntax-points-at-the-bad-character",
        """
        [pipeline]
        name = "x"
        chunk_size = = 256
        """,
        "syntax", 3, "TOML syntax",
        col=14,  # the second '='
        absent=("(at line",),  # the position is said once, in front
    ),
    mistake(
        "unknown-section-suggests-the-close-one",
        """
        [pipeline]
        name = "x"

        [telemetri]
        exporter = "none"
        """,
        "unknown-key", 4, "unknown section 'telemetri'", "did you mean 'telemetry'?",
    ),
    mistake(
        "unknown-section-first-seen-in-an-array-of-tables-header",
        """
        [pipeline]
        name = "x"

        [[stor.stages]]
        use = "pass-through"
        """,
        "unknown-key", 4, "did you mean 'store'?",
    ),
    mistake(
        "unknown-key-in-pipeline-section",
        """
        [pipeline]
        name = "x"
        chunk_sise = 128
        """,
        "unknown-key", 3, "unknown key 'chunk_sise'", "did you mean 'chunk_size'?", "valid keys:",
    ),
    mistake(
        "wrong-type-of-a-value",
        """
        [pipeline]
        name = "x"
        save_partial_chunks = false
        chunk_size = "256"
        """,
        "invalid-value", 4, "chunk_size", "expected int, got str",
    ),
    mistake("bool-is-not-an-int", "[pipeline]\nchunk_size = true\n", "invalid-value", 2, "expected int, got bool"),
    mistake(
        "missing-use",
        """
        [[store.stages]]
        use = "pass-through"

        [[store.stages]]
        limit = 3
        """,
        "missing-key", 4, "#2", "'use'",  # at the [[store.stages]] header of the second table
    ),
    mistake(
        "use-that-is-not-a-string",
        '[[store.stages]]\nuse = 3\n',
        "invalid-value", 2, "'use' must be a string naming the stage, got int 3",
    ),
    mistake(
        "unknown-stage-name-suggests-the-close-one",
        """
        [pipeline]
        name = "x"

        [[store.stages]]
        use = "pass-thru"
        """,
        "unknown-stage", 5, "unknown stage 'pass-thru'", "did you mean 'pass-through'?",
    ),
    mistake(
        "dotted-name-with-missing-module-gives-an-install-hint",
        """
        [[store.stages]]
        use = "flowkv_no_such_package.stages:compact"
        """,
        "module-not-found", 2,
        "module 'flowkv_no_such_package' is not installed", "pip install flowkv_no_such_package",
    ),
    mistake(
        "dotted-name-with-missing-attribute-names-the-module-file",
        """
        [[store.stages]]
        use = "flowkv.stages.basic:pass_thru"
        """,
        "attribute-not-found", 2, "has no attribute 'pass_thru'",
        "basic.py",  # where it looked
        absent=("pip install",),  # the module is there: no install hint
    ),
    mistake(
        "dotted-name-of-a-function-that-is-not-a-stage",
        '[[store.stages]]\nuse = "textwrap:dedent"\n',
        "misuse", 2, "not declared with @flowkv.stage",
    ),
    mistake(
        "unknown-key-in-stage-settings",
        """
        [[store.stages]]
        use = "take"
        limit = 2
        limt = 3
        """,
        "unknown-key", 4, "stage 'take'", "did you mean 'limit'?",
    ),
    mistake(
        "missing-required-stage-setting",
        """
        [[store.stages]]
        use = "pass-through"

        [[store.stages]]
        use = "take"
        """,
        "missing-key", 4, "stage 'take': missing required key 'limit'",
    ),
    mistake(
        "stage-setting-of-the-wrong-type",
        '[[store.stages]]\nuse = "take"\nlimit = "eight"\n',
        "invalid-value", 3, "limit",
    ),
    mistake(
        "stage-whose-needed-facet-no-earlier-stage-gives",
        """
        [tiers.memory]
        kind = "memory"

        [[store.stages]]
        use = "tokenize"

        [[store.stages]]
        use = "chunk-hash"

        [[store.stages]]
        use = "gather"
        """,
        "graph", 11, "stage 'gather' needs buffer", "add 'allocate' before it",
    ),
    mistake(
        "stage-referencing-an-undeclared-tier",
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
        """,
        "unknown-tier", 22, "tier 'dsik' is not declared", "did you mean 'disk'?",
    ),
    # Tier policy is stage options: each one checked where it is written.
    mistake(
        "lookup-asking-an-undeclared-tier",
        """
        [tiers.memory]
        kind = "memory"

        [[retrieve.stages]]
        use = "tokenize"

        [[retrieve.stages]]
        use = "chunk-hash"

        [[retrieve.stages]]
        use = "lookup"
        tiers = ["memroy"]
        """,
        "unknown-tier", 12, "stage 'lookup': tier 'memroy' is not declared", "did you mean 'memory'?",
    ),
    mistake(
        "get-promote-is-a-bool",
        """
        [tiers.memory]
        kind = "memory"

        [[retrieve.stages]]
        use = "tokenize"

        [[retrieve.stages]]
        use = "chunk-hash"

        [[retrieve.stages]]
        use = "lookup"

        [[retrieve.stages]]
        use = "get"
        promote = "yes"
        """,
        "invalid-value", 15, "stage 'get' promote", "expected bool",
    ),
    mistake(
        "lookup-prefetch-is-a-bool",
        """
        [tiers.memory]
        kind = "memory"

        [[retrieve.stages]]
        use = "tokenize"

        [[retrieve.stages]]
        use = "chunk-hash"

        [[retrieve.stages]]
        use = "lookup"
        prefetch = 1
        """,
        "invalid-value", 12, "stage 'lookup' prefetch", "expected bool",
    ),
    mistake(
        "misspelled-tier-policy-option",
        """
        [tiers.memory]
        kind = "memory"

        [[retrieve.stages]]
        use = "tokenize"

        [[retrieve.stages]]
        use = "chunk-hash"

        [[retrieve.stages]]
        use = "lookup"

        [[retrieve.stages]]
        use = "get"
        promte = false
        """,
        "unknown-key", 15, "did you mean 'promote'?",
    ),
    *(
        mistake(f"bad-size-{size}", f'[tiers.memory]\nkind = "memory"\ncapacity = "{size}"\n',
                "invalid-value", 3, "capacity", "invalid size")
        for size in ["4GB B", "lots", "4 GiBs", "-1GiB"]
    ),
    mistake(
        "bad-quota-size",
        '[tiers.memory]\nkind = "memory"\nquotas = { default = "1GiB", acme = "8 GiBs" }\n',
        "invalid-value", 3, "quotas.acme", "invalid size", col=30,
    ),
    mistake(
        "bad-quota-tenant-name",
        '[tiers.memory]\nkind = "memory"\nquotas = { "a b" = "1GiB" }\n',
        "invalid-value", 3, "tenant name 'a b'", col=12,
    ),
    mistake(
        "quotas-not-a-table",
        '[tiers.memory]\nkind = "memory"\nquotas = "1GiB"\n',
        "invalid-value", 3, "expected a table of tenant = size",
    ),
    mistake(
        "zero-quota",
        '[tiers.memory]\nkind = "memory"\nquotas = { acme = 0 }\n',
        "invalid-value", 3, "quotas.acme: a quota must be above 0 B", col=12,
    ),
    mistake(
        "negative-integer-size",
        '[tiers.memory]\nkind = "memory"\ncapacity = -3\n',
        "invalid-value", 3, "cannot be negative",
    ),
    *(
        mistake(f"chunk-size-must-be-positive-{value}", f'[pipeline]\nname = "x"\nchunk_size = {value}\n',
                "invalid-value", 3, f"chunk_size must be positive, got {value}")
        for value in [0, -256]
    ),
    mistake(
        "unknown-hash-function",
        '[pipeline]\nname = "x"\nhash = "sha257"\n',
        "invalid-value", 3, "unknown hash function 'sha257'", "sha256",
    ),
    *(
        mistake(f"sampling-out-of-range-{value}", f'[telemetry]\nexporter = "console"\nsampling = {value}\n',
                "invalid-value", 3, "sampling must be between 0 and 1")
        for value in [1.5, -0.1]
    ),
    mistake(
        "otlp-without-endpoint",
        '[pipeline]\nname = "x"\n\n[telemetry]\nexporter = "otlp"\n',
        "missing-key", 5, "needs an endpoint",
    ),
    mistake("unknown-exporter", '[telemetry]\nexporter = "jaeger"\n', "invalid-value", 2, "jaeger"),
    mistake(
        "unknown-tier-kind",
        """
        [tiers.fast]
        capacity = "1GiB"
        kind = "memroy"
        """,
        "unknown-tier", 3, "tier 'fast'", "did you mean 'memory'?",
    ),
    mistake(
        "tier-without-kind-and-not-a-kind-name",
        '[tiers.fast]\ncapacity = "1GiB"\n',
        "missing-key", 1, "tier 'fast': missing required key 'kind'",
    ),
    mistake(
        "unknown-key-in-tier-table",
        """
        [tiers.memory]
        kind = "memory"
        capacty = "1GiB"
        """,
        "unknown-key", 3, "tier 'memory'", "did you mean 'capacity'?",
    ),
    mistake(
        "unknown-key-in-disk-tier-lists-its-own-and-guard-keys-apart",
        """
        [tiers.disk]
        path = "/tmp/flowkv-never-created"
        capacity = "1GiB"
        timeout_s = 0.5
        fsynk = true

        [tiers.memory]
        """,
        "unknown-key", 5, "did you mean 'fsync'?",
    ),
    mistake("empty-tiers-table", '[pipeline]\nname = "x"\n\n[tiers]\n', "missing-key", 4),
    mistake(
        "tiers-without-a-memory-tier",
        """
        [tiers.disk]
        kind = "disk"
        path = "/tmp/flowkv-never-created"
        capacity = "1GiB"
        """,
        "graph", 1, "declare a tier that holds objects, of kind 'memory' or 'server' (found none)",
    ),
    mistake(
        "two-memory-tiers-point-at-the-second",
        """
        [tiers.fast]
        kind = "memory"

        [tiers.more]
        kind = "memory"
        """,
        "graph", 4, "found 2: fast, more",
    ),
    # Columns.
    mistake("column-of-an-indented-key", '[pipeline]\n    name = "x"\n    chunk_sise = 3\n', "unknown-key", 3, col=5),
    mistake(
        "column-of-a-key-in-an-inline-table",
        '[tiers]\nmemory = { kind = "memory", capacty = 3 }\n',
        "unknown-key", 2, "did you mean 'capacity'?", col=29,
    ),
]


@pytest.mark.parametrize(("text", "kind", "line", "col", "says", "absent"), ONE_MISTAKE)
def test_one_mistake_is_reported_at_its_place(text, kind, line, col, says, absent):
    d = only(text)
    assert d.kind == kind, str(d)
    at(d, line, col)
    for words in says:
        assert words in d.message
    for words in absent:
        assert words not in d.message


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


def test_otlp_with_endpoint_loads():
    pipeline = loads_pipeline('[telemetry]\nexporter = "otlp"\nendpoint = "http://localhost:4317"\n')
    assert pipeline.telemetry.endpoint == "http://localhost:4317"


# -- columns -----------------------------------------------------------------


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


def _blends(name: str) -> bool:
    return "\n[blend]\n" in builtin_pipelines()[name].read_text()


@pytest.mark.parametrize("name", sorted(builtin_pipelines()))
def test_every_builtin_pipeline_validates(name):
    # A blend pipeline has no separator that fits every tokenizer: the user gives it.
    overrides = {"blend.separator": [271]} if _blends(name) else None
    pipeline = load_pipeline(name, overrides=overrides)
    # An engine's pipeline runs store and retrieve lists; a node server's (node-server-disk) its server list.
    assert (pipeline.store and pipeline.retrieve or pipeline.server) and pipeline.tiers
    assert Path(pipeline.source).name == f"{name}.toml"
    if overrides:
        with pytest.raises(PipelineError, match=rf"{name}\.toml:\d+:1: \[blend\]: missing required key 'separator'"):
            load_pipeline(name)


def test_the_blend_builtins_exist():
    assert {name for name in builtin_pipelines() if _blends(name)} == {"blend", "blend-disk"}


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


# -- a node server's pipeline -------------------------------------------------------


def test_a_server_pipeline_is_its_lower_tiers_and_its_server_list():
    pipeline = loads_pipeline(textwrap.dedent("""
        [pipeline]
        name = "server"

        [tiers.disk]
        kind = "disk"
        path = "/tmp/flowkv-unused"
        capacity = "1GiB"

        [[server.stages]]
        use = "compress"
        codec = "lz4"

        [[server.stages]]
        use = "put"
        tiers = ["memory", "disk"]
        """), file=FILE)
    # No object tier declared (the server's arena is one), committed chunks carry the KV compress needs,
    # and "memory" names the arena.
    assert [s.name for s in pipeline.server] == ["compress", "put"]
    assert (pipeline.store, pipeline.retrieve, pipeline.lookup) == ((), (), ())
    assert list(pipeline.tiers) == ["disk"]


def test_server_list_mistakes_are_each_at_their_line():
    found = diagnostics("""
        [tiers.memory]
        kind = "memory"

        [[store.stages]]
        use = "tokenize"

        [[server.stages]]
        use = "gather"

        [[server.stages]]
        use = "put"
        tiers = ["memroy"]
        """)
    by_line = {d.line: d for d in found}
    assert "runs no store list, but this one has one (case.toml:4:1)" in by_line[7].message
    assert by_line[8].message == "stage 'gather' cannot run in a server pipeline (it runs in: store)"
    assert "tier 'memroy' is not declared; did you mean 'memory'?" in by_line[12].message
    assert {d.kind for d in found} == {"graph", "unknown-tier"}


def test_an_engine_refuses_a_server_pipeline():
    import torch

    from flowkv import CacheEngine
    from flowkv.kernels import KVGeometry

    geometry = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'node-server-disk' .* is a node server's .* node-disk"):
        CacheEngine.from_pipeline("node-server-disk", geometry=geometry, model_name="m")
