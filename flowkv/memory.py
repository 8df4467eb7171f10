"""Host memory for chunks: a page arena and reference-counted `MemoryObj`s.

::

    MemoryArena.buffer (one uint8 tensor, pinned on CUDA machines when asked)
    +----------------+--+--------+----------------+----+--------------+
    | full chunk     |p | lz4    | full chunk     |free| ...          |   page_bytes units
    +----------------+--+--------+----------------+----+--------------+
      MemoryObj       MemoryObj   MemoryObj

Every object takes one contiguous run of pages, as many as its bytes need
(a full raw chunk, a partial chunk, an encoded payload: each only what it
uses), so compression and partial chunks make room for more entries.
``slab_bytes`` bounds the largest object: a full chunk and a margin for an
encoding that came out larger than the raw bytes. Pages default to 4 KiB.
Free runs are coalesced when freed; allocation takes the first free run that
fits (the same-sized full chunks of a steady workload reuse each other's
runs), never waits, and answers ``None`` when no run is long enough.

Ownership: `MemoryArena.allocate` returns an object with ``ref_count == 1``
held by the caller; the pages return to the arena when the count reaches 0.
The memory tier (keys, LRU eviction, pins) is `flowkv.tiers.memory.MemoryTier`.

Example::

    >>> import torch
    >>> arena = MemoryArena(parse_size("1MiB"), slab_bytes=64 * 1024)
    >>> obj = arena.allocate((4, 256), torch.float16)
    >>> obj.tensor.shape
    torch.Size([4, 256])
    >>> obj.ref_down()                   # the last reference: the pages go back
"""

from __future__ import annotations

import bisect
import contextlib
import math
import threading
import weakref
from typing import Any

import torch

from flowkv.resident import DEFAULT_WINDOW_BYTES, PrefaultMode, ResidentBuffer
from flowkv.sizes import parse_size

__all__ = [
    "MemoryArena",
    "MemoryObj",
    "parse_size",
]


# --------------------------------------------------------------------------
# Arena and objects
# --------------------------------------------------------------------------

