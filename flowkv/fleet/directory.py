"""Who holds which chunk: the controller's soft state, rebuilt from events and snapshots.

Nothing here is permanent. A holder (one rank of a vLLM instance, or a node
server) registers, sends a snapshot of everything it holds, then events
numbered without gaps; a gap, a restart of either side, or a holder that
lapsed and came back ends in a new snapshot, which replaces what the
directory knew of that holder.

A lookup hashes the tokens the way each instance does (its registered hash
function and chunk size) and walks that instance's chunks from chunk 0,
stopping at the first chunk that not every rank holds (in its own tiers or a
shared node server's): the same prefix-contiguous rule the instance's own
lookup follows. Every instance that holds a prefix is answered, sorted by
matched tokens, then by how many of them are in the faster tier.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowkv.fleet.protocol import (
    Ack,
    Command,
    CommandResult,
    EventBatch,
    Heartbeat,
    LookupHolder,
    LookupReply,
    Registration,
    Snapshot,
)
from flowkv.keys import CacheKey, chain_hashes, chunk_spans, tags_digest

__all__ = ["Directory", "Holder"]

# What a chunk key must match for an instance to use it: key model, world size, rank, tags digest.
_Compat = tuple[str, int, int, str]
# How many heartbeats of stats each instance keeps (for the dashboard's charts).
_STATS_HISTORY = 720
_RECENT_EVENTS = 200


@dataclass
class Holder:
    """One process that holds chunks: a rank of a vLLM instance, or a node server."""

    registration: Registration
    # monotonic time of the last message
    last_seen: float
    state: str = "up"
    # the last event sequence number applied; -1 before the first snapshot
    seq: int = -1
    # False until a snapshot arrives after registration (events alone may miss chunks)
    synced: bool = False
    # key string -> tiers holding it
    held: dict[str, set[str]] = field(default_factory=dict)
    # chunk hash -> compat -> tier -> number of keys (dtype and layout may differ between keys)
    by_hash: dict[bytes, dict[_Compat, collections.Counter]] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    commands: list[Command] = field(default_factory=list)
    registered_at: float = field(default_factory=time.time)

    @property
    def name(self) -> tuple[str, int]:
        return (self.registration.instance_id, self.registration.rank)

    def add(self, key: str, tier: str) -> bool:
        tiers = self.held.setdefault(key, set())
        if tier in tiers:
            return False
        parsed = _parse(key)
        if parsed is None:
            if not tiers:
                del self.held[key]
            return False
        tiers.add(tier)
        chunk_hash, compat = parsed
        self.by_hash.setdefault(chunk_hash, {}).setdefault(compat, collections.Counter())[tier] += 1
        return True

    def discard(self, key: str, tier: str) -> bool:
        tiers = self.held.get(key)
        if not tiers or tier not in tiers:
            return False
        tiers.discard(tier)
        if not tiers:
            del self.held[key]
        parsed = _parse(key)
        if parsed is not None:
            chunk_hash, compat = parsed
            per_compat = self.by_hash.get(chunk_hash, {})
            counts = per_compat.get(compat)
            if counts is not None:
                counts[tier] -= 1
                if counts[tier] <= 0:
                    del counts[tier]
                if not counts:
                    del per_compat[compat]
                if not per_compat:
                    self.by_hash.pop(chunk_hash, None)
        return True

    def clear(self, tier: str | None = None, digest: str | None = None) -> int:
        """Drop every key (of ``tier``, with tags ``digest``); how many (key, tier) pairs went."""
        dropped = 0
        for key, tiers in list(self.held.items()):
            if digest is not None and not key.rsplit("/", 2)[-2] == digest:
                continue
            for name in list(tiers):
                if tier is None or name == tier:
                    dropped += self.discard(key, name)
        return dropped

    def tiers_of(self, chunk_hash: bytes, compat: _Compat) -> Iterable[str]:
        counts = self.by_hash.get(chunk_hash, {}).get(compat)
        return counts.keys() if counts else ()

    def chunk_count(self, tier: str) -> int:
        return sum(1 for tiers in self.held.values() if tier in tiers)


def _parse(key: str) -> tuple[bytes, _Compat] | None:
    try:
        parsed = CacheKey.from_str(key)
    except ValueError:
        return None
    prefix = parsed.prefix
    return parsed.chunk_hash, (prefix.model, prefix.world_size, prefix.worker_rank, prefix.tags_digest)


class Directory:
    """The controller's state: holders, what each holds, their stats and pending commands.

    Every method takes the directory's lock; the HTTP handlers call them from
    worker threads.
    """

    def __init__(self, *, heartbeat_s: float = 2.0, timeout_s: float = 10.0) -> None:
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self._lock = threading.Condition()
        self._holders: dict[tuple[str, int], Holder] = {}
        self._command_ids = itertools.count(1)
        self._results: dict[int, CommandResult] = {}
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=_RECENT_EVENTS)
        self.history: dict[str, collections.deque[tuple[float, dict[str, Any]]]] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self.started_at = time.time()

    # -- from holders ---------------------------------------------------------

    def register(self, registration: Registration) -> Ack:
        with self._lock:
            name = (registration.instance_id, registration.rank)
            old = self._holders.get(name)
            holder = Holder(registration=registration, last_seen=time.monotonic())
            if old is not None and old.registration.session == registration.session:
                # The same process again (it was marked down, or lost a reply): keep the commands.
                holder.commands = old.commands
            self._holders[name] = holder
            self.counters["registrations"] += 1
            self._note(name, "register", registration.kind, "")
            return Ack(status="ok", heartbeat_s=self.heartbeat_s)

    def snapshot(self, snapshot: Snapshot) -> Ack:
        with self._lock:
            holder = self._known(snapshot.instance_id, snapshot.rank, snapshot.session)
            if holder is None:
                return Ack(status="register")
            holder.held.clear()
            holder.by_hash.clear()
            for tier, keys in snapshot.tiers.items():
                for key in keys:
                    holder.add(key, tier)
            holder.seq = snapshot.seq
            holder.synced = True
            holder.state = "up"
            holder.last_seen = time.monotonic()
            self.counters["snapshots"] += 1
            self._note(holder.name, "snapshot", "", f"{len(holder.held)} chunks")
            return Ack(status="ok")

    def events(self, batch: EventBatch) -> Ack:
        with self._lock:
            holder = self._known(batch.instance_id, batch.rank, batch.session)
            if holder is None:
                return Ack(status="register")
            holder.last_seen = time.monotonic()
            if not holder.synced or batch.seq_from > holder.seq + 1:
                self.counters["gaps"] += holder.synced
                return Ack(status="resync")
            for offset, event in enumerate(batch.events):
                seq = batch.seq_from + offset
                if seq <= holder.seq:
                    continue  # a batch sent again after a lost reply
                holder.seq = seq
                self.counters[f"events_{event.op}"] += 1
                if event.op == "admit":
                    holder.add(event.key, event.tier)
                elif event.op == "clear":
                    holder.clear(event.tier or None)
                else:
                    holder.discard(event.key, event.tier)
                self._note(holder.name, event.op, event.tier, event.key)
            return Ack(status="ok")

    def heartbeat(self, beat: Heartbeat) -> Ack:
        with self._lock:
            holder = self._known(beat.instance_id, beat.rank, beat.session)
            if holder is None:
                return Ack(status="register")
            if holder.state == "down":
                # Lapsed and back: what it holds may have changed unseen; start over.
                return Ack(status="register")
            holder.last_seen = time.monotonic()
            holder.stats = beat.stats
            history = self.history.setdefault(beat.instance_id, collections.deque(maxlen=_STATS_HISTORY))
            if beat.rank == 0:
                history.append((time.time(), beat.stats))
            for result in beat.done:
                self._results[result.id] = result
            if beat.done:
                self._lock.notify_all()
            if not holder.synced or beat.seq > holder.seq:
                return Ack(status="resync")
            commands, holder.commands = holder.commands, []
            return Ack(status="ok", commands=commands)

    def _known(self, instance_id: str, rank: int, session: str) -> Holder | None:
        holder = self._holders.get((instance_id, rank))
        if holder is None or holder.registration.session != session:
            return None
        return holder

    def _note(self, name: tuple[str, int], op: str, tier: str, key: str) -> None:
        chunk = key.rsplit("/", 1)[-1][:16] if key else ""
        self.recent.append({"time": time.time(), "instance_id": name[0], "rank": name[1], "op": op,
                            "tier": tier, "chunk": chunk})

    # -- liveness -------------------------------------------------------------

    def reap(self, now: float | None = None) -> list[tuple[str, int]]:
        """Mark holders silent for longer than the timeout down; the ones that just went down."""
        now = time.monotonic() if now is None else now
        lapsed = []
        with self._lock:
            for holder in self._holders.values():
                if holder.state == "up" and now - holder.last_seen > self.timeout_s:
                    holder.state = "down"
                    lapsed.append(holder.name)
                    self.counters["lapsed"] += 1
                    self._note(holder.name, "down", "", "")
        return lapsed

    # -- queries --------------------------------------------------------------

    def instances(self) -> list[dict[str, Any]]:
        """Each instance, its ranks together (state, model, pipeline, the chunks every rank holds its
        shard of, tiers and their fill summed over the ranks), and each rank as a holder of its own."""
        with self._lock:
            grouped: dict[str, list[Holder]] = collections.defaultdict(list)
            for holder in self._holders.values():
                grouped[holder.registration.instance_id].append(holder)
            out = []
            now = time.monotonic()
            for instance_id, holders in sorted(grouped.items()):
                holders.sort(key=lambda h: h.registration.rank)
                first = holders[0].registration
                missing = sorted(set(range(first.world_size)) - {h.registration.rank for h in holders})
                up = all(h.state == "up" for h in holders) and not missing
                tiers = []
                for tier in first.tiers:
                    fills = [h.stats.get("tiers", {}).get(tier.name, {}).get("used_bytes") for h in holders]
                    capacities = [_tier_capacity(h.registration, tier.name) for h in holders]
                    tiers.append({"name": tier.name, "kind": tier.kind,
                                  "capacity_bytes": None if None in capacities else sum(capacities),
                                  "chunks": _whole_chunks(holders, first.world_size, tier.name),
                                  "used_bytes": sum(fill for fill in fills if isinstance(fill, (int, float)))
                                  if any(isinstance(fill, (int, float)) for fill in fills) else None})
                out.append({
                    "instance_id": instance_id, "state": "up" if up else "down", "kind": first.kind,
                    "url": first.url, "model": first.model, "key_model": first.key_model or first.model,
                    "pipeline": first.pipeline, "chunk_size": first.chunk_size, "hash": first.hash,
                    "world_size": first.world_size, "ranks": [h.registration.rank for h in holders],
                    "missing_ranks": missing, "shared": first.shared, "tiers": tiers,
                    "chunks": _whole_chunks(holders, first.world_size),
                    "synced": all(h.synced for h in holders),
                    "last_seen_s": round(max(now - h.last_seen for h in holders), 3),
                    "registered_at": min(h.registered_at for h in holders),
                    "stats": holders[0].stats,
                    "holders": [{
                        "rank": h.registration.rank, "state": h.state, "synced": h.synced,
                        "session": h.registration.session, "chunks": len(h.held),
                        "tiers": {t.name: h.chunk_count(t.name) for t in h.registration.tiers},
                        "last_seen_s": round(now - h.last_seen, 3), "stats": h.stats,
                    } for h in holders],
                })
            return out

    def lookup(self, token_ids: Sequence[int], *, model: str | None = None, tags: dict[str, str] | None = None,
               include_down: bool = False) -> LookupReply:
        """Every instance holding a prefix of ``token_ids``, longest first."""
        digest = tags_digest(tags)
        with self._lock:
            self.counters["lookups"] += 1
            grouped: dict[str, dict[int, Holder]] = collections.defaultdict(dict)
            for holder in self._holders.values():
                grouped[holder.registration.instance_id][holder.registration.rank] = holder
            hashes: dict[tuple[str, int], list[bytes]] = {}
            answers = []
            for instance_id, ranks in grouped.items():
                first = ranks[min(ranks)].registration
                if first.kind == "server":
                    continue  # a node server is reached through the instances that share it
                if model is not None and model not in (first.model, first.key_model):
                    continue
                state = "up" if all(h.state == "up" for h in ranks.values()) else "down"
                if state == "down" and not include_down:
                    continue
                scheme = (first.hash, first.chunk_size)
                if scheme not in hashes:
                    hashes[scheme] = chain_hashes(list(token_ids), first.chunk_size, first.hash, partial=True)
                answer = self._match(first, ranks, grouped, hashes[scheme], digest, len(token_ids))
                if answer is not None:
                    matched_tokens, chunks_by_tier, last_tier, cost = answer
                    answers.append((cost, LookupHolder(
                        instance_id=instance_id, url=first.url, model=first.model, state=state,
                        matched_tokens=matched_tokens, matched_chunks=sum(chunks_by_tier.values()),
                        tier=last_tier, chunks_by_tier=chunks_by_tier)))
        # Longest first; among equals, the one whose chunks sit in faster tiers.
        answers.sort(key=lambda pair: (-pair[1].matched_tokens, pair[0], pair[1].instance_id))
        return LookupReply(num_tokens=len(token_ids), holders=[holder for _, holder in answers])

    def _match(self, first: Registration, ranks: dict[int, Holder], grouped: dict[str, dict[int, Holder]],
               hashes: list[bytes], digest: str, num_tokens: int) -> tuple[int, dict[str, int], str, int] | None:
        """How far the instance holds the chunks from chunk 0: (tokens, chunks per tier, the slowest
        tier, the sum of the tiers' positions); None when it does not hold chunk 0."""
        key_model = first.key_model or first.model
        if len(ranks) < first.world_size:
            return None
        # Each rank reads its own tiers first, then the node servers it shares, in order.
        sources: dict[int, list[tuple[str, Holder]]] = {}
        for rank in range(first.world_size):
            sources[rank] = [("", ranks[rank])]
            for server_id in first.shared:
                server = grouped.get(server_id, {}).get(0)
                if server is not None and server.state == "up":
                    sources[rank].append((f"{server_id}/", server))
        spans = chunk_spans(num_tokens, first.chunk_size, save_partial=True)
        by_tier: dict[str, int] = {}
        matched_to = 0
        last_tier = ""
        cost = 0
        for index, chunk_hash in enumerate(hashes):
            slowest = None
            for rank in range(first.world_size):
                compat = (key_model, first.world_size, rank, digest)
                tier = self._fastest(sources[rank], chunk_hash, compat)
                if tier is None:
                    slowest = None
                    break
                slowest = tier if slowest is None else max(slowest, tier)
            if slowest is None:
                break
            cost += slowest[0]
            name = slowest[1]
            by_tier[name] = by_tier.get(name, 0) + 1
            last_tier = name
            matched_to = spans[index][1]
        if matched_to == 0:
            return None
        return matched_to, by_tier, last_tier, cost

    @staticmethod
    def _fastest(sources: list[tuple[str, Holder]], chunk_hash: bytes, compat: _Compat) -> tuple[int, str] | None:
        position = 0
        for label, holder in sources:
            held = set(holder.tiers_of(chunk_hash, compat))
            for tier in holder.registration.tiers:
                if tier.name in held:
                    return position, label + tier.name
                position += 1
            for name in sorted(held - {t.name for t in holder.registration.tiers}):
                return position, label + name
        return None

    def holders_of(self, instance_id: str | None, model: str | None = None) -> list[Holder]:
        with self._lock:
            return [h for h in self._holders.values()
                    if (instance_id is None or h.registration.instance_id == instance_id)
                    and (model is None or model in (h.registration.model, h.registration.key_model))]

    def known_instance(self, instance_id: str) -> bool:
        with self._lock:
            return any(name[0] == instance_id for name in self._holders)

    # -- commands ---------------------------------------------------------------

    def clear(self, instance_id: str | None, *, model: str | None = None, tags: dict[str, str] | None = None,
              tiers: Sequence[str] = ()) -> tuple[list[str], list[int]]:
        """Queue a clear for the matching instances and forget their chunks now; (instances, command ids)."""
        digest = tags_digest(tags) if tags else None
        with self._lock:
            targets = [h for h in self._holders.values()
                       if h.registration.kind != "server" or instance_id is not None]
            targets = [h for h in targets if (instance_id is None or h.registration.instance_id == instance_id)
                       and (model is None or model in (h.registration.model, h.registration.key_model))]
            ids = []
            for holder in targets:
                for tier in (tiers or [None]):
                    holder.clear(tier, digest)
                command = Command(id=next(self._command_ids), op="clear", tags=tags or {}, tiers=list(tiers))
                holder.commands.append(command)
                ids.append(command.id)
                self._note(holder.name, "clear", ",".join(tiers), "")
            self.counters["clears"] += 1
            return sorted({h.registration.instance_id for h in targets}), ids

    def command(self, holders: Sequence[Holder], op: str, **fields: Any) -> list[int]:
        """Queue ``op`` for each of ``holders``; the command ids."""
        ids = []
        with self._lock:
            for holder in holders:
                command = Command(id=next(self._command_ids), op=op, **fields)
                holder.commands.append(command)
                ids.append(command.id)
            self.counters[f"{op}s"] += 1
        return ids

    def wait_results(self, ids: Sequence[int], timeout_s: float) -> dict[int, CommandResult]:
        """The results of ``ids`` that came back within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                done = {i: self._results[i] for i in ids if i in self._results}
                left = deadline - time.monotonic()
                if len(done) == len(ids) or left <= 0:
                    return done
                self._lock.wait(left)

    # -- numbers ---------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            states = collections.Counter()
            instances = {}
            for holder in self._holders.values():
                reg = holder.registration
                instances.setdefault(reg.instance_id, []).append(holder)
            for holders in instances.values():
                states["up" if all(h.state == "up" for h in holders) else "down"] += 1
            chunks = {(h.registration.instance_id, h.registration.rank): len(h.held) for h in self._holders.values()}
            return {"states": dict(states), "chunks": chunks, "counters": dict(self.counters),
                    "stats": {name: h.stats for name, h in self._holders.items()}}


def _whole_chunks(holders: Sequence[Holder], world_size: int, tier: str | None = None) -> int:
    """How many chunks every rank of an instance holds its shard of (in ``tier``, or in any of its
    tiers): what the instance can serve. ``holders`` are its ranks in order; a rank missing holds nothing."""
    if len(holders) < world_size:
        return 0
    first, others = holders[0], holders[1:]

    def held(holder: Holder, chunk_hash: bytes, compat: _Compat) -> bool:
        counts = holder.by_hash.get(chunk_hash, {}).get(compat)
        return bool(counts) and (tier is None or tier in counts)

    count = 0
    for chunk_hash, per_compat in first.by_hash.items():
        for compat in per_compat:
            model, size, _, digest = compat
            count += held(first, chunk_hash, compat) and all(
                held(other, chunk_hash, (model, size, other.registration.rank, digest)) for other in others)
    return count


def _tier_capacity(registration: Registration, name: str) -> int | None:
    return next((tier.capacity_bytes for tier in registration.tiers if tier.name == name), None)
