"""Resident memory: buffers whose pages the kernel backs before a store writes them.

A buffer that is only allocated (``torch.empty``, ``mmap``) has no physical
pages yet. The first write to each 4 KiB page traps into the kernel, which
zeroes a page and maps it: a first-touch page fault. A fresh memory arena
makes every store pay these until the arena has been written once; measured
here, a store of 11 MiB into untouched pages took 4.1-4.5 ms against 2.4 ms
into touched ones.

`ResidentBuffer` maps a buffer — anonymous, or a named file in shared memory
(``/dev/shm``, which a node server and its clients map alike) — asks for
transparent huge pages where the OS offers them, and pre-faults it:

- ``"background"`` keeps a bounded *window* resident ahead of the allocation
  frontier (the end of the highest bytes an arena ever handed out: an arena
  hands out its low pages first, so the pages below the frontier were
  written once already). A thread refills the window only while the engine
  is idle — nothing allocated and no busy section open (`busy`,
  `note_activity`) for ``quiet_s`` — in steps of one huge page, so a store
  or a forward pass never waits for it and a cold request does not pay for
  pre-faulting the whole arena at start (measured in vLLM: a background
  pre-fault of the whole arena made cold 4k requests 50 % slower while it
  ran). A store that outruns the window faults its pages in itself, as
  ``"off"`` does.
- ``"now"`` pre-faults the whole buffer before it returns and then does
  nothing more (no thread competes with the engine afterwards).
- ``"off"``: pages fault in on first use.

Pre-faulting uses ``madvise(MADV_POPULATE_WRITE)``, which backs the pages
without changing their bytes, so it is safe while stores already write into
the buffer. It never takes the machine's available memory below a reserve:
an arena larger than the memory there is pre-faulted only as far as it fits,
and the rest faults in on first use as before (and with a warning, since
filling such an arena will run out of memory anyway).

    >>> buf = ResidentBuffer.anonymous(4 << 20, prefault="now")
    >>> buf.tensor.shape, buf.resident_bytes == buf.nbytes, buf.prefault_state
    (torch.Size([4194304]), True, 'done')
    >>> resident_pages(buf.tensor) == buf.nbytes // PAGE_BYTES
    True
    >>> buf.close()
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import attrs
import torch

__all__ = [
    "DEFAULT_QUIET_S",
    "DEFAULT_WINDOW_BYTES",
    "HUGE_PAGE_BYTES",
    "PAGE_BYTES",
    "HugePageSupport",
    "PrefaultMode",
    "ResidentBuffer",
    "available_memory",
    "default_reserve",
    "huge_page_support",
    "resident_pages",
]

log = logging.getLogger("flowkv.resident")

PrefaultMode = Literal["background", "now", "off"]
PREFAULT_MODES: tuple[str, ...] = ("background", "now", "off")

#: The base page size (the unit of a first-touch fault).
PAGE_BYTES = mmap.PAGESIZE
#: A transparent huge page on x86-64 and most arm64 kernels.
HUGE_PAGE_BYTES = 2 << 20
# Linux >= 5.14; Python's mmap module names it only from 3.13 on.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# Pre-faulting works in steps of this many bytes: between two steps it checks the
# memory reserve and whether it was asked to stop. Each step holds the process's
# memory-map lock (read) while the kernel zeroes its pages, and every mmap/munmap
# of the process (torch's large allocations) waits for it: one huge page's worth
# keeps that wait short. (64 MiB steps on a thread at nice 19 stalled an allocating
# thread for up to 18 s on this loaded 2-core machine: the low-priority thread held
# the lock while it waited for a core.)
_STEP_BYTES = HUGE_PAGE_BYTES
# The memory reserve is checked for this many bytes ahead at a time (reading
# /proc/meminfo costs about a quarter of a step).
_CHECK_BYTES = 64 << 20
#: Bytes a background pre-fault keeps resident ahead of the allocation frontier: a few
#: long requests' stores (a 4k-token prompt of a small model stores ~24 MiB).
DEFAULT_WINDOW_BYTES = 256 << 20
#: How long the engine must have been idle (nothing allocated, no busy section) before the
#: window is refilled: longer than the gap between two steps of a busy engine, so a
#: refill runs when requests pause, not between the forward passes of a running batch.
DEFAULT_QUIET_S = 0.05
_THP = Path("/sys/kernel/mm/transparent_hugepage")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.mincore.restype = ctypes.c_int


@attrs.frozen
class HugePageSupport:
    """What ``/sys/kernel/mm/transparent_hugepage`` says (the selected word of each file, or "")."""

    #: anonymous memory: always / madvise / never
    enabled: str
    #: what a fault in a huge-page region does when no huge page is free
    #: (always / defer / defer+madvise / madvise / never; "madvise" compacts memory
    #: synchronously in the faulting thread for regions advised MADV_HUGEPAGE)
    defrag: str
    #: shared memory (tmpfs, /dev/shm): always / within_size / advise / never / deny / force
    shmem_enabled: str

    def anonymous(self) -> bool:
        """Whether an anonymous mapping advised MADV_HUGEPAGE may get huge pages."""
        return self.enabled in ("always", "madvise")

    def shared(self) -> bool:
        """Whether a shared-memory mapping advised MADV_HUGEPAGE may get huge pages."""
        return self.shmem_enabled in ("always", "within_size", "advise", "force")


def _selected(path: Path) -> str:
    """The bracketed word of a sysfs choice file ("always [madvise] never" -> "madvise")."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip()