# Pages are aligned so that a view of any dtype (up to complex128) is legal
# and starts on a cache line.
_ALIGN = 64
# The default unit of allocation: it divides the full chunks of common KV
# shapes exactly, and a payload wastes less than one page.
_DEFAULT_PAGE = 4096


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class MemoryObj:
    """One object in a `MemoryArena`: a tensor view onto its pages plus reference and pin counts.

    ``ref_count`` starts at 1, owned by whoever allocated it; the pages go
    back to the arena when `ref_down` brings it to 0, after which `tensor`
    raises. ``meta`` holds facts about the content, e.g. ``{"codec": "lz4",
    "encoded_len": 12345}`` when the object holds an encoded payload.
    """

    __slots__ = ("_arena", "_first_page", "_pages", "_tensor", "nbytes", "ref_count", "pin_count", "meta")

    def __init__(self, arena: MemoryArena, first_page: int, pages: int, tensor: torch.Tensor, nbytes: int) -> None:
        self._arena = arena
        self._first_page = first_page
        self._pages = pages
        self._tensor: torch.Tensor | None = tensor
        #: bytes the object uses of its pages
        self.nbytes = nbytes
        #: holders of a reference (allocator's caller, the tier, readers)
        self.ref_count = 1
        #: holders of a pin (lookup owners in the tier)
        self.pin_count = 0
        #: content facts: codec, encoded length, ...
        self.meta: dict[str, Any] = {}

    @property
    def arena(self) -> MemoryArena:
        """The arena that owns this object's pages."""
        return self._arena

    @property
    def held_bytes(self) -> int:
        """Bytes of arena pages this object takes (what a tenant's quota counts)."""
        return self._pages * self._arena.page_bytes

    @property
    def freed(self) -> bool:
        """True once the pages went back to the arena."""
        return self._tensor is None

    @property
    def tensor(self) -> torch.Tensor:
        """The view of the requested shape and dtype onto the pages."""
        tensor = self._tensor
        if tensor is None:
            raise RuntimeError("MemoryObj used after its last reference was dropped")
        return tensor

    def view_bytes(self) -> memoryview:
        """A writable ``memoryview`` of the object's bytes (CPU arenas only).

        For an object from `MemoryArena.allocate_bytes` this is exactly the
        payload; write into it with ``obj.view_bytes()[:] = payload``.
        """
        tensor = self.tensor
        if tensor.device.type != "cpu":
            raise RuntimeError(f"view_bytes needs a CPU arena, this one is on {tensor.device}")
        # The pages themselves, whatever the order of the tensor's view (a reshape of a
        # permuted view would be a copy, and writes into it would be lost).
        start = self._first_page * self._arena.page_bytes
        return memoryview(self._arena.buffer[start:start + self.nbytes].numpy()).cast("B")

    def shrink_to_bytes(self, nbytes: int) -> None:
        """Keep only the first ``nbytes`` bytes, as a flat uint8 `tensor`, and give
        the pages past them back to the arena.

        For an object whose contents were just replaced by a shorter encoding
        (a compressed chunk): only its sole holder may shrink it, since any
        other view of the old shape would reach into pages given back.
        """
        with self._arena._lock:
            if self._tensor is None:
                raise RuntimeError("shrink_to_bytes on a MemoryObj that was already freed")
            if self.ref_count != 1 or self.pin_count:
                raise RuntimeError(f"shrink_to_bytes needs the only reference and no pin ({self!r})")
            if not 0 <= nbytes <= self.nbytes:
                raise ValueError(f"cannot shrink an object of {self.nbytes} B to {nbytes} B")
            pages = max(1, -(-nbytes // self._arena.page_bytes))
            if pages < self._pages:
                self._arena._release(self._first_page + pages, self._pages - pages)
                self._pages = pages
            start = self._first_page * self._arena.page_bytes
            self._tensor = self._arena.buffer[start:start + nbytes]
            self.nbytes = nbytes

    def ref_up(self) -> None:
        """Take one more reference."""
        with self._arena._lock:
            if self._tensor is None:
                raise RuntimeError("ref_up on a MemoryObj that was already freed")
            self.ref_count += 1

    def ref_down(self) -> None:
        """Drop one reference; the last one frees the pages."""
        with self._arena._lock:
            if self.ref_count <= 0:
                raise RuntimeError("ref_down on a MemoryObj with no references left")
            self.ref_count -= 1
            if self.ref_count == 0:
                self._tensor = None
                self._arena._release(self._first_page, self._pages)

    def pin(self) -> None:
        """Count one more pin (the tier pins on behalf of lookup owners)."""
        with self._arena._lock:
            self.pin_count += 1

    def unpin(self) -> None:
        """Drop one pin."""
        with self._arena._lock:
            if self.pin_count <= 0:
                raise RuntimeError("unpin on a MemoryObj that is not pinned")
            self.pin_count -= 1

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"refs={self.ref_count} pins={self.pin_count}"
        return f"<MemoryObj pages={self._first_page}+{self._pages} nbytes={self.nbytes} {state} meta={self.meta}>"


class MemoryArena:
    """A pre-allocated buffer handed out in contiguous runs of pages, one run per `MemoryObj`.

    ``slab_bytes`` is the largest object (one full chunk and its margin),
    rounded up to a multiple of 64. ``page_bytes``, the unit of allocation,
    defaults to 4 KiB (a multiple of 64, at most one slab).
    ``pin_memory`` pins the buffer when CUDA is available (``pinned`` says
    whether it is). Allocation never waits: when no free run is long enough
    it answers ``None``.

    A CPU arena that is not pinned lives in a `flowkv.resident.ResidentBuffer`
    (``backing``, or a new anonymous one): ``prefault`` (``"background"``,
    ``"now"``, ``"off"``) makes its pages resident before stores write them,
    so a fresh arena does not make stores pay first-touch page faults
    (background: a window of ``prefault_window`` bytes ahead of the highest
    page handed out, refilled while the engine is idle — see `busy`);
    ``huge_pages`` asks for transparent huge pages where the OS offers them.
    `resident_bytes` and `prefault_state` say how far that got. (Pinned
    memory is resident already; a GPU arena is the device's.)
    """

    def __init__(self, capacity_bytes: int | str, *, slab_bytes: int | str, page_bytes: int | str | None = None,
                 pin_memory: bool = False, device: str | torch.device = "cpu",
                 prefault: PrefaultMode = "background", huge_pages: bool = True,
                 backing: ResidentBuffer | None = None, prefault_window: int | str | None = None) -> None:
        capacity = parse_size(capacity_bytes)
        slab = parse_size(slab_bytes)
        if slab <= 0:
            raise ValueError(f"slab_bytes must be positive, got {slab_bytes!r}")
        slab = _round_up(slab, _ALIGN)
        page = parse_size(page_bytes) if page_bytes is not None else _DEFAULT_PAGE
        if page_bytes is not None and page <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes!r}")
        page = min(_round_up(max(page, _ALIGN), _ALIGN), slab)
        num_pages = capacity // page
        if num_pages * page < slab:
            raise ValueError(f"capacity {capacity} B holds no slab of {slab} B")
        self.device = torch.device(device)
        #: whether the buffer is page-locked (fast, async host<->GPU copies)
        self.pinned = bool(pin_memory and self.device.type == "cpu" and torch.cuda.is_available())
        #: the largest object in bytes
        self.slab_bytes = slab
        #: the unit of allocation in bytes
        self.page_bytes = page
        #: pages in the arena
        self.num_pages = num_pages
        #: pages the largest object takes
        self.pages_per_slab = -(-slab // page)
        #: where the buffer's pages come from (None: pinned or device memory, resident by nature)
        self.backing: ResidentBuffer | None = None
        if backing is not None:
            if self.device.type != "cpu" or self.pinned:
                raise ValueError("a backing buffer is CPU memory: it cannot back a pinned or device arena")
            if backing.nbytes < num_pages * page:
                raise ValueError(f"backing buffer of {backing.nbytes} B is smaller than the arena's "
                                 f"{num_pages * page} B")
            self.backing = backing
        elif self.device.type == "cpu" and not self.pinned:
            window = DEFAULT_WINDOW_BYTES if prefault_window is None else parse_size(prefault_window)
            self.backing = ResidentBuffer.anonymous(num_pages * page, prefault=prefault, huge_pages=huge_pages,
                                                    window_bytes=window)
        #: the one backing buffer
        if self.backing is not None:
            self.buffer = self.backing.tensor[: num_pages * page]
            # An arena dropped while its pages are still being pre-faulted stops that.
            weakref.finalize(self, self.backing.stop_soon)
        else:
            self.buffer = torch.empty(num_pages * page, dtype=torch.uint8, device=self.device,
                                      pin_memory=self.pinned)
        # Free runs: first page -> length, the first pages sorted, and last
        # page + 1 -> first page, to coalesce a freed run with both neighbours.
        self._run_length: dict[int, int] = {0: num_pages}
        self._run_starts: list[int] = [0]
        self._run_ends: dict[int, int] = {num_pages: 0}
        self._free_pages = num_pages
        # Guards the free runs and every object's counts; never held across a copy.
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        """Bytes the arena can hand out (all pages)."""
        return self.num_pages * self.page_bytes

    @property
    def resident_bytes(self) -> int:
        """Bytes from the start of the arena made resident before use: all of a pinned or
        device arena; as far as the pre-fault got for one in a `ResidentBuffer`."""
        if self.backing is None:
            return self.capacity_bytes
        return min(self.backing.resident_bytes, self.capacity_bytes)

    @property
    def prefault_state(self) -> str:
        """The pre-fault's state (see `flowkv.resident.ResidentBuffer.prefault_state`); ``resident``
        for pinned or device memory."""
        return "resident" if self.backing is None else self.backing.prefault_state

    def wait_resident(self, timeout: float | None = None) -> bool:
        """Wait until the pre-fault is over (done, or stopped at the memory reserve); False on timeout."""
        return True if self.backing is None else self.backing.wait_resident(timeout)

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """A section of the engine's work (a forward pass) that the pre-fault's refill keeps off."""
        return contextlib.nullcontext() if self.backing is None else self.backing.busy()

    def begin_busy(self) -> None:
        """The engine's work begins (see `flowkv.resident.ResidentBuffer.begin_busy`)."""
        if self.backing is not None:
            self.backing.begin_busy()

    def end_busy(self) -> None:
        """The work `begin_busy` announced is over."""
        if self.backing is not None:
            self.backing.end_busy()

    @property
    def num_slabs(self) -> int:
        """Largest objects the empty arena holds."""
        return self.num_pages // self.pages_per_slab

    @property
    def free_slabs(self) -> int:
        """Largest objects that fit in the free runs now."""
        with self._lock:
            return sum(length // self.pages_per_slab for length in self._run_length.values())

    @property
    def free_bytes(self) -> int:
        """Bytes of pages not in use (free runs may be too short for a large object)."""
        return self._free_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of pages in use (whole pages, however little of the last is filled)."""
        return (self.num_pages - self._free_pages) * self.page_bytes

    @property
    def free_runs(self) -> int:
        """Separate runs of free pages: 1 for an empty arena; more means fragmented."""
        return len(self._run_starts)

    def cost(self, nbytes: int) -> int:
        """Bytes of pages an object of ``nbytes`` takes."""
        return max(1, -(-int(nbytes) // self.page_bytes)) * self.page_bytes

    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> MemoryObj | None:
        """An object whose `MemoryObj.tensor` has ``shape`` and ``dtype``, or ``None`` when full.

        A ``shape`` with a ``dim_order`` (a `flowkv.kernels.ChunkShape`) lays the
        bytes out in that order, outermost dim first, and the tensor is the
        (strided) view of them in ``shape``'s order.

        Raises `ValueError` when the object could never fit a slab: that is a
        configuration error, not memory pressure.
        """
        order = getattr(shape, "dim_order", None)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        nbytes = math.prod(shape) * dtype.itemsize  # no tensor made per allocation
        if nbytes > self.slab_bytes:
            raise ValueError(f"object of {nbytes} B does not fit a slab of {self.slab_bytes} B; "
                             "raise slab_bytes to at least one full chunk")
        pages = max(1, -(-nbytes // self.page_bytes))
        first = self._take_run(pages)
        if first is None:
            return None
        if self.backing is not None:  # the pre-fault's window moves with the highest page handed out
            self.backing.note_allocated((first + pages) * self.page_bytes)
        start = first * self.page_bytes
        data = self.buffer[start:start + nbytes].view(dtype)
        if order is None or tuple(order) == tuple(range(len(shape))):
            tensor = data.view(shape)
        else:
            tensor = data.view(tuple(shape[d] for d in order)).permute(tuple(order.index(d) for d in range(len(shape))))
        return MemoryObj(self, first, pages, tensor, nbytes)

    def allocate_bytes(self, nbytes: int) -> MemoryObj | None:
        """An object for an encoded payload of ``nbytes`` bytes, or ``None`` when full.

        ``meta["encoded_len"]`` is set to ``nbytes``; fill it through
        `MemoryObj.view_bytes`.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        obj = self.allocate((nbytes,), torch.uint8)
        if obj is not None:
            obj.meta["encoded_len"] = nbytes
        return obj

    def _take_run(self, pages: int) -> int | None:
        """The first page of ``pages`` free pages, taken from the first free run long enough."""
        with self._lock:
            if pages > self._free_pages:
                return None
            for index, first in enumerate(self._run_starts):
                length = self._run_length[first]
                if length < pages:
                    continue
                del self._run_length[first], self._run_ends[first + length]
                if length == pages:
                    del self._run_starts[index]
                else:
                    rest = first + pages
                    self._run_starts[index] = rest  # still sorted: rest < the next run's first page
                    self._run_length[rest] = length - pages
                    self._run_ends[first + length] = rest
                self._free_pages -= pages
                return first
            return None

    def _release(self, first: int, pages: int) -> None:
        # Called with self._lock held, by MemoryObj.ref_down.
        self._free_pages += pages
        end = first + pages
        before = self._run_ends.pop(first, None)  # a free run ending where this one starts
        if before is not None:
            del self._run_starts[bisect.bisect_left(self._run_starts, before)]
            pages += self._run_length.pop(before)
            first = before
        after = self._run_length.pop(end, None)  # a free run starting where this one ends
        if after is not None:
            del self._run_starts[bisect.bisect_left(self._run_starts, end)]
            del self._run_ends[end + after]
            pages += after
        bisect.insort(self._run_starts, first)
        self._run_length[first] = pages
        self._run_ends[first + pages] = first

    def __repr__(self) -> str:
        return (f"<MemoryArena {self.num_pages} x {self.page_bytes} B pages ({self.num_slabs} slabs of "
                f"{self.slab_bytes} B) on {self.device}{' pinned' if self.pinned else ''}, "
                f"{self.free_bytes} B free in {self.free_runs} runs>")
