"""The README's commands that start no vLLM, run as a user runs them, at small sizes; and every example file.

Benchmarks go through the real command line (``flowkv.cli.main``). Their
figures are never held to a time limit: what is checked is the table's
shape and the relations that must hold whatever the machine's speed — each
printed ratio is the quotient of the printed (or reported) times it names,
each rate the bytes over the time, the byte counts what the sizes say.
Printed numbers are rounded, so a relation between printed numbers is
checked against the rounding of each (``consistent``).

The vLLM commands (``flowkv demo``, ``bench ttft``, ``bench capacity``,
``flowkv quality``) are in ``test_readme_vllm_commands.py``,
``test_bench_capacity.py`` and ``test_quality.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flowkv import CacheEngine, KVTransfer, telemetry
from flowkv.cli import main
from flowkv.kernels import KVGeometry, gather
from flowkv.testing import make_paged_kv, random_slot_mapping
from otlp_receiver import otlp_grpc_receiver  # noqa: F401 - pytest fixture
from redis_servers import redis_cluster  # noqa: F401 - pytest fixture
from test_example_tier import site  # noqa: F401 - pytest fixture: the sqlite example, pip-installed

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NUMBER = r"-?\d+(?:\.\d+)?"


def consistent(printed: float, numerator: float, denominator: float, *, decimals: tuple[int, int, int]) -> bool:
    """Whether ``printed`` (rounded to ``decimals[0]`` places) can be ``numerator / denominator``,
    each of those rounded to ``decimals[1]`` and ``decimals[2]`` places."""
    def bounds(value: float, places: int) -> tuple[float, float]:
        half = 0.5 * 10 ** -places
        return value - half, value + half

    low_n, high_n = bounds(numerator, decimals[1])
    low_d, high_d = bounds(denominator, decimals[2])
    if low_d <= 0:
        return True  # the denominator rounds to nothing: any quotient fits
    low_p, high_p = bounds(printed, decimals[0])
    return low_p <= max(high_n, 0) / low_d and max(low_n, 0) / high_d <= high_p


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# -- flowkv bench runner ------------------------------------------------------------


def test_bench_runner_prints_each_mode_against_the_hand_loop(capsys):
    status, out, _ = run_cli(capsys, "bench", "runner", "--items", "1200", "--run-items", "100",
                             "--stages", "3", "--repeat", "1")
    assert status == 0
    assert out.startswith("runner overhead: 3 pass-through stages, 1200 items in 12 runs of 100")
    rows = {m.group(1): [float(x) for x in m.groups()[1:]]
            for m in re.finditer(rf"^(hand|off|sampled|on) +({NUMBER}) +({NUMBER}) +({NUMBER}) +({NUMBER})$",
                                 out, re.M)}
    assert list(rows) == ["hand", "off", "sampled", "on"], out
    status, out, _ = run_cli(capsys, "bench", "runner", "--items", "1200", "--run-items", "100",
                             "--stages", "3", "--repeat", "1", "--json")
    report = json.loads(out)
    hand = report["results"]["hand"]["seconds"]
    for mode, row in report["results"].items():
        assert row["seconds"] > 0
        assert row["ratio_to_hand"] == pytest.approx(row["seconds"] / hand), mode


# -- flowkv bench engine ------------------------------------------------------------


def test_bench_engine_rates_and_ratios_follow_from_its_times(capsys):
    tokens = 512
    status, out, _ = run_cli(capsys, "bench", "engine", "--tokens", str(tokens), "--repeats", "1", "--json")
    assert status == 0
    report = json.loads(out)
    layers, heads, head_size = (int(x) for x in re.match(r"cpu-l(\d+)-h(\d+)-d(\d+)-", report["geometry"]).groups())
    assert report["kv_bytes"] == tokens * layers * 2 * heads * head_size * 2  # bf16 keys and values
    gb = report["kv_bytes"] / 1e9
    for what in ("copy", "store", "retrieve"):
        assert report[f"{what}_gbps"] == pytest.approx(gb / (report[f"{what}_ms"] / 1e3)), what
    for what in ("store", "retrieve"):
        assert report[f"{what}_vs_copy"] == pytest.approx(report["copy_ms"] / report[f"{what}_ms"]), what
        assert report[f"{what}_overhead_vs_fused"] == pytest.approx(report[f"{what}_ms"] / report[f"fused_{what}_ms"])
        assert report[f"{what}_ms"] <= report[f"{what}_median_ms"]  # the best run is no slower than the median
    assert report["hash_function"] in report["hash_mtokens_per_s"]
    assert all(rate > 0 for rate in report["hash_mtokens_per_s"].values())
    assert report["lookup_hit_keys_known_ms"] > 0 and report["lookup_miss_ms"] > 0

    status, out, _ = run_cli(capsys, "bench", "engine", "--tokens", str(tokens), "--repeats", "1")
    assert status == 0
    assert f"{tokens} tokens = {report['kv_bytes'] >> 20} MiB of KV" in out
    row = {m.group(1): m.groups()[1:] for m in re.finditer(
        rf"^(plain torch copy|store|retrieve) +({NUMBER}) +({NUMBER}) +({NUMBER})(?: +({NUMBER}))?$", out, re.M)}
    assert list(row) == ["plain torch copy", "store", "retrieve"], out
    copy_ms, copy_gbps, copy_x, _ = row["plain torch copy"]
    assert float(copy_x) == 1.0
    for what in ("store", "retrieve"):
        ms, gbps, x_copy, _ = (float(v) if v is not None else None for v in row[what])
        assert consistent(gbps, gb * 1e3, ms, decimals=(2, 6, 1)), (what, gbps, ms)
        assert consistent(x_copy, float(copy_ms), ms, decimals=(2, 1, 1)), (what, x_copy, copy_ms, ms)
    assert re.search(r"^hand-fused store +\d", out, re.M) and re.search(r"^hand-fused retrieve +\d", out, re.M)
    assert re.search(r"^lookup of \d+ tokens: hit [\d.]+ ms", out, re.M)


def test_bench_engine_worker_conditions_reports_each_condition_against_the_same_rounds_copy(capsys):
    tokens, rounds = 512, 2
    status, out, _ = run_cli(capsys, "bench", "engine", "--worker-conditions", "--tokens", str(tokens),
                             "--repeats", str(rounds), "--json")
    assert status == 0
    report = json.loads(out)
    w = report["worker_conditions"]
    assert w["copy_threads"] == min(2, w["cores"]) and w["load_cores"]
    gb = report["kv_bytes"] / 1e9
    assert w["copy_gbps"]["min"] <= w["copy_gbps"]["median"] <= w["copy_gbps"]["max"]
    assert set(w) >= {"standalone", "worker"} and set(w["worker"]) == {"store", "retrieve", "copy"}
    # The worker's copy helpers are started by the pinned thread, as in vLLM, and run off its core.
    helpers = w["copy_helpers"]["worker"]
    assert helpers["threads"] >= 1 and 0 <= helpers["share"] <= 1
    if w["cores"] > 1 and hasattr(os, "sched_setaffinity"):
        assert helpers["cores"] and sorted(os.sched_getaffinity(0))[0] not in helpers["cores"], helpers
    for condition in ("standalone", "worker"):
        for op, figures in w[condition].items():
            assert figures["min_gbps"] <= figures["median_gbps"] <= figures["max_gbps"], (condition, op)
            assert figures["median_gbps"] == pytest.approx(gb / (figures["median_ms"] / 1e3)), (condition, op)
            # a median of per-round ratios lies within the ratios' range
            low, high = figures["min_gbps"] / w["copy_gbps"]["max"], figures["max_gbps"] / w["copy_gbps"]["min"]
            assert low * 0.999 <= figures["vs_copy"] <= high * 1.001, (condition, op)

    status, out, _ = run_cli(capsys, "bench", "engine", "--worker-conditions", "--tokens", str(tokens),
                             "--repeats", "1")
    assert status == 0
    assert re.search(r"^copy baseline: plain torch copy, \d threads, idle cores", out, re.M), out
    assert re.search(r"^standalone \(\d+ torch threads, no load\)$", out, re.M)
    assert re.search(r"^worker \(1 thread, load on cores [\d,]+\)$", out, re.M)
    assert re.search(r"^worker: \d+ copy helper thread\(s\) on (?:cores [\d,]+|the caller's cores), \d+% of the pieces",
                     out, re.M), out
    assert len(re.findall(rf"^  (?:store|retrieve|plain copy) +{NUMBER} +{NUMBER} +{NUMBER}-{NUMBER} +{NUMBER}$",
                          out, re.M)) == 5, out


# -- flowkv bench tiers -------------------------------------------------------------


def test_bench_tiers_table_rates_follow_from_the_bytes(capsys, tmp_path):
    status, out, _ = run_cli(capsys, "bench", "tiers", "--tokens", "256", "--repeats", "1", "--dir", str(tmp_path),
                             "--json")
    assert status == 0
    report = json.loads(out)
    gb = report["kv_bytes"] / 1e9
    for name, row in report["tiers"].items():
        for op in ("put", "get"):
            assert row[f"{op}_gbps"] == pytest.approx(gb / (row[f"{op}_ms"] / 1e3)), (name, op)
            assert row[f"raw_{op}_gbps"] == pytest.approx(gb / (row[f"raw_{op}_ms"] / 1e3)), (name, op)
            assert row[f"{op}_vs_raw"] == pytest.approx(row[f"raw_{op}_ms"] / row[f"{op}_ms"]), (name, op)
    status, out, _ = run_cli(capsys, "bench", "tiers", "--tokens", "256", "--repeats", "1", "--dir", str(tmp_path))
    assert status == 0
    rows = re.findall(rf"^(memory|disk|redis) +({NUMBER}) +({NUMBER}) +({NUMBER}) +({NUMBER}) +({NUMBER}) +({NUMBER})"
                      rf" +({NUMBER}) +\S", out, re.M)
    assert [r[0] for r in rows] == ["memory", "disk", "redis"], out
    for name, put, raw_put, x_put, get, raw_get, x_get, lookup_ms in rows:
        assert consistent(float(x_put), float(put), float(raw_put), decimals=(2, 2, 2)), (name, "put")
        assert consistent(float(x_get), float(get), float(raw_get), decimals=(2, 2, 2)), (name, "get")
        assert float(lookup_ms) > 0
    assert list(tmp_path.iterdir()) == []


# -- flowkv bench codecs ------------------------------------------------------------


def test_bench_codecs_ratios_follow_from_the_payload_sizes(capsys):
    argv = ["bench", "codecs", "--synthetic", "--layers", "2", "--kv-heads", "2", "--head-size", "64",
            "--tokens", "128", "--codecs", "none,lz4,zstd-shuffle:level=1,int8", "--repeats", "1"]
    status, out, _ = run_cli(capsys, *argv, "--json")
    assert status == 0
    report = json.loads(out)
    assert report["raw_bytes"] == 2 * 2 * 128 * 2 * 64 * 2  # layers x kv x tokens x heads x dim x bf16
    rows = report["codecs"]
    assert [row["name"] for row in rows] == ["none", "lz4", "zstd-shuffle", "int8"]
    none = rows[0]
    for row in rows:
        name = row["name"]
        assert row["ratio"] == pytest.approx(report["raw_bytes"] / row["payload_bytes"]), name
        assert row["size_vs_none"] == pytest.approx(row["payload_bytes"] / none["payload_bytes"]), name
        assert row["encode_vs_none"] == pytest.approx(row["encode_gbps"] / none["encode_gbps"]), name
        assert row["lossless"] == (name != "int8")
        if row["lossless"]:
            assert row["bitwise_equal"] is True, name
    zstd, int8 = rows[2], rows[3]
    assert zstd["params"] == {"level": 1}
    assert zstd["ratio"] > 1.0 and int8["ratio"] > zstd["ratio"]
    assert 0 < int8["rel_l2_err"] < 0.02

    status, out, _ = run_cli(capsys, *argv)
    assert status == 0
    printed = re.findall(rf"^(none|lz4|zstd-shuffle level=1|int8) +({NUMBER}) +({NUMBER}) +({NUMBER}) +({NUMBER})",
                         out, re.M)
    assert [p[0] for p in printed] == ["none", "lz4", "zstd-shuffle level=1", "int8"], out
    none_ratio = float(printed[0][1])
    for (name, ratio, size_x, *_), row in zip(printed, rows):
        assert float(ratio) == pytest.approx(row["ratio"], abs=0.005), name
        # Size against none is the inverse ratio of the ratios (each printed rounded).
        assert consistent(float(size_x), none_ratio, float(ratio), decimals=(3, 2, 2)), (name, size_x, ratio)


# -- the examples -----------------------------------------------------------------


EXAMPLE_FILES = sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.toml") if p.name != "pyproject.toml")


@pytest.mark.parametrize("path", EXAMPLE_FILES)
def test_every_example_pipeline_file_validates_through_the_cli(path, site):
    """``flowkv pipeline validate`` on each example file, with what its README installs on the path:
    the sqlite tier's distribution (pip-installed by ``site``)."""
    extra = {"sqlite_tier": str(site)}.get(Path(path).parts[0])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [extra, os.environ.get("PYTHONPATH")]))}
    flowkv = Path(sys.executable).parent / "flowkv"
    for action in ("validate", "show"):
        done = subprocess.run([str(flowkv), "pipeline", action, str(EXAMPLES / path)], capture_output=True,
                              text=True, timeout=600, env=env)
        assert done.returncode == 0, (action, done.stdout + done.stderr)
    assert EXAMPLE_FILES == ["serve/cluster.toml", "sqlite_tier/cpu-sqlite.toml"]


