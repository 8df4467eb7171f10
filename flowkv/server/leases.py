"""Who holds what on a node server: client sessions, their handles, and the pins of their lookups.

::

    Session (one per connection)         Handle (one per reference a client holds)
      client: "uid0:pid42:c7"              kind: "alloc" (a room being filled, not in the index)
      handles: {17, 18, ...}  ----------->       "read"  (an entry's pages a retrieve scatters from)
      closed_at: None | when it hung up    obj:  the MemoryObj (one reference)

Rules:

- A handle belongs to the session (connection) that got it. ``commit`` hands
  an ``alloc`` handle's room to the index; ``release`` drops any handle.
  Nothing uncommitted is ever in the index, so nothing uncommitted is served.
- When a connection ends (the client exited, was killed, or gave up on a
  call), its handles stay held for ``lease_timeout_s``: a client that lost
  only its connection may still be copying into or out of those pages. Then
  they are reclaimed (the pages go back, or to the entry that still holds
  them).
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

__all__ = ["Handle", "LeaseTable", "Session"]


@attrs.define(eq=False)
class Session:
    """One client connection."""

    id: int
    client: str = "?"  # the server's name for it: uid, pid (SO_PEERCRED) and connection
    pid: int | None = None  # the peer's pid (SO_PEERCRED)
    uid: int | None = None  # the peer's uid (SO_PEERCRED)
    label: str = "?"  # what the client called itself in hello (shown, never trusted)
    operator: bool = False  # it showed the server's operator token
    connected_at: float = attrs.field(factory=time.time)
    handles: set[int] = attrs.field(factory=set)
    closed_at: float | None = None  # monotonic seconds when the connection ended


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
        self.reclaimed = {"allocations": 0, "reads": 0, "pins": 0, "sessions": 0}

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

    def take(self, session: Session, handle_id: int, kind: str | None = None) -> Handle | None:
        """Remove and answer ``session``'s handle ``handle_id`` (of ``kind``), or None if it has none."""
        handle = self.handles.get(handle_id)
        if handle is None or handle.session is not session or (kind is not None and handle.kind != kind):
            return None
        del self.handles[handle_id]
        session.handles.discard(handle_id)
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

    def _live(self, client: str) -> Session | None:
        return next((s for s in self.sessions.values() if s.client == client and s.closed_at is None), None)

    def expired(self, now: float | None = None) -> tuple[list[Handle], list[str]]:
        """Handles of sessions closed more than ``lease_timeout_s`` ago, and the pin owners of
        clients with no live session left: both removed from the table, for the caller to release."""
        now = time.monotonic() if now is None else now
        handles: list[Handle] = []
        owners: list[str] = []
        for session in list(self.sessions.values()):
            if session.closed_at is None or now - session.closed_at < self.lease_timeout_s:
                continue
            for handle_id in sorted(session.handles):
                handle = self.handles.pop(handle_id)
                handles.append(handle)
                self.reclaimed["allocations" if handle.kind == "alloc" else "reads"] += 1
            session.handles.clear()
            del self.sessions[session.id]
            self.reclaimed["sessions"] += 1
            if self._live(session.client) is None and not any(
                    s.client == session.client for s in self.sessions.values()):
                owners.extend(sorted(self.owners.pop(session.client, set())))
        return handles, owners

    def counts(self) -> dict[str, Any]:
        alloc = sum(h.kind == "alloc" for h in self.handles.values())
        return {
            "connected": sum(s.closed_at is None for s in self.sessions.values()),
            # connections that ended less than lease_timeout_s ago, holding rooms, reads or pins
            "disconnected": sum(s.closed_at is not None for s in self.sessions.values()),
            "allocations_held": alloc,
            "reads_held": len(self.handles) - alloc,
            "lease_timeout_s": self.lease_timeout_s,
            "pin_owners": sum(len(names) for names in self.owners.values()),
            **{f"reclaimed_{k}": v for k, v in self.reclaimed.items()},
        }

    def clients(self) -> list[dict[str, Any]]:
        return [{"session": s.id, "client": s.client, "label": s.label, "pid": s.pid, "uid": s.uid,
                 "connected": s.closed_at is None,
                 "handles": len(s.handles)} for s in self.sessions.values()]
