"""What a transfer cost beyond its bytes, so a trace can say why one ran slow.

`TransferProbe` is wrapped around gather/scatter calls by the transfer
stages, which record its totals on their spans:

=================  =========================================================
``faults``         page faults the process took during the calls: a chunk
                   buffer whose pages were never written before faults on
                   every 4 KiB page (first touch)
``cpu_ns``         CPU time of the calling thread; well below the wall time
                   means the thread waited for a core (thread contention)
``preempted``      involuntary context switches of the process meanwhile
``row_bytes``      the shortest run of bytes one copy moved (the layout:
                   short rows make a gather or scatter slower than a copy)
=================  =========================================================

``flowkv trace summarize`` reads them (``flowkv.faults`` and so on).

>>> probe = TransferProbe()
>>> with probe:
...     _ = bytearray(1 << 20)
>>> sorted(probe.attributes())
['cpu_ns', 'faults', 'preempted']
"""

from __future__ import annotations

import resource
import threading
import time
from typing import Any

__all__ = ["TransferProbe", "note_row_bytes"]

_local = threading.local()


def note_row_bytes(row_bytes: int) -> None:
    """Called by the kernels with the row length of each copy they make (bytes)."""
    shortest = getattr(_local, "row_bytes", None)
    if shortest is None or row_bytes < shortest:
        _local.row_bytes = row_bytes


class TransferProbe:
    """Totals over every ``with probe:`` block: faults, CPU time, preemptions, shortest row.

    One probe per stage run; `attributes` gives the totals so far, ready for
    ``ctx.record(**probe.attributes())``. Not reentrant.
    """

    __slots__ = ("faults", "cpu_ns", "preempted", "row_bytes", "_start")

    def __init__(self) -> None:
        self.faults = 0
        self.cpu_ns = 0
        self.preempted = 0
        self.row_bytes: int | None = None
        self._start: tuple[int, int, int] | None = None

    def __enter__(self) -> TransferProbe:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        _local.row_bytes = None
        self._start = (usage.ru_minflt + usage.ru_majflt, time.thread_time_ns(), usage.ru_nivcsw)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        cpu = time.thread_time_ns()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        faults, cpu_start, preempted = self._start
        self.faults += usage.ru_minflt + usage.ru_majflt - faults
        self.cpu_ns += cpu - cpu_start
        self.preempted += usage.ru_nivcsw - preempted
        rows = getattr(_local, "row_bytes", None)
        if rows is not None and (self.row_bytes is None or rows < self.row_bytes):
            self.row_bytes = rows

    def attributes(self) -> dict[str, int]:
        """The totals as span attributes (without the ``flowkv.`` prefix the runner adds)."""
        found = {"faults": self.faults, "cpu_ns": self.cpu_ns, "preempted": self.preempted}
        if self.row_bytes is not None:
            found["row_bytes"] = self.row_bytes
        return found
