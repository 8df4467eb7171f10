"""``flowkv bench capacity``: the disk tier is the only hit source, a smaller codec holds
more documents in the same disk, and warm requests come back from disk through vLLM."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from flowkv.bench import BENCHMARKS
from flowkv.bench import capacity as bench
from flowkv.pipeline import load_pipeline


def test_capacity_is_a_registered_benchmark():
    assert BENCHMARKS["capacity"][0] == "flowkv.bench.capacity"


def test_benchmark_pipeline_serves_hits_only_from_disk(tmp_path):
    path = bench.capacity_pipeline(tmp_path, codec="zstd-shuffle", params={"level": 1}, disk_path=tmp_path / "d",
                                   disk_capacity=1 << 20, staging_bytes=1 << 20, chunk_size=256)
    pipeline = load_pipeline(path)
    stages = {spec.name: spec.settings() for spec in pipeline.retrieve}
    assert stages["lookup"]["prefetch"] is False and stages["get"]["promote"] is False
    compress = next(spec.settings() for spec in pipeline.store if spec.name == "compress")
    assert {k: v for k, v in compress.items() if v is not None} == {"codec": "zstd-shuffle", "level": 1}
    assert [spec.settings()["tiers"] for spec in pipeline.store if spec.name == "put"] == [["disk"]]
    assert pipeline.tiers["disk"].config.capacity == 1 << 20


def test_drop_page_cache_visits_every_file_and_nothing_else(tmp_path):
    (tmp_path / "a").mkdir()
    for name in ("a/x.kv", "a/y.kv", "z.kv"):
        (tmp_path / name).write_bytes(b"payload" * 100)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.kv"
    outside.write_bytes(b"keep")
    try:
        assert bench.drop_page_cache(tmp_path) == 3
        assert (tmp_path / "a/x.kv").read_bytes() == b"payload" * 100  # dropping cached pages loses no data
    finally:
        outside.unlink()


def test_bad_options_are_refused(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--disk-capacity", "lots"])) == 2
    assert "flowkv bench capacity:" in capsys.readouterr().err
    assert bench.run(parser.parse_args(["--codecs", "zstd:levle=1"])) == 2
    assert "did you mean 'level'" in capsys.readouterr().err


@pytest.mark.vllm
def test_int8_holds_more_documents_than_raw_in_the_same_disk(capsys, engines_in_this_process):
    """Two vLLM runs of the demo model (raw, int8) on 4 documents of 512 tokens and a 5 MiB disk:
    raw documents take 2 MiB each, so at most 2 fit; int8 ones about 1.1 MiB, so all 4 do, and
    every held document comes back whole from disk."""
    cache = Path(os.environ.get("FLOWKV_TEST_CACHE", Path.home() / ".cache" / "flowkv" / "test-models"))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--codecs", "none,int8", "--documents", "4", "--doc-tokens", "512",
                              "--disk-capacity", "5MiB", "--model-dir", str(cache / "demo-llama"), "--json"])
    assert bench.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    raw, int8 = report["codecs"]
    assert raw["codec"] == "none" and int8["codec"] == "int8"
    assert raw["raw_bytes_per_document"] == 512 * 4096  # 4 layers x 2 x 4 heads x 64 x bf16 per token
    assert raw["payload_bytes_per_document"] >= raw["raw_bytes_per_document"]
    assert int8["payload_bytes_per_document"] < 0.6 * raw["raw_bytes_per_document"]
    # LRU: the last documents stored are the ones held.
    assert raw["held"] == [2, 3] and raw["disk_evictions"] > 0
    assert int8["held"] == [0, 1, 2, 3] and int8["disk_evictions"] == 0
    assert int8["documents_vs_first"] == 2.0
    for row in (raw, int8):
        for index, served in enumerate(row["served_tokens"]):
            assert served == (512 if index in row["held"] else 0)
        assert row["warm_ttft_s"] > 0 and row["cold_ttft_s"] > 0


def test_kv_bytes_per_token_reads_the_model_config(tmp_path):
    from flowkv.integration.harness import kv_bytes_per_token

    config = {"num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_size": 1024}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert kv_bytes_per_token(tmp_path) == 4 * 2 * 4 * 64 * 2  # layers x (K, V) x KV heads x head_dim x bf16
    del config["num_key_value_heads"]  # no GQA: every attention head has its own KV
    config["head_dim"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert kv_bytes_per_token(tmp_path) == 4 * 2 * 16 * 128 * 2
