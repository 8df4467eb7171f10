"""Who holds what on a node server: client sessions, their handles, and the pins of their lookups.

::

    Session (one per connection)         Handle (one per reference a client holds)
      client: "uid0:pid42:c7"              kind: "alloc" (a room being filled, not in the index)
      handles: {17, 18, ...}  ----------->       "read"  (an entry's pages a retrieve scatters from)
      closed_at: None | when it hung up    obj:  the MemoryObj (one reference)
      quarantined: past the lease, its process alive

Rules:

- A handle belongs to the session (connection) that got it. ``commit`` hands
  an ``alloc`` handle's room to the index; ``release`` drops any handle.
  Nothing uncommitted is ever in the index, so nothing uncommitted is served.
- When a connection ends (the client exited, was killed, or gave up on a
  call), its handles stay held for ``lease_timeout_s``. Then they are
  reclaimed (the pages go back, or to the entry that still holds them) if
  its process is gone; while that process lives (the same pid *and* start
  time, never a later process given its pid) they stay **quarantined**: it
  still maps the arena, and a call it dropped at its timeout may still be
  gathering into those pages, so they are handed to nobody else until it
  exits. The process itself may give them back from a new connection
  (``release`` of its own dropped connection's handles); what it holds so
  counts against it (:meth:`LeaseTable.quarantined_bytes`), and the server
  refuses it new rooms past a bound. A client whose pid the server cannot
  see (another pid namespace) is reclaimed at the lease timeout.
- Pins belong to ``(client, lookup owner)``, the client named by its
  credentials and connection (never by what it declares), so two clients' requests
  never share one. They end when released, at their deadline, or when their
  client has had no connection for ``lease_timeout_s``.
- A connected client is never dropped for being idle.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Literal

import attrs

from flowkv.local_peers import process_start

__all__ = ["Handle", "LeaseTable", "Session"]


@attrs.define(eq=False)
class Session:
    """One client connection."""

    id: int
    client: str = "?"  # the server's name for it: uid, pid (SO_PEERCRED) and connection
    pid: int | None = None  # the peer's pid (SO_PEERCRED)
    uid: int | None = None  # the peer's uid (SO_PEERCRED)
    started: int | None = None  # the peer process's start time (process_start): None when unknown
    label: str = "?"  # what the client called itself in hello (shown, never trusted)
    operator: bool = False  # it showed the server's operator token
    connected_at: float = attrs.field(factory=time.time)
    handles: set[int] = attrs.field(factory=set)
    closed_at: float | None = None  # monotonic seconds when the connection ended
    quarantined: bool = False  # closed past the lease while its process lives: its handles are kept

    def same_process(self, other: Session) -> bool:
        """Whether both connections are of one process (pid and start time, as the kernel says)."""
        return (self.started is not None and self.started == other.started and self.pid == other.pid
                and self.uid == other.uid)


@attrs.define(eq=False)
class Handle:
    """One reference a client holds on a memory object."""

    id: int
    session: Session
    kind: Literal["alloc", "read"]
    obj: Any  # flowkv.memory.MemoryObj


class LeaseTable:
    """Sessions, handles and pin owners; the loop thread is its only user."""

    def __init__(self, *, lease_timeout_s: float) -> None:
        self.lease_timeout_s = lease_timeout_s
        self.sessions: dict[int, Session] = {}
        self.handles: dict[int, Handle] = {}
        self.owners: dict[str, set[str]] = {}  # client id -> the pin owners it used
        self._ids = itertools.count(1)
        self.reclaimed = {"allocations": 0, "reads": 0, "pins": 0, "sessions": 0, "quarantined": 0}
        self.quarantines = 0  # sessions ever quarantined

    def open(self) -> Session:
        session = Session(id=next(self._ids))
        self.sessions[session.id] = session
        return session

    def close(self, session: Session) -> None:
        """The connection ended: its leases run out ``lease_timeout_s`` from now (a session that
        holds nothing, of a client that never pinned, is forgotten at once)."""
        session.closed_at = time.monotonic()
        if not session.handles and session.client not in self.owners:
            del self.sessions[session.id]

    def add(self, session: Session, kind: Literal["alloc", "read"], obj: Any) -> int:
        handle = Handle(next(self._ids), session, kind, obj)
        self.handles[handle.id] = handle
        session.handles.add(handle.id)
        return handle.id

    def take(self, session: Session, handle_id: int, kind: str | None = None, *,
             own_process: bool = False) -> Handle | None:
        """Remove and answer ``session``'s handle ``handle_id`` (of ``kind``), or None if it has none.

        ``own_process``: a handle of a dropped connection of the same process
        counts as ``session``'s too (the process gives back what it no longer uses).
        """
        handle = self.handles.get(handle_id)
        if handle is None or (kind is not None and handle.kind != kind):
            return None
        holder = handle.session
        if holder is not session and not (own_process and holder.closed_at is not None
                                          and holder.same_process(session)):
            return None
        del self.handles[handle_id]
        holder.handles.discard(handle_id)
        if holder is not session and not holder.handles and holder.client not in self.owners:
            del self.sessions[holder.id]  # a dropped connection its process gave everything back for
        return handle

    def owner(self, session: Session, owner: str) -> str:
        """The server's name for a client's pin owner (namespaced by client id)."""
        name = f"{session.client}\x1f{owner}"
        self.owners.setdefault(session.client, set()).add(name)
        return name

    def forget_owner(self, session: Session, name: str) -> None:
        """``name`` (from :meth:`owner`) holds no pins any more: out of the table."""
        names = self.owners.get(session.client)
        if names is not None:
            names.discard(name)
            if not names:
                del self.owners[session.client]

    def prune_owners(self, holds_pins: Any) -> int:
        """Forget every owner for which ``holds_pins(name)`` is false (their pins expired); how many."""
        pruned = 0
        for client, names in list(self.owners.items()):
            gone = {name for name in names if not holds_pins(name)}
            names -= gone
            pruned += len(gone)
            if not names:
                del self.owners[client]
        return pruned

    def expired(self, now: float | None = None) -> tuple[list[Handle], list[str], list[Session]]:
        """What the sessions closed more than ``lease_timeout_s`` ago give up, removed from the table for
        the caller to release: the handles of those whose process is gone, every one's pin owners; and
        the sessions newly quarantined (their process lives: their handles stay)."""
        now = time.monotonic() if now is None else now
        handles: list[Handle] = []
        owners: list[str] = []
        quarantined: list[Session] = []
        lives: dict[tuple[int | None, int | None], bool] = {}  # one look at /proc per process and call
        for session in list(self.sessions.values()):
            if session.closed_at is None or now - session.closed_at < self.lease_timeout_s:
                continue
            # Pins hold no pages a client writes: they end with the lease either way.
            owners.extend(sorted(self.owners.pop(session.client, set())))
            if session.handles and _lives(session, lives):
                if not session.quarantined:
                    session.quarantined = True
                    self.quarantines += 1
                    quarantined.append(session)
                continue
            for handle_id in sorted(session.handles):
                handle = self.handles.pop(handle_id)
                handles.append(handle)
                self.reclaimed["allocations" if handle.kind == "alloc" else "reads"] += 1
            session.handles.clear()
            del self.sessions[session.id]
            self.reclaimed["sessions"] += 1
            self.reclaimed["quarantined"] += session.quarantined
        return handles, owners, quarantined

    def quarantined_bytes(self, session: Session) -> int:
        """Arena bytes the quarantined connections of ``session``'s process hold."""
        return sum(self.handles[h].obj.nbytes for s in self.sessions.values()
                   if s.quarantined and s.same_process(session) for h in s.handles)

    def counts(self) -> dict[str, Any]:
        alloc = sum(h.kind == "alloc" for h in self.handles.values())
        return {
            "connected": sum(s.closed_at is None for s in self.sessions.values()),
            # connections that ended less than lease_timeout_s ago, holding rooms, reads or pins
            "disconnected": sum(s.closed_at is not None and not s.quarantined for s in self.sessions.values()),
            "allocations_held": alloc,
            "reads_held": len(self.handles) - alloc,
            "lease_timeout_s": self.lease_timeout_s,
            "pin_owners": sum(len(names) for names in self.owners.values()),
            # connections past the lease whose process lives: their rooms and reads are kept until it exits
            "quarantined_sessions": sum(s.quarantined for s in self.sessions.values()),
            "quarantined_bytes": sum(self.handles[h].obj.nbytes for s in self.sessions.values()
                                     if s.quarantined for h in s.handles),
            "quarantines": self.quarantines,
            **{f"reclaimed_{k}": v for k, v in self.reclaimed.items()},
        }

    def clients(self) -> list[dict[str, Any]]:
        return [{"session": s.id, "client": s.client, "label": s.label, "pid": s.pid, "uid": s.uid,
                 "connected": s.closed_at is None, "quarantined": s.quarantined,
                 "handles": len(s.handles)} for s in self.sessions.values()]


def _lives(session: Session, seen: dict[tuple[int | None, int | None], bool]) -> bool:
    """Whether ``session``'s process still runs (the same process: pid and start time)."""
    key = (session.pid, session.started)
    if key not in seen:
        seen[key] = session.started is not None and session.pid is not None and \
            process_start(session.pid) == session.started
    return seen[key]