def test_the_serve_example_cluster_pipeline_runs_on_a_redis_cluster_and_traces_over_otlp(
        tmp_path, redis_cluster, otlp_grpc_receiver):  # noqa: F811 - fixtures
    """examples/serve/cluster.toml as its README deploys it, pointed at this machine: a three-master
    Redis Cluster and an OTLP collector on loopback, the disk in tmp_path, memory small."""
    g = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
    overrides = {
        "tiers.memory.capacity": "64MiB",
        "tiers.disk.path": str(tmp_path / "disk"),
        "tiers.redis.url": redis_cluster.url,
        "tiers.redis.namespace": f"example-{tmp_path.name}",
        "tiers.redis.timeout_s": 10.0,
        "tiers.disk.timeout_s": 10.0,
        "telemetry.endpoint": otlp_grpc_receiver.endpoint,
        "telemetry.sampling": 1.0,
    }
    path = EXAMPLES / "serve" / "cluster.toml"
    writer = CacheEngine.from_pipeline(path, geometry=g, model_name="tiny", overrides=overrides)
    tokens = torch.arange(3 * 256)
    src = make_paged_kv(g, 64, seed=0)
    slots = random_slot_mapping(len(tokens), g, 64, seed=1)
    try:
        assert writer.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots,
                                       request_id="example-store")).stored_tokens == 3 * 256
        assert writer.flush(30.0)
        assert writer.stats()["tiers"]["redis"]["writes"] == 3
    finally:
        writer.close()
    # A second instance (its memory empty; admit_after = 2 kept the disk empty) hits in the cluster.
    reader = CacheEngine.from_pipeline(path, geometry=g, model_name="tiny", overrides=overrides)
    dst = make_paged_kv(g, 64, seed=2, fill=False)
    try:
        assert reader.lookup(tokens) == 3 * 256
        mask = reader.retrieve(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots,
                                          request_id="example-load")).ret_mask
        assert bool(mask.all())
        want = gather(src, g, slots, torch.empty(g.chunk_shape(len(slots)), dtype=g.dtype))
        got = gather(dst, g, slots, torch.empty(g.chunk_shape(len(slots)), dtype=g.dtype))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert reader.stats()["tiers"]["redis"]["hits"] == 3
    finally:
        reader.close()
    telemetry.flush()
    spans = otlp_grpc_receiver.wait_for_spans(2)
    roots = {s.attributes.get("flowkv.request_id") for s in spans if s.name in ("flowkv.store", "flowkv.retrieve")}
    assert {"example-store", "example-load"} <= roots


