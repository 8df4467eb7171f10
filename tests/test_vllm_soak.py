"""Soak: `vllm serve` with ``cpu-redis`` under concurrent streaming clients while redis-server is
paused (SIGSTOP), killed (SIGKILL) and restarted (issue 15).

Real HTTP on loopback, a real redis-server, the ops track's serve fixture
(``tests/vllm_server.py``). Bounded in count: ``CLIENTS`` threads send
``REQUESTS_PER_CLIENT`` streamed completions each; the faults are driven by how
many requests have finished, not by the clock. Every wait is a readiness bound.

What must hold: no request fails (each stream ends with ``[DONE]`` and
``finish_reason == "length"``); every answer equals the reference answer to its
prompt, computed before the load one request at a time with flowkv serving and
storing nothing (greedy: a hit, a miss or a cut-off lookup must not change the
tokens). The model runs in float32: a bf16 model's greedy answer can change with
the batch a request lands in, with no cache at all, so under concurrency only
fp32 answers are comparable with a sequential reference. No pin
is left in the memory tier once the load is over; and after recovery the
restarted Redis takes writes and serves flowkv hits again (a document pushed out
of memory comes back from Redis).
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from typing import Any

import pytest

from redis_servers import RedisServer
from vllm_helpers import DTYPE, KV_BYTES_PER_TOKEN
from vllm_server import REFERENCE_ASK, start_server

pytestmark = pytest.mark.vllm

# Chunks of one vLLM block, with vLLM hashing blocks with sha256_cbor: the chunk hashes are vLLM's
# own block hashes (flowkv/integration/vllm/chunk_hashes.py), the README's set-up for that.
CHUNK = 128
DOC = 3 * CHUNK  # each document: 3 whole chunks
KV_BYTES_PER_CHUNK = CHUNK * KV_BYTES_PER_TOKEN
MEMORY_CHUNKS = 16  # fewer than the documents the soak cycles through: some hits must come from Redis
DOCUMENTS = 8
CLIENTS = 4
REQUESTS_PER_CLIENT = 10
MAX_TOKENS = 16
# Readiness bounds (a fault's effect showing, the load finishing): never speed claims.
SETTLE_S = 300.0


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


DOCS = [tokens(DOC, seed=100 + d) for d in range(DOCUMENTS)]


def prompt(doc: int, question: int) -> list[int]:
    return DOCS[doc] + tokens(40, seed=1000 * doc + question % 3)


class Soak:
    """The clients' shared record: answers per prompt, failures, hit tokens, requests finished."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answers: dict[tuple[int, ...], list[list[int]]] = defaultdict(list)
        self.failures: list[str] = []
        self.finished = 0
        self.cached_tokens = 0

    def record(self, sent: list[int], reply: dict[str, Any] | None, error: str | None) -> None:
        with self.lock:
            self.finished += 1
            if error is not None:
                self.failures.append(error)
                return
            assert reply is not None
            self.answers[tuple(sent)].append(reply["token_ids"])
            details = (reply["usage"] or {}).get("prompt_tokens_details") or {}
            self.cached_tokens += details.get("cached_tokens") or 0

    def wait_for(self, finished: int) -> None:
        deadline = time.monotonic() + SETTLE_S
        while self.finished < finished:
            assert time.monotonic() < deadline, f"only {self.finished} of {finished} requests finished"
            time.sleep(0.05)


def client_prompts(index: int) -> list[list[int]]:
    return [prompt((index * 3 + n) % DOCUMENTS, n) for n in range(REQUESTS_PER_CLIENT)]


def client(server, soak: Soak, index: int) -> None:
    for n, sent in enumerate(client_prompts(index)):
        try:
            reply = server.complete(sent, max_tokens=MAX_TOKENS, stream=True, ignore_eos=True)
            if not reply["done"] or len(reply["token_ids"]) != MAX_TOKENS:
                soak.record(sent, None, f"client {index} request {n}: incomplete stream {reply}")
                continue
            soak.record(sent, reply, None)
        except Exception as exc:  # an HTTP error, a broken stream: a failed request
            soak.record(sent, None, f"client {index} request {n}: {exc!r}")


