"""Where flowkv's threads run when the thread that starts them is pinned to a core.

A thread inherits its creator's CPU affinity. Inside vLLM's CPU worker the
thread that calls the connector is the OpenMP master, pinned to the first
core of ``VLLM_CPU_OMP_THREADS_BIND``: every thread flowkv started there (the
pre-fault refill, the lookup server, the tiers' I/O loop and its write-behind,
the span exporter) would share that one core with the thread that drives the
model — the core every step's serial work runs on — while the other cores'
OpenMP workers idle between forward passes. `other_cores` names the cores
to put them on instead; `threads_elsewhere` starts threads there.

    >>> with threads_elsewhere():
    ...     pass  # threads started here run off the caller's cores (when the process has others)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["other_cores", "process_cores", "set_thread_cores", "threads_elsewhere"]


def set_thread_cores(cores: set[int]) -> bool:
    """Pin the calling thread to ``cores``; False where the OS refuses (or has no affinity)."""
    try:
        os.sched_setaffinity(0, cores)  # 0: the calling thread only
    except (OSError, AttributeError):
        return False
    return True


def process_cores() -> set[int]:
    """The cores this process's threads may run on, whatever the calling thread is pinned to:
    the union of every thread's affinity. Inside vLLM's worker that is the cores of
    ``VLLM_CPU_OMP_THREADS_BIND`` (one OpenMP thread pinned to each); under ``taskset`` it
    stays within the set given."""
    cores: set[int] = set()
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                cores |= os.sched_getaffinity(int(task))
            except OSError:  # the thread ended meanwhile
                continue
    except OSError:
        pass
    return cores


def other_cores() -> set[int] | None:
    """The process's cores the calling thread is not pinned to, or None (a thread that may run
    on all of them, a one-core process, no affinity on this OS): where threads it starts go."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    return (process_cores() - os.sched_getaffinity(0)) or None


@contextlib.contextmanager
def threads_elsewhere() -> Iterator[set[int] | None]:
    """Threads started inside the block run on `other_cores` (yielded; None: where they would
    anyway). The caller itself is moved there for the block's length and put back after: a
    thread takes its creator's affinity when it is created, so threads that objects built in
    the block start later, from their own threads, stay there too."""
    cores = other_cores()
    if cores is None:
        yield None
        return
    own = os.sched_getaffinity(0)
    set_thread_cores(cores)
    try:
        yield cores
    finally:
        set_thread_cores(own)