def huge_page_support() -> HugePageSupport:
    """The OS's transparent-huge-page settings (empty strings where the files do not exist)."""
    return HugePageSupport(
        enabled=_selected(_THP / "enabled"),
        defrag=_selected(_THP / "defrag"),
        shmem_enabled=_selected(_THP / "shmem_enabled"),
    )


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory() -> int | None:
    """Bytes the kernel could give out without swapping (``MemAvailable``), or None when unknown."""
    return _meminfo("MemAvailable")


def default_reserve() -> int:
    """Available memory a pre-fault leaves to everything else: an eighth of the machine, at least 2 GiB."""
    total = _meminfo("MemTotal") or 0
    return max(2 << 30, total // 8)


def _no_room(nbytes: int) -> str:
    total, available = _meminfo("MemTotal"), available_memory()
    known = (f" (this machine has {total / 2**30:.1f} GiB of memory, {available / 2**30:.1f} GiB available)"
             if total is not None and available is not None else "")
    return (f"the kernel refuses to map {nbytes / 2**30:.1f} GiB{known}: the memory arena cannot be larger "
            "than the machine's memory; lower [tiers.memory] capacity")


def _address(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


def resident_pages(tensor: torch.Tensor) -> int:
    """How many of the base pages under a CPU tensor's bytes are resident now (``mincore``).

    Counts every page the tensor's bytes touch, the partial first and last included.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"resident_pages needs a CPU tensor, got one on {tensor.device}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return 0
    start = _address(tensor) // PAGE_BYTES * PAGE_BYTES
    end = -(-(_address(tensor) + nbytes) // PAGE_BYTES) * PAGE_BYTES
    pages = (end - start) // PAGE_BYTES
    vector = (ctypes.c_ubyte * pages)()
    if _libc.mincore(start, end - start, vector) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore failed: {os.strerror(err)}")
    return sum(byte & 1 for byte in bytes(vector))


class ResidentBuffer:
    """A page-aligned buffer of ``nbytes`` bytes (`tensor`, uint8), optionally pre-faulted.

    Build it with `anonymous` (private memory of this process) or `shared`
    (a named file under ``/dev/shm``, mapped shared). ``prefault`` is
    ``"background"`` (a window of ``window_bytes`` ahead of the allocation
    frontier, refilled while the engine has been idle for ``quiet_s``),
    ``"now"`` (all of it, before returning) or ``"off"``; ``huge_pages`` asks
    for transparent huge pages where the OS offers them for this kind of
    memory (`huge_pages_advised` says whether the advice was given). The
    pre-fault goes front to back, in steps, and stops early when the memory
    available to the machine would fall below ``reserve_bytes`` (default
    `default_reserve`); `prefault_state` then says why. `resident_bytes` is
    how far it got: the buffer's own record of the pages it made resident.

    The arena that hands out the buffer's bytes reports its frontier with
    `note_allocated`; the engine marks its own work with `busy` (or
    `note_activity`), so the refill keeps off the cores while it runs.
    """

    def __init__(self, mapping: mmap.mmap, nbytes: int, *, offset: int, shared: bool, huge_pages: bool,
                 prefault: PrefaultMode, reserve_bytes: int | None, path: Path | None = None,
                 fd: int | None = None, window_bytes: int = DEFAULT_WINDOW_BYTES, quiet_s: float = DEFAULT_QUIET_S) -> None:
        if window_bytes <= 0:
            raise ValueError(f"window_bytes must be positive, got {window_bytes}")
        self._mapping = mapping
        #: usable bytes (the tensor's length)
        self.nbytes = nbytes
        #: the shared-memory file, for `shared` buffers
        self.path = path
        #: the memory file's descriptor, for `memfd` buffers (handed to other processes; closed by `unlink`)
        self.fd = fd
        self.shared = shared
        #: the buffer's bytes as one uint8 tensor (no copy: a view of the mapping)
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset) \
            if nbytes else torch.empty(0, dtype=torch.uint8)
        self._reserve = default_reserve() if reserve_bytes is None else int(reserve_bytes)
        support = huge_page_support()
        #: whether MADV_HUGEPAGE was given for the part that is pre-faulted (see `_step`)
        self.huge_pages_advised = False
        self._want_huge = huge_pages and (support.shared() if shared else support.anonymous())
        #: bytes a background pre-fault keeps resident ahead of the allocation frontier
        self.window_bytes = int(window_bytes)
        #: idle time (seconds) the engine must have had before the window is refilled
        self.quiet_s = float(quiet_s)
        self._resident = 0
        self._frontier = 0  # end of the highest bytes handed out
        self._target = 0  # bytes from the start the pre-fault should make resident
        self._checked_until = 0  # the memory reserve was checked for the bytes below this
        self._busy = 0  # busy sections open
        self._last_activity = -math.inf  # monotonic time the engine last allocated or left a busy section
        self._state = "off"
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._thread_done = False  # the refill thread returned (done or stopped)
        self.prefault(prefault)

    # -- construction -------------------------------------------------------

    @classmethod
    def anonymous(cls, nbytes: int, *, prefault: PrefaultMode = "background", huge_pages: bool = True,
                  reserve_bytes: int | None = None, window_bytes: int = DEFAULT_WINDOW_BYTES,
                  quiet_s: float = DEFAULT_QUIET_S) -> ResidentBuffer:
        """Private memory of this process, aligned to a huge page when huge pages are asked for."""
        if nbytes < 0:
            raise ValueError(f"nbytes must not be negative, got {nbytes}")
        # Over-map by one huge page so the buffer can start on a huge-page boundary.
        slack = HUGE_PAGE_BYTES if huge_pages and nbytes >= HUGE_PAGE_BYTES else 0
        length = max(nbytes + slack, PAGE_BYTES)
        try:
            mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise MemoryError(_no_room(nbytes)) from exc
        offset = 0
        if slack:
            base = _address(torch.frombuffer(mapping, dtype=torch.uint8, count=1))
            offset = -base % HUGE_PAGE_BYTES
        return cls(mapping, nbytes, offset=offset, shared=False, huge_pages=huge_pages, prefault=prefault,
                   reserve_bytes=reserve_bytes, window_bytes=window_bytes, quiet_s=quiet_s)

    @classmethod
    def shared(cls, path: str | os.PathLike[str], nbytes: int, *, create: bool = True,
               prefault: PrefaultMode = "background", huge_pages: bool = True,
               reserve_bytes: int | None = None, window_bytes: int = DEFAULT_WINDOW_BYTES,
               quiet_s: float = DEFAULT_QUIET_S) -> ResidentBuffer:
        """A named shared-memory file (e.g. ``/dev/shm/flowkv-arena``) of ``nbytes`` bytes, mapped shared.

        ``create`` makes the file (it must not exist yet) and sizes it; otherwise
        an existing file of at least ``nbytes`` bytes is mapped. The pages belong
        to the file: they stay resident for every process that maps it until
        the file is removed (`unlink`).
        """
        path = Path(path)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise ValueError(f"{path} holds {os.fstat(fd).st_size} B, fewer than the {nbytes} B asked for")
            mapping = mmap.mmap(fd, max(nbytes, PAGE_BYTES) if create else nbytes, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(mapping, nbytes, offset=0, shared=True, huge_pages=huge_pages, prefault=prefault,
                   reserve_bytes=reserve_bytes, path=path, window_bytes=window_bytes, quiet_s=quiet_s)

    @classmethod
    def memfd(cls, name: str, nbytes: int, *, prefault: PrefaultMode = "background", huge_pages: bool = True,
              reserve_bytes: int | None = None, window_bytes: int = DEFAULT_WINDOW_BYTES,
              quiet_s: float = DEFAULT_QUIET_S) -> ResidentBuffer:
        """Shared memory with no name in any folder (``memfd_create``), mapped shared: other processes map
        it through its descriptor (`fd`, passed over a Unix socket). Its pages live until the last process
        that maps it or holds a descriptor of it lets go; no file is left behind, whatever kills whom."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, max(nbytes, PAGE_BYTES), flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(mapping, nbytes, offset=0, shared=True, huge_pages=huge_pages, prefault=prefault,
                   reserve_bytes=reserve_bytes, fd=fd, window_bytes=window_bytes, quiet_s=quiet_s)

    # -- pre-faulting -------------------------------------------------------

    def prefault(self, mode: PrefaultMode) -> None:
        """Start pre-faulting (``"now"`` returns when all of the buffer is resident, ``"background"``
        at once); ``"off"`` does nothing. A pre-fault that already ran or runs is not started again."""
        if mode not in PREFAULT_MODES:
            raise ValueError(f"prefault must be one of {', '.join(PREFAULT_MODES)}; got {mode!r}")
        if mode == "off" or self._state != "off":
            return
        if mode == "now":
            self._state = "running"
            self._target = self.nbytes
            while self._resident < self._target and self._step():
                pass
            if self._resident >= self.nbytes:
                self._state = "done"
            return
        with self._cond:
            self._state = "pending"
            self._target = min(self.nbytes, self._frontier + self.window_bytes)
        self._thread = threading.Thread(target=self._refill, name="flowkv-prefault", daemon=True)
        self._thread.start()

    def note_allocated(self, end: int) -> None:
        """An arena handed out bytes up to offset ``end``: the window moves with the frontier.

        Cheap (the arena calls it on every allocation): it wakes the refill
        thread only when the window's end moved by a step or more.
        """
        self._last_activity = time.monotonic()
        if end <= self._frontier:
            return
        self._frontier = end
        target = min(self.nbytes, end + self.window_bytes)
        if self._thread is not None and target >= min(self.nbytes, self._target + _STEP_BYTES):
            with self._cond:
                self._target = max(self._target, target)
                self._cond.notify_all()

    def note_activity(self) -> None:
        """The engine is working (a step began or ended): the refill waits ``quiet_s`` from now."""
        self._last_activity = time.monotonic()

    def begin_busy(self) -> None:
        """The engine's work (a forward pass) begins: no refill step starts until `end_busy`."""
        with self._cond:
            self._busy += 1

    def end_busy(self) -> None:
        """The work `begin_busy` announced is over; the refill waits ``quiet_s`` from now."""
        with self._cond:
            self._busy = max(0, self._busy - 1)
            self._last_activity = time.monotonic()
            if self._thread is not None and self._resident < self._target:
                # Only a refill with work left waits for this; a full window sleeps on (no
                # thread woken per step of a decoding batch).
                self._cond.notify_all()

    @contextmanager
    def busy(self) -> Iterator[None]:
        """A section of the engine's work (`begin_busy` ... `end_busy`) the refill never competes with."""
        self.begin_busy()
        try:
            yield
        finally:
            self.end_busy()

    def _idle_in(self) -> float | None:
        """Seconds until the engine counts as idle (0: idle now); None while a busy section is open."""
        if self._busy:
            return None
        return max(0.0, self._last_activity + self.quiet_s - time.monotonic())

    def _refill(self) -> None:
        # The thread keeps the process's priority: one that waits for a core while it holds
        # the memory-map lock (one step) makes the engine's allocations wait too.
        try:
            while True:
                with self._cond:
                    while True:
                        if self._stop.is_set():
                            self._state = "stopped: asked to stop"
                            return
                        if self._resident >= self.nbytes:
                            self._state = "done"
                            return
                        if self._resident >= self._target:
                            self._state = "window full"
                            self._cond.notify_all()  # wait_resident
                            self._cond.wait()
                            continue
                        wait = self._idle_in()
                        if wait == 0:
                            break
                        self._state = "waiting for the engine to idle"
                        self._cond.wait(wait)
                    self._state = "running"
                if not self._step():
                    return
        finally:
            with self._cond:
                self._thread_done = True
                self._cond.notify_all()

    def _step(self) -> bool:
        """Make the next step of bytes resident; False (and `prefault_state` says why) when it must stop."""
        step = min(_STEP_BYTES, self.nbytes - self._resident)
        if self._resident >= self._checked_until:
            ahead = min(_CHECK_BYTES, self.nbytes - self._resident)
            available = available_memory()
            self._checked_until = self._resident + ahead
            if available is not None and available - ahead < self._reserve:
                self._state = (f"stopped: {self._resident} of {self.nbytes} B resident; going on would leave "
                               f"less than {self._reserve} B of memory available")
                log.warning("flowkv: pre-faulted %.1f of %.1f GiB of the memory arena and stopped: the rest "
                            "would leave under %.1f GiB available. The arena is larger than this machine's "
                            "free memory; filling it will run out of memory.", self._resident / 2**30,
                            self.nbytes / 2**30, self._reserve / 2**30)
                return False
        start = _address(self.tensor) + self._resident
        if self._want_huge:
            # Advised step by step, only where pre-faulted: a later first-touch fault in a
            # huge-page region may compact memory in the storing thread (defrag = madvise).
            self.huge_pages_advised |= self._madvise(start, step, mmap.MADV_HUGEPAGE)
        if not self._madvise(start, step, _MADV_POPULATE_WRITE):
            self._state = "stopped: the kernel cannot pre-fault (MADV_POPULATE_WRITE needs Linux 5.14)"
            return False
        self._resident += step
        return True

    def _madvise(self, address: int, length: int, advice: int) -> bool:
        # Page-align the start (the buffer's tail may share a page with nothing else: mappings are page-sized).
        aligned = address // PAGE_BYTES * PAGE_BYTES
        if _libc.madvise(aligned, length + address - aligned, advice) == 0:  # releases the GIL
            return True
        err = ctypes.get_errno()
        log.debug("flowkv: madvise(%d) failed: %s", advice, os.strerror(err))
        return False

    @property
    def resident_bytes(self) -> int:
        """Bytes from the start that the pre-fault made resident so far."""
        return self._resident

    @property
    def frontier_bytes(self) -> int:
        """The end of the highest bytes an arena handed out (`note_allocated`)."""
        return self._frontier

    @property
    def target_bytes(self) -> int:
        """Bytes from the start the pre-fault works towards: all for ``"now"``; for
        ``"background"`` the frontier plus the window (at most the buffer)."""
        return self._target

    @property
    def prefault_state(self) -> str:
        """``off`` (not asked), ``pending``, ``running``, ``waiting for the engine to idle``,
        ``window full`` (background: the window ahead of the frontier is resident), ``done``
        (all of the buffer is), or ``stopped: <why>``."""
        return self._state

    def _settled(self) -> bool:
        return (self._thread is None or self._state.startswith("stopped") or self._state == "done"
                or self._thread_done or self._resident >= self._target)

    def wait_resident(self, timeout: float | None = None) -> bool:
        """Wait until the pre-fault has nothing left to do for now: all resident (``"now"``, or
        a background window that covers the buffer), the window full, or stopped; False if
        ``timeout`` came first. (A background refill waits for the engine to idle.)"""
        with self._cond:
            return self._cond.wait_for(self._settled, timeout)

    def stop_soon(self) -> None:
        """Ask a background pre-fault to stop after its current step, without waiting."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def stop(self, timeout: float | None = None) -> None:
        """Stop a background pre-fault after its current step, and wait for it."""
        self.stop_soon()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def close(self) -> None:
        """Stop pre-faulting and drop this object's references to the mapping.

        The mapping itself is unmapped once no tensor views it any more (views
        handed out keep it alive). A `shared` file stays until `unlink`.
        """
        self.stop()
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._mapping = None

    def unlink(self) -> None:
        """Remove a `shared` buffer's file, or close a `memfd` buffer's descriptor (processes that map it
        keep their mapping)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __repr__(self) -> str:
        kind = f"shared {self.path or 'memfd'}" if self.shared else "anonymous"
        return (f"<ResidentBuffer {kind} {self.nbytes} B, {self._resident} B pre-faulted ({self._state})"
                f"{', huge pages advised' if self.huge_pages_advised else ''}>")