def test_the_console_exporter_prints_every_stage_span(tmp_path):
    """``[telemetry] exporter = "console"``: one JSON span per stage per run on stdout."""
    script = textwrap.dedent("""
        import torch
        from flowkv import CacheEngine, KVTransfer, telemetry
        from flowkv.kernels import KVGeometry
        from flowkv.testing import make_paged_kv, random_slot_mapping
        g = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
        engine = CacheEngine.from_pipeline("local-cpu", geometry=g, model_name="tiny", overrides={
            "chunk_size": 32, "tiers.memory.capacity": "4MiB", "telemetry.exporter": "console"})
        slots = random_slot_mapping(64, g, 16, seed=2)
        engine.store(KVTransfer(tokens=torch.arange(64), kv_caches=make_paged_kv(g, 16, seed=0), slot_mapping=slots,
                                request_id="r1"))
        telemetry.flush()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    decoder, text, spans = json.JSONDecoder(), done.stdout, []
    index = text.find("{")
    while index != -1:
        span, end = decoder.raw_decode(text, index)
        spans.append(span)
        index = text.find("{", end)
    names = [span["name"] for span in spans]
    assert sorted(names) == sorted(["flowkv.store", "tokenize", "chunk-hash", "allocate", "gather", "compress", "put"])
    gather_span = spans[names.index("gather")]
    assert gather_span["attributes"]["flowkv.request_id"] == "r1"
    assert gather_span["attributes"]["flowkv.bytes"] == 64 * 2 * 2 * 2 * 16 * 2


# -- every flowkv line of the README, as typed ------------------------------------------------


def test_every_flowkv_command_in_the_readme_is_one_the_cli_takes():
    """Each ``flowkv ...`` line of the README's bash blocks, split as a shell splits it, parses with the
    CLI's own parser (running them all would take hours: the long ones run at small sizes elsewhere).
    A renamed or dropped option, or a subcommand that went, fails here."""
    from vllm_server import README, shell_commands

    from flowkv.cli import build_parser

    commands = [(line, argv) for line, argv in shell_commands(README.read_text(encoding="utf-8"))
                if argv[0] == "flowkv"]
    assert len(commands) >= 30
    for line, argv in commands:
        argv = [arg for arg in argv[1:] if not (arg.startswith("[") and arg.endswith("]"))]  # "[--json]": optional
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"README.md:{line}: `flowkv {' '.join(argv)}` is refused by the CLI (exit {exc.code})")
