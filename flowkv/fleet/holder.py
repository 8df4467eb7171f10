"""A cache engine as a holder: its tiers reported to the controller, the controller's commands run on it.

``EngineHolder`` is what a process with a ``CacheEngine`` (a vLLM worker, an
in-process pipeline, a node server's storage) needs to join the fleet::

    holder = EngineHolder(engine, engine_lock, ReporterConfig(url="http://127.0.0.1:9100"),
                          instance_id="node-a", model="my-model")
    engine.storage.subscribe(holder.on_tier_event)   # or fan the events out yourself
    holder.start()
    ...
    holder.close()

It registers the engine's pipeline (tiers in order, chunk size, hash
function), reports every tier event through a :class:`Reporter`, heartbeats
with the engine's counters and tier fill, and runs ``clear`` (memory-tier
chunks, each removal an event), ``pin`` and ``prefetch`` (lookup runs of the engine: the contiguous
prefix the tiers hold, kept or promoted into memory for ``ttl_s``).
"""

from __future__ import annotations

import threading
from typing import Any

from flowkv.fleet.node import shared_server_ids
from flowkv.fleet.protocol import Command, CommandResult, Registration, TierInfo
from flowkv.fleet.reporter import Reporter, ReporterConfig, new_session
from flowkv.keys import CacheKey, tags_digest
from flowkv.tenants import tier_reports

__all__ = ["EngineHolder"]


class EngineHolder:
    """See the module's docstring; ``lock`` is the lock the engine's other users hold around it."""

    def __init__(self, engine: Any, lock: threading.Lock, config: ReporterConfig, *, instance_id: str,
                 model: str, rank: int = 0, world_size: int = 1, kind: str = "engine", url: str | None = None,
                 key_model: str | None = None, tokenizer: str | None = None, shared: list[str] | None = None) -> None:
        self._engine = engine
        self._lock = lock
        self._storage = engine.storage
        pipeline = engine.pipeline
        registration = Registration(
            instance_id=instance_id, rank=rank, world_size=world_size, session=new_session(), kind=kind, url=url,
            model=model, key_model=key_model or engine.model_name, tokenizer=tokenizer, pipeline=pipeline.name,
            tiers=[TierInfo(name=name, kind=tier.kind, capacity_bytes=_capacity(tier.config))
                   for name, tier in pipeline.tiers.items()],
            chunk_size=engine.chunk_size, hash=engine.hash_fn.name,
            shared=list(dict.fromkeys([*(shared or []), *shared_server_ids(pipeline)])))
        # A node server's tier is reported by the server's own follower (flowkv node-report), which
        # also sees what other instances put there and what the server evicts.
        self._not_reported = {name for name, tier in pipeline.tiers.items() if tier.kind == "server"}
        held = {}
        if self._storage.staging not in self._not_reported:
            with lock:
                held = {self._storage.staging: list(self._storage.memory.keys())}
        self.reporter = Reporter(config, registration, held=held, run_command=self._run_command, stats=self._stats)

    def on_tier_event(self, event: Any) -> None:
        """A storage-manager observer: never blocks."""
        if event.tier in self._not_reported:
            return
        self.reporter.offer(event.kind, event.tier, event.key)

    def start(self) -> EngineHolder:
        self.reporter.start()
        return self

    def close(self) -> None:
        self.reporter.close()

    # -- on the reporter's thread ------------------------------------------------------

    def _stats(self) -> dict[str, Any]:
        with self._lock:
            stats = self._engine.stats()
        tiers = {}
        for name, numbers in (stats.get("tiers") or {}).items():
            tiers[name] = {key: numbers[key] for key in ("used_bytes", "capacity_bytes", "entries", "evictions")
                           if isinstance(numbers.get(key), (int, float))}
        counters = {key: value for key, value in stats.items()
                    if isinstance(value, (int, float)) and not isinstance(value, bool)}
        return {"counters": counters, "tiers": tiers, "tenants": tier_reports(stats.get("tiers") or {})}

    def _run_command(self, command: Command) -> CommandResult:
        if command.op == "clear":
            return self._clear(command)
        if command.op in ("pin", "prefetch"):
            return self._pin_or_prefetch(command)
        return CommandResult(id=command.id, ok=False, detail=f"unknown command {command.op!r}")

    def _clear(self, command: Command) -> CommandResult:
        digest = tags_digest(command.tags) if command.tags else None
        storage = self._storage
        wanted = command.tiers or list(storage.order)
        removed = 0
        if storage.staging in wanted and storage.staging not in self._not_reported:
            with self._lock:
                for key in list(storage.memory.keys()):
                    if digest is not None and _tags_digest_of(key) != digest:
                        continue
                    removed += bool(storage.remove(key))  # each removal goes out as an event
        detail = f"removed {removed} chunks from {storage.staging}"
        kept = [name for name in wanted if not storage.holds_objects(name) or name in self._not_reported]
        if kept:
            detail += f"; {', '.join(kept)} keep their chunks until they evict them"
        return CommandResult(id=command.id, ok=True, detail=detail)

    def _pin_or_prefetch(self, command: Command) -> CommandResult:
        """A lookup run of the engine's own lookup list for ``owner``: ``pin`` pins the memory hits,
        ``prefetch`` promotes the hits below memory (each pinned when it lands); counted as no lookup."""
        owner = ("flowkv-controller", command.op, command.id)
        pin = command.op == "pin"
        with self._lock:
            found = self._engine.lookup_result(command.token_ids, tags=command.tags or None, lookup_id=owner,
                                               pin=pin, prefetch=not pin, count=False)
        timer = threading.Timer(command.ttl_s, self._release, args=(owner,))
        timer.daemon = True
        timer.start()
        return CommandResult(id=command.id, ok=True,
                             detail=f"{command.op} {found.hit_chunks} of {found.chunks} chunks")

    def _release(self, owner: Any) -> None:
        with self._lock:
            self._storage.release(owner)


def _capacity(config: Any) -> int | None:
    capacity = getattr(config, "capacity", None)
    return capacity if isinstance(capacity, int) else None


def _tags_digest_of(key: str) -> str | None:
    """The tags digest of a chunk key (None for a string that is no flowkv key)."""
    try:
        return CacheKey.from_str(key).prefix.tags_digest
    except ValueError:
        return None
