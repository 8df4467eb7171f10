"""The process-wide I/O thread: one anyio event loop that runs every tier call.

Synchronous engine code (the inference thread) never does slow I/O itself; it
hands a coroutine function to this loop and waits, at most ``timeout_s``, or
fires and forgets (write-behind)::

    from flowkv.tiers import portal

    hits = portal.call(tier.exists, keys, timeout_s=0.5)
    portal.submit(tier.put, entries)          # write-behind

The thread starts on first use, is re-created in a forked child (a thread does
not survive ``fork``), and stops at interpreter exit.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from flowkv.kernels.affinity import threads_elsewhere

__all__ = ["call", "get_portal", "shutdown", "submit"]

T = TypeVar("T")

_lock = threading.Lock()
_portal: BlockingPortal | None = None
_portal_cm: AbstractContextManager[BlockingPortal] | None = None
_portal_thread: threading.Thread | None = None


def get_portal() -> BlockingPortal:
    """The running portal, started on first use (asyncio backend)."""
    global _portal, _portal_cm, _portal_thread
    with _lock:
        if _portal is None:
            # The loop's thread, and the worker threads it starts, off a pinned caller's core
            # (vLLM's OpenMP master): write-behind and reads run beside the model, not on its core.
            with threads_elsewhere():
                cm = start_blocking_portal(backend="asyncio", name="flowkv-io")
                portal = cm.__enter__()
            thread_box: list[threading.Thread] = []
            portal.call(_record_thread, thread_box)
            _portal, _portal_cm, _portal_thread = portal, cm, thread_box[0]
        return _portal


async def _record_thread(box: list[threading.Thread]) -> None:
    box.append(threading.current_thread())


def _check_not_on_portal() -> None:
    # Waiting on the portal from its own thread would deadlock forever.
    if _portal_thread is not None and threading.current_thread() is _portal_thread:
        raise RuntimeError(
            "flowkv.tiers.portal.call() was called from the portal thread itself; "
            "await the coroutine directly instead"
        )


def call(fn: Callable[..., Awaitable[T]], *args: Any, timeout_s: float | None = None) -> T:
    """Run ``await fn(*args)`` on the I/O thread and return its result.

    Raises :class:`TimeoutError` when no result came within ``timeout_s``
    seconds; the task is then cancelled. Exceptions from ``fn`` propagate.
    """
    _check_not_on_portal()
    future = get_portal().start_task_soon(fn, *args)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"{getattr(fn, '__qualname__', fn)} took longer than {timeout_s} s") from None


def submit(fn: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
    """Start ``await fn(*args)`` on the I/O thread without waiting (write-behind)."""
    return get_portal().start_task_soon(fn, *args)


def shutdown() -> None:
    """Stop the I/O thread, cancelling tasks still running; the next call restarts it."""
    global _portal, _portal_cm, _portal_thread
    with _lock:
        portal, cm = _portal, _portal_cm
        _portal = _portal_cm = _portal_thread = None
    if portal is None or cm is None:
        return
    try:
        # Cancel what is still running (a hung write-behind) rather than wait on it.
        portal.call(portal.stop, True)
    except RuntimeError:
        pass  # already stopping
    try:
        cm.__exit__(None, None, None)
    except Exception:  # noqa: BLE001 - exit runs at interpreter shutdown; nothing to report to
        pass


def _forget_after_fork() -> None:
    # The child inherits the globals but not the thread; start afresh there.
    global _portal, _portal_cm, _portal_thread, _lock
    _portal = _portal_cm = _portal_thread = None
    _lock = threading.Lock()


atexit.register(shutdown)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
