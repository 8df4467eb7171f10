"""Loads vLLM waits for between steps: the scheduler answered ``(n, True)``.

What vLLM 0.32 does with such a load (``tests/test_vllm_async_loads.py``
checks each fact against a recording connector):

- the scheduler allocates the request's blocks, calls
  ``update_state_after_alloc`` with them, parks the request in
  ``WAITING_FOR_REMOTE_KVS`` and schedules other requests meanwhile;
- the step's metadata reaches the worker, whose ``start_load_kv`` runs after
  the forward pass when the step has no synchronous load;
- once the worker names the request in ``get_finished``'s receiving set,
  the scheduler schedules it from the loaded tokens on;
- blocks that did not load go in ``get_block_ids_with_load_errors`` no later
  than that step; a receive reported failed (``failed_recving``, with
  ``kv_load_failure_policy = "recompute"``) makes vLLM drop the load, free the
  blocks and ask the connector again, from token 0.

flowkv's side: the lookup that answered already started promoting the hit's
chunks that lie below memory into memory (the lookup stage's ``prefetch``),
on the tier I/O thread. Every step ``finish`` copies the loads whose
prefetch landed into vLLM's pages, as a synchronous load does from memory,
and reports them. A load that cannot be whole (a chunk the tiers no longer
hold: a corrupt file is dropped when the prefetch reads it) is not copied at
all, and one that comes back short is reported failed too: vLLM then looks
the request up again, and what it counts as cached
(``prompt_tokens_details.cached_tokens``) is what the second answer holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowkv.integration.vllm.metadata import LoadSpec

if TYPE_CHECKING:
    from flowkv.calls import KVTransfer

logger = logging.getLogger("flowkv.integration")

__all__ = ["AsyncLoads", "Finished"]

# How often `AsyncLoads.wait_for_landing` looks whether a prefetch landed.
_LANDING_POLL_S = 0.001


@dataclass
class Finished:
    """What ``AsyncLoads.finish`` has to report to vLLM this step."""

    recving: set[str]
    # Requests among ``recving`` whose load came back short.
    failed: set[str]
    # Their blocks past the loaded prefix.
    error_blocks: set[int]


@dataclass
class _Pending:
    load: LoadSpec
    since: float  # time.monotonic() when start_load_kv took it


class AsyncLoads:
    """The worker's loads in flight, and the engine calls that check, copy in or drop one.

    ``transfer(load)`` is the load's engine call, ``reached(load, to)`` where a
    retrieve that got ``to`` tokens into the load's tokens leaves it, and
    ``load_failed(load)`` drops the pins of a retrieve that raised.
    """

    def __init__(self, *, engine_lock: threading.Lock, block_size: int, transfer: Callable[[LoadSpec], KVTransfer],
                 reached: Callable[[LoadSpec, int], int], load_failed: Callable[[LoadSpec], None],
                 wait_limit_s: float) -> None:
        self._lock = engine_lock
        self._block_size = block_size
        self._transfer = transfer
        self._reached = reached
        self._load_failed = load_failed
        # A prefetch that takes longer than this is not waited for: the load reads what it can.
        self._wait_limit_s = wait_limit_s
        self._pending: dict[str, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, load: LoadSpec) -> None:
        self._pending[load.req_id] = _Pending(load, time.monotonic())

    def wait_for_landing(self, engine: Any, limit_s: float) -> bool:
        """Sleep (the GIL released) until one of the loads can be finished or ``limit_s`` passes;
        whether one can. For steps that schedule nothing: vLLM runs them back to back while its
        requests wait, and a worker that answers at once spins the machine the I/O needs."""
        if not self._pending:
            return False
        deadline = time.monotonic() + limit_s
        while True:
            now = time.monotonic()
            if any(self._due(engine, pending, now) for pending in self._pending.values()):
                return True
            if now >= deadline:
                return False
            time.sleep(min(_LANDING_POLL_S, deadline - now))

    def _due(self, engine: Any, pending: _Pending, now: float) -> bool:
        """Whether ``finish`` settles this load now: its prefetch landed, or was waited for long enough."""
        load = pending.load
        return (load.lookup_id is None or not engine.prefetch_pending(load.lookup_id)
                or now - pending.since >= self._wait_limit_s)

    def finish(self, engine: Any, finished_req_ids: set[str]) -> Finished:
        """Copy in the loads whose chunks landed; drop those of requests vLLM finished (aborted)."""
        done = Finished(set(), set(), set())
        now = time.monotonic()
        for req_id, pending in list(self._pending.items()):
            load = pending.load
            if req_id in finished_req_ids:
                loaded_to = load.end
                self._release(engine, load)
            elif not self._due(engine, pending, now):
                continue
            elif self._held_to(engine, load) < load.end:
                # A chunk went (a corrupt file is dropped when the prefetch reads it): vLLM will
                # ask again, so copying the chunks before it would be wasted, and counted twice.
                loaded_to = load.start
                self._release(engine, load)
                engine.count("retrieve_short")
            else:
                loaded_to = self._run(engine, load)
            if loaded_to < load.end:
                done.failed.add(req_id)
                first_bad_block = loaded_to // self._block_size
                last_block = (load.end - 1) // self._block_size
                done.error_blocks.update(load.block_ids[first_bad_block:last_block + 1])
                logger.info("flowkv: request %s loaded %d of %d tokens; vLLM looks it up again",
                            req_id, loaded_to - load.start, load.end - load.start)
            del self._pending[req_id]
            done.recving.add(req_id)
        return done

    def _held_to(self, engine: Any, load: LoadSpec) -> int:
        """Where the load can get to with the chunks the tiers hold now (its end, when they all are)."""
        if load.chunk_hashes is None:
            return load.end  # chunks keyed by content: only the retrieve can tell
        with self._lock:
            held = engine.held_tokens(load.chunk_hashes, len(load.token_ids), tags=load.tags or None)
        return min(load.token_start + held, load.end)

    def _run(self, engine: Any, load: LoadSpec) -> int:
        try:
            transfer = self._transfer(load)
            with self._lock:
                result = engine.retrieve(transfer)
                engine.count("async_loads")
            return self._reached(load, result.loaded_to)
        except Exception:
            self._load_failed(load)
            return load.start

    def _release(self, engine: Any, load: LoadSpec) -> None:
        """A load not made (vLLM finished the request, or a chunk went): drop its lookup's pins."""
        if load.lookup_id is not None:
            with self._lock:
                engine.release(load.lookup_id)
