"""flowkv in a real vLLM against a vLLM WITHOUT a connector: greedy tokens equal, over a matrix of shapes.

Factors (issue 17): dtype (bf16, fp16, fp32); KV heads (MHA, GQA, one KV head);
head size (64, 96, 128); vLLM block size (32, 64, 128, 256); chunk size
against the block (divides it, equals it, exceeds it by a multiple or not);
pipeline (local-cpu, local-cpu-lz4, cpu-disk, cpu-disk-zstd, cpu-redis on a real
redis-server over TLS); layerwise on and off.

Every vLLM start costs 10-30 s on two cores, so the matrix is a covering
subset (``ROWS``, printed at the end of the module): each level of every
factor runs, and every pair of a connector-side level (chunk relation,
pipeline, layerwise) with an engine-side level (dtype, KV heads, head
size, block) that the rows below combine. An unconnected vLLM runs once per
(model, dtype, block size) and generates every prompt any test of the
module sends to that configuration (``BASELINE``), so a baseline engine is
shared by the rows and fault tests that use it.

Each row: a cold prompt, the same prompt again (a hit), a prompt sharing
part of it, and a batch of a new prompt beside the first. Every generated
token is compared with the unconnected vLLM's, and every hit is exact (whole
chunks, cut to whole vLLM blocks, never the last token).

The fault tests use two rows' engines: redis-server killed, restarted and
paused (SIGKILL, SIGSTOP) under ``cpu-redis``; the disk folder removed
under ``cpu-disk``. Outputs stay identical, no request fails, and after
recovery chunks are written to the tier and served from it again.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from flowkv._testing.tiny_model import tiny_model  # noqa: E402
from flowkv.integration.vllm.settings import whole_block_chunk_size  # noqa: E402
from redis_servers import RedisServer, TlsFiles  # noqa: E402
from vllm_helpers import LOOKUP_TIMEOUT_MS, engine_processes, random_tokens, shutdown_llm  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
MAX_MODEL_LEN = 4096
KV_POOL_TOKENS = 16384
# Readiness bounds (written-behind chunks landing in a tier, a tier found healthy again).
SETTLE_S = 60.0


@dataclass(frozen=True)
class Shape:
    """A tiny Llama's attention: query heads, KV heads, head size (2 layers, hidden 256)."""

    kv: str  # "MHA" | "GQA" | "MQA" (one KV head)
    head_size: int

    @property
    def kv_heads(self) -> int:
        return {"MHA": 4, "GQA": 2, "MQA": 1}[self.kv]

    def model(self, dtype: str) -> Path:
        root = Path(os.environ.get("FLOWKV_TEST_CACHE", Path.home() / ".cache" / "flowkv" / "test-models"))
        return tiny_model(root / f"tiny-llama-{self.kv.lower()}-d{self.head_size}-{dtype}", num_heads=4,
                          num_kv_heads=self.kv_heads, head_dim=self.head_size, hidden_size=256, dtype=dtype)

    def bytes_per_token(self, dtype: str) -> int:
        return 2 * 2 * self.kv_heads * self.head_size * {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


@dataclass(frozen=True)
class Row:
    shape: Shape
    dtype: str
    block: int
    chunk: int
    pipeline: str
    layerwise: bool

    @property
    def relation(self) -> str:
        if self.chunk < self.block:
            return "divides"
        if self.chunk == self.block:
            return "equals"
        return "exceeds x%g" % (self.chunk / self.block)

    @property
    def baseline(self) -> tuple[Shape, str, int]:
        return self.shape, self.dtype, self.block

    @property
    def stored_chunk(self) -> int:
        """The chunk flowkv stores: on vLLM's CPU backend, whole blocks (the connector raises the rest)."""
        return whole_block_chunk_size(self.chunk, self.block, packed_blocks=True)

    @property
    def unit(self) -> int:
        """Prompt lengths are counted in units of the larger of chunk and block."""
        return max(self.chunk, self.block)

    def __str__(self) -> str:
        return (f"{self.shape.kv}-d{self.shape.head_size}-{self.dtype}-block{self.block}-chunk{self.chunk}"
                f"-{self.pipeline}{'-layerwise' if self.layerwise else ''}")


BF16, FP16, FP32 = "bfloat16", "float16", "float32"

ROWS = [
    Row(Shape("MHA", 64), BF16, 32, 16, "local-cpu", False),
    Row(Shape("GQA", 96), FP16, 64, 64, "local-cpu-lz4", True),
    Row(Shape("MQA", 128), FP32, 128, 256, "cpu-disk-zstd", False),
    Row(Shape("MHA", 96), FP32, 256, 128, "local-cpu", True),
    Row(Shape("GQA", 128), BF16, 128, 192, "cpu-disk-zstd", True),
    Row(Shape("MQA", 64), FP16, 32, 64, "local-cpu-lz4", False),
    Row(Shape("MHA", 128), FP16, 256, 256, "cpu-redis", True),
    Row(Shape("MQA", 96), BF16, 64, 32, "cpu-disk", False),
]
REDIS_ROW = next(row for row in ROWS if row.pipeline == "cpu-redis")
DISK_ROW = next(row for row in ROWS if row.pipeline == "cpu-disk")
# The fault tests' memory tier: room for the row's own prompts, so its hits are exact; the
# fault prompts then push older chunks out, so that some hits can only come from the slower tier.
FAULT_MEMORY_CHUNKS = 8


def loadable(row: Row, prompt_len: int, stored_tokens: int) -> int:
    """Tokens flowkv serves of a prompt whose first ``stored_tokens`` were stored: whole chunks,
    cut to whole vLLM blocks, never the prompt's last token."""
    whole = stored_tokens // row.stored_chunk * row.stored_chunk
    return min(whole, prompt_len - 1) // row.block * row.block


def row_prompts(row: Row) -> dict[str, list[int]]:
    seed = 1000 * ROWS.index(row)
    first = random_tokens(seed + 1, 3 * row.unit + 17)
    return {
        "first": first,
        "shares": first[: 2 * row.unit] + random_tokens(seed + 2, 45),
        "new": random_tokens(seed + 3, 2 * row.unit + 5),
    }


def fault_prompts(row: Row, count: int) -> list[list[int]]:
    """Prompts of 4 whole chunks (and a tail), none sharing a chunk with another."""
    seed = 1000 * ROWS.index(row) + 500
    return [random_tokens(seed + i, 4 * row.stored_chunk + 7) for i in range(count)]


FAULT_PROMPTS = 6
# Every prompt each baseline configuration must answer, gathered before any engine starts.
BASELINE_PROMPTS: dict[tuple[Shape, str, int], list[list[int]]] = {}
for _row in ROWS:
    wanted = list(row_prompts(_row).values())
    if _row in (REDIS_ROW, DISK_ROW):
        wanted += fault_prompts(_row, FAULT_PROMPTS)
    BASELINE_PROMPTS.setdefault(_row.baseline, []).extend(wanted)


# -- engines ------------------------------------------------------------------------------


def start_llm(row_or_baseline: Row | tuple[Shape, str, int], extra_config: dict[str, Any] | None = None):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    shape, dtype, block = row_or_baseline.baseline if isinstance(row_or_baseline, Row) else row_or_baseline
    transfer = None
    if extra_config is not None:
        transfer = KVTransferConfig(kv_connector="FlowKVConnector", kv_connector_module_path="flowkv.integration.vllm",
                                    kv_role="kv_both", kv_connector_extra_config=extra_config)
    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    try:
        with engine_processes(separate=False):  # in this process: a start costs ~2 s, not 20-40 s
            return LLM(model=str(shape.model(dtype)), dtype=dtype, block_size=block, max_model_len=MAX_MODEL_LEN,
                       seed=0, enable_prefix_caching=False, enforce_eager=True,
                       kv_cache_memory_bytes=KV_POOL_TOKENS * shape.bytes_per_token(dtype),
                       kv_transfer_config=transfer)
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved


stop_llm = shutdown_llm


def generate(llm, prompts: list[list[int]], *, skip_save: bool = False,
             tag: str | None = None) -> list[tuple[list[int], int]]:
    """One batch; (greedy token ids, tokens the connector loaded) per prompt. Every request must finish.
    ``tag`` keys the requests apart from every other (a cache-key tag)."""
    from vllm import SamplingParams

    params_of_request = {"flowkv.skip_save": True} if skip_save else {}
    if tag is not None:
        params_of_request["flowkv.tag.matrix"] = tag
    extra = {"kv_transfer_params": params_of_request} if params_of_request else None
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, extra_args=extra)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(outputs) == len(prompts)
    results = []
    for output in outputs:
        [completion] = output.outputs
        assert completion.finish_reason == "length", completion  # not aborted, not failed
        results.append((list(completion.token_ids), int(output.num_cached_tokens or 0)))
    return results