def test_serve_cpu_redis_under_streaming_load_through_redis_pause_kill_and_restart(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    server = None
    try:
        server = start_server(tmp_path / "serve", kv_extra={
            "pipeline": "cpu-redis", "chunk_size": CHUNK, "tiers.redis.url": redis.url,
            "tiers.redis.namespace": "soak", "tiers.memory.capacity": MEMORY_CHUNKS * KV_BYTES_PER_CHUNK,
            # A hung server costs one cut-off call per probe: short, and probed again soon.
            "tiers.redis.timeout_s": 2.0, "tiers.redis.backoff_max_s": 1.0,
        }, dtype=DTYPE, args=["--prefix-caching-hash-algo", "sha256_cbor"])

        # -- the reference: every prompt of the load, one at a time, computed by the model alone --
        # (a tag of its own keys them apart from the load's chunks, so nothing is found; nothing is stored)
        unique = {tuple(p) for i in range(CLIENTS) for p in client_prompts(i)}
        reference = {p: server.complete(list(p), max_tokens=MAX_TOKENS, stream=True, ignore_eos=True,
                                        kv_transfer_params=REFERENCE_ASK) for p in sorted(unique)}
        assert all((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
                   for r in reference.values())

        def settle(condition, what: str) -> None:
            deadline = time.monotonic() + SETTLE_S
            while not condition():
                assert time.monotonic() < deadline, f"{what} did not happen"
                time.sleep(0.1)

        # -- the load, with the faults at fixed points of it ---------------------------------
        soak = Soak()
        threads = [threading.Thread(target=client, args=(server, soak, i), daemon=True) for i in range(CLIENTS)]
        total = CLIENTS * REQUESTS_PER_CLIENT
        for thread in threads:
            thread.start()
        soak.wait_for(total // 5)
        redis.pause()  # SIGSTOP: a hung server, connections open
        try:
            soak.wait_for(2 * total // 5)
            timeouts_while_paused = server.worker_stats()["tiers"]["redis"]["timeouts"]
        finally:
            redis.resume()
        soak.wait_for(total // 2)
        redis.kill()  # SIGKILL: gone mid-load
        soak.wait_for(3 * total // 4)
        redis.start()  # the same port, empty
        for thread in threads:
            thread.join(SETTLE_S)
        assert not any(thread.is_alive() for thread in threads)

        assert soak.failures == [], soak.failures
        assert soak.finished == total
        # vLLM hashes each request's blocks when a connector is configured (its prefix caching off
        # here), and flowkv took those hashes as its chunk hashes: nothing was hashed twice.
        assert "use vLLM's block hashes as chunk hashes" in server.log()
        assert soak.answers.keys() == reference.keys()
        changed = {len(p): sum(x != reference[p]["token_ids"] for x in a) for p, a in soak.answers.items()
                   if any(x != reference[p]["token_ids"] for x in a)}
        assert changed == {}, f"answers that differ from the reference (prompt length: how many): {changed}"
        after_load = server.worker_stats()
        pins_after_load = after_load["tiers"]["memory"]["pinned_objects"]
        assert pins_after_load == 0
        assert timeouts_while_paused >= 1
        assert soak.cached_tokens > 0

        # -- recovery: Redis found healthy again, written to, and serving hits ------------------
        # A new prompt each time (memory cannot answer it, so its lookup reaches Redis), sent until
        # the guard's probe finds the server back (a readiness loop: the back-off is at most 1 s).
        probes = iter(range(10_000, 20_000))

        def probed_healthy() -> bool:
            server.complete(tokens(2 * CHUNK, seed=next(probes)), max_tokens=1)
            return server.worker_stats()["tiers"]["redis"]["healthy"] == 1

        settle(probed_healthy, "Redis found healthy again")
        fresh = [tokens(DOC, seed=500 + i) + tokens(40, seed=600 + i) for i in range(7)]
        writes = server.worker_stats()["tiers"]["redis"]["writes"]
        first = server.complete(fresh[0], max_tokens=MAX_TOKENS, stream=True, ignore_eos=True)
        settle(lambda: server.worker_stats()["tiers"]["redis"]["writes"] >= writes + 3,
               "the first new document written to Redis")
        for later in fresh[1:]:  # 18 more chunks through a memory tier of 16: fresh[0] is in Redis only
            server.complete(later, max_tokens=MAX_TOKENS, stream=True, ignore_eos=True)
        redis_hits = server.worker_stats()["tiers"]["redis"]["hits"]
        again = server.complete(fresh[0], max_tokens=MAX_TOKENS, stream=True, ignore_eos=True)
        assert again["done"] and again["token_ids"] == first["token_ids"]
        assert (again["usage"]["prompt_tokens_details"] or {}).get("cached_tokens") == DOC
        assert server.worker_stats()["tiers"]["redis"]["hits"] >= redis_hits + 3
        final = server.worker_stats()
        assert final["tiers"]["memory"]["pinned_objects"] == 0
        print(f"\nsoak: {total} streamed requests from {CLIENTS} clients, {len(soak.failures)} failed, "
              f"{soak.cached_tokens} prompt tokens served by flowkv during the load, "
              f"{timeouts_while_paused} Redis timeouts while paused, pins left after the load {pins_after_load}, "
              f"after recovery: {DOC} tokens of a document served again with "
              f"{final['tiers']['redis']['hits'] - redis_hits} Redis hits")
    finally:
        if server is not None:
            server.close()
        redis.stop()
