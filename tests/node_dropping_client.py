"""A node-server client process whose call is cut off by its timeout while it holds rooms, and that lives on.

    python tests/node_dropping_client.py SOCKET ROOMS ROOM_BYTES

One JSON line on stdout per step; after the second, each line on stdin runs one more:

1. ``{"rooms": [[offset, nbytes], ...]}``: connected, the arena mapped, ROOMS rooms allocated;
2. ``{"dropped": why}``: an ``events`` call the server answers after 2 s, given up at its 0.2 s
   timeout (the connection is closed, as every client does after a timeout);
- ``write``: fills every room it still maps with 0xAB -> ``{"written": ROOMS}``;
- ``alloc``: a new connection asks for one room -> ``{"alloc": "granted"}`` or ``{"alloc": "refused", "error": ...}``;
- ``exit``: exits 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flowkv

from flowkv.tiers import node_protocol as wire  # noqa: E402


def say(message: dict) -> None:
    print(json.dumps(message), flush=True)


def connect(path: str, *, map: bool = False) -> wire.NodeConnection:
    conn = wire.NodeConnection.connect(path, timeout_s=30.0)
    conn.hello("dropping", operator_token=wire.read_operator_token(path), map=map)  # events: an operator's call
    return conn


def main() -> int:
    path, rooms, room_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    conn = connect(path, map=True)
    segment = wire.map_segment(conn.take_segment_fd(), int(conn.hello_reply["segment_bytes"]))
    objs = conn.call("alloc", sizes=[room_bytes] * rooms)["objs"]
    views = [segment.buffer[offset:offset + room_bytes] for _, offset in objs]
    say({"rooms": [[offset, room_bytes] for _, offset in objs]})
    try:
        conn.call("events", since=1 << 62, wait_s=2.0, timeout_s=0.2)
    except wire.NodeUnavailable as exc:
        say({"dropped": str(exc)})
    else:
        say({"dropped": None})
    for line in sys.stdin:
        step = line.strip()
        if step == "write":  # what a gather still running after the timeout does
            for view in views:
                view.fill_(0xAB)
            say({"written": len(views)})
        elif step == "alloc":
            again = connect(path)
            try:
                granted = again.call("alloc", sizes=[room_bytes])["objs"]
                say({"alloc": "granted", "rooms": len(granted)})
            except wire.NodeError as exc:
                say({"alloc": "refused", "error": str(exc)})
            finally:
                again.close()
        elif step == "exit":
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