_baseline_tokens: dict[tuple[Shape, str, int], dict[tuple[int, ...], list[int]]] = {}
comparisons = {"tokens": 0, "requests": 0}
ran_rows: list[str] = []


def run_baseline(config: tuple[Shape, str, int]) -> None:
    """The unconnected vLLM of ``config`` generates every prompt of ``BASELINE_PROMPTS`` (one engine per
    configuration, started once). Engines run in this process, one at a time: vLLM keeps a worker's
    connector in a process-wide slot, so an unconnected engine beside a connected one would find it."""
    if config not in _baseline_tokens:
        llm = start_llm(config)
        try:
            prompts = BASELINE_PROMPTS[config]
            _baseline_tokens[config] = {tuple(p): tokens for p, (tokens, cached) in zip(prompts, generate(llm, prompts))}
            assert all(cached == 0 for _, cached in generate(llm, prompts[:1]))  # no connector: nothing loaded
        finally:
            stop_llm(llm)


def baseline(row: Row, prompt: list[int]) -> list[int]:
    """The unconnected vLLM's greedy tokens for ``prompt`` (run before the row's engine started)."""
    return _baseline_tokens[row.baseline][tuple(prompt)]


def assert_same_tokens(row: Row, prompts: list[list[int]], results: list[tuple[list[int], int]]) -> None:
    for prompt, (tokens, _) in zip(prompts, results):
        want = baseline(row, prompt)
        assert tokens == want, f"{row}: prompt of {len(prompt)} tokens generated {tokens}, unconnected vLLM {want}"
        comparisons["tokens"] += len(want)
        comparisons["requests"] += 1


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    # TLS (rediss://, a CA of its own), as a Redis across machines is reached: the soak runs plain Redis.
    folder = tmp_path_factory.mktemp("matrix-redis")
    server = RedisServer(folder, tls=TlsFiles.create(folder / "pki")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tier_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("matrix-tiers")


def connector_config(row: Row, redis: RedisServer, folder: Path) -> dict[str, Any]:
    config: dict[str, Any] = {
        "pipeline": row.pipeline, "chunk_size": row.chunk, "layerwise.enabled": row.layerwise,
        "lookup_timeout_ms": LOOKUP_TIMEOUT_MS, "ipc_dir": str(folder / "ipc"),
        "tiers.memory.capacity": "256MiB",
    }
    if "disk" in row.pipeline:
        config["tiers.disk.path"] = str(folder / f"disk-{ROWS.index(row)}")
        config["tiers.disk.timeout_s"] = 10.0
    if "redis" in row.pipeline:
        config |= {"tiers.redis.url": redis.url, "tiers.redis.namespace": f"matrix-{ROWS.index(row)}",
                   "tiers.redis.tls_ca_file": str(redis.tls.ca_cert),
                   # A hung server costs one cut-off call per probe: short, and probed again soon.
                   "tiers.redis.timeout_s": 2.0, "tiers.redis.backoff_max_s": 1.0}
    if row in (REDIS_ROW, DISK_ROW):
        chunk_bytes = -(-row.shape.bytes_per_token(row.dtype) * row.stored_chunk // 4096) * 4096
        config["tiers.memory.capacity"] = FAULT_MEMORY_CHUNKS * chunk_bytes
    if row == DISK_ROW:
        # Disk hits loaded while vLLM waits in the step (the other rows take the default, "auto":
        # a hit below memory loads asynchronously).
        config["async_loads"] = "off"
    return config


class Engines:
    """The connected engine of one row at a time: a fault test reuses the row's engine run just before it."""

    def __init__(self, redis: RedisServer, folder: Path) -> None:
        self.redis, self.folder = redis, folder
        self.row: Row | None = None
        self.llm = None

    def of(self, row: Row):
        if self.row != row:
            self.close()
            run_baseline(row.baseline)
            (self.folder / "ipc").mkdir(mode=0o700, exist_ok=True)  # flowkv refuses a folder others may write
            self.llm = start_llm(row, connector_config(row, self.redis, self.folder))
            self.row = row
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            stop_llm(self.llm)
            self.llm, self.row = None, None


@pytest.fixture(scope="module")
def engines(redis, tier_folder):
    holder = Engines(redis, tier_folder)
    yield holder
    holder.close()
    print(f"\nvLLM matrix: {len(ran_rows)} rows against an unconnected vLLM, "
          f"{comparisons['requests']} requests, {comparisons['tokens']} greedy tokens compared")
    for name in ran_rows:
        print(f"  {name}")


def worker(llm) -> dict[str, Any]:
    from flowkv.integration.vllm import worker_stats

    return worker_stats(llm.llm_engine.vllm_config)


def settle(condition, what: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.1)


# -- the matrix ---------------------------------------------------------------------------


def check_row(row: Row, engines: Engines) -> None:
    llm = engines.of(row)
    prompts = row_prompts(row)
    first, shares, new = prompts["first"], prompts["shares"], prompts["new"]

    [cold] = generate(llm, [first])
    [warm] = generate(llm, [first])
    [partial] = generate(llm, [shares])
    beside = generate(llm, [new, first])
    assert_same_tokens(row, [first, first, shares, new, first], [cold, warm, partial, *beside])

    assert cold[1] == 0 and beside[0][1] == 0
    assert warm[1] == loadable(row, len(first), len(first)) > 0
    assert beside[1][1] == warm[1]
    assert partial[1] == loadable(row, len(shares), 2 * row.unit) > 0
    stats = worker(llm)
    assert stats["tiers"]["memory"]["pinned_objects"] == 0
    assert stats.get("retrieve_short", 0) == 0
    ran_rows.append(f"{row} (chunk {row.relation} the block)")


# The rows whose engines the fault tests reuse run last, each just before its fault test.
@pytest.mark.parametrize("row", [row for row in ROWS if row not in (REDIS_ROW, DISK_ROW)] + [REDIS_ROW], ids=str)
def test_greedy_tokens_equal_an_unconnected_vllm(row: Row, engines):
    check_row(row, engines)


# -- real faults under vLLM --------------------------------------------------------------


def test_redis_killed_restarted_and_paused_under_cpu_redis(engines, redis):
    """The cpu-redis row's engine: outputs equal the unconnected vLLM's through every fault, no
    request fails, and once Redis answers again it takes writes and serves hits again."""
    row = REDIS_ROW
    llm = engines.of(row)
    prompts = fault_prompts(row, FAULT_PROMPTS)
    chunks = len(prompts[0]) // row.stored_chunk

    def redis_stats() -> dict[str, Any]:
        return worker(llm)["tiers"]["redis"]

    def run(batch: list[list[int]]) -> list[tuple[list[int], int]]:
        results = generate(llm, batch)
        assert_same_tokens(row, batch, results)
        return results

    # Healthy: the first prompt reaches Redis.
    writes = redis_stats().get("writes", 0)
    run([prompts[0]])
    settle(lambda: redis_stats().get("writes", 0) >= writes + chunks, "the first prompt written to Redis")

    redis.kill()
    killed = run([prompts[1], prompts[0]])
    assert killed[1][1] == loadable(row, len(prompts[0]), len(prompts[0]))  # memory still serves it
    assert redis_stats()["healthy"] == 0

    redis.start()  # same port, empty
    # A request that stores nothing, sent until the guard's probe finds the server back: its
    # lookup always reaches Redis. (A readiness loop: the back-off is at most 1 s.)
    probe = prompts[5][: 2 * row.stored_chunk]

    def probed_healthy() -> bool:
        generate(llm, [probe], skip_save=True)
        return redis_stats()["healthy"] == 1

    settle(probed_healthy, "Redis found healthy again")
    # New chunks are written again ...
    writes = redis_stats()["writes"]
    run([prompts[2]])
    settle(lambda: redis_stats()["writes"] >= writes + chunks, "writes to the restarted Redis")
    # ... and served from it: two more prompts push prompts[2] out of memory; Redis holds it.
    run([prompts[3]])
    run([prompts[4]])
    hits = redis_stats().get("hits", 0)
    [(_, cached)] = run([prompts[2]])
    assert cached == loadable(row, len(prompts[2]), len(prompts[2])) > 0
    assert redis_stats()["hits"] >= hits + 1

    redis.pause()
    try:
        paused = run([prompts[5], prompts[3]])
    finally:
        redis.resume()
    assert paused[0][1] == 0
    stats = worker(llm)
    assert stats["tiers"]["redis"]["timeouts"] >= 1
    assert stats["tiers"]["memory"]["pinned_objects"] == 0
    ran_rows.append(f"{row}: redis-server killed, restarted, paused")


@pytest.mark.parametrize("row", [DISK_ROW], ids=str)
def test_greedy_tokens_equal_an_unconnected_vllm_cpu_disk(row: Row, engines):
    check_row(row, engines)


def test_disk_folder_removed_under_cpu_disk(engines, tier_folder):
    """The cpu-disk row's engine: its whole disk folder removed while it serves. Chunks the disk
    index still promises are found missing when read and are computed by vLLM (same tokens, no
    request fails); new chunks are written to a recreated folder and served from disk again."""
    lost: dict[str, int] = {}
    row = DISK_ROW
    llm = engines.of(row)
    prompts = fault_prompts(row, FAULT_PROMPTS)
    folder = tier_folder / f"disk-{ROWS.index(row)}"

    def disk_stats() -> dict[str, Any]:
        return worker(llm)["tiers"]["disk"]

    def run(batch: list[list[int]]) -> list[tuple[list[int], int]]:
        results = generate(llm, batch)
        assert_same_tokens(row, batch, results)
        return results

    chunks = len(prompts[0]) // row.stored_chunk
    writes = disk_stats().get("writes", 0)
    for prompt in prompts[:3]:  # 12 chunks through 8 of memory: prompts[0] lives on disk only
        run([prompt])
    settle(lambda: disk_stats().get("writes", 0) >= writes + 3 * chunks, "the prompts written to disk")
    shutil.rmtree(folder)

    # The index still lists prompts[0]'s chunks: reading them finds the files gone (misses; the
    # index forgets them), whatever was not loaded vLLM computes, and the tokens are the same.
    before = disk_stats()
    short_before = worker(llm).get("retrieve_short", 0)
    [(_, lost_cached)] = run([prompts[0]])
    after = disk_stats()
    assert after["misses"] >= before["misses"] + 1 and after["hits"] == before["hits"]
    lost.update(cached=lost_cached, misses=after["misses"] - before["misses"],
                short=worker(llm).get("retrieve_short", 0) - short_before)
    # Writes go on into a recreated folder, and the disk serves hits again.
    writes = disk_stats()["writes"]
    run([prompts[3]])
    run([prompts[4]])
    settle(lambda: disk_stats().get("writes", 0) >= writes + 2 * chunks, "writes to the recreated folder")
    run([prompts[5]])  # pushes prompts[3] out of memory
    hits = disk_stats().get("hits", 0)
    [(_, cached)] = run([prompts[3]])
    assert cached == loadable(row, len(prompts[3]), len(prompts[3])) > 0
    assert disk_stats()["hits"] >= hits + 1
    assert folder.is_dir()
    assert worker(llm)["tiers"]["memory"]["pinned_objects"] == 0
    ran_rows.append(f"{row}: disk folder removed (the lost prompt: {lost['misses']} disk misses, "
                    f"{lost['cached']} tokens loaded, {lost['short']} short retrieves)")
