"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, default settings), replaying
an ordered trace of allocations and frees to predict ``max_memory_allocated`` and ``max_memory_reserved``.

Default mode: sizes round up to 512 B; requests <= 1 MiB use the small pool, carved from 2 MiB segments; larger
ones the large pool, where a request under 10 MiB gets a 20 MiB segment and a bigger one a segment rounded up to
2 MiB. The smallest free block that fits wins (ties: lowest address); a block splits when the remainder is
>= 512 B (small pool) or > 1 MiB (large pool); freed blocks merge with free neighbours of their segment; segments
are never released. ``expandable_segments``: one segment per pool that grows in place by 2 MiB (small) or
20 MiB (large) pages as needed. Where the driver places a new segment decides best-fit ties between equal-size
free blocks: :data:`PLACEMENT` (fitted on measured T4 runs, see benchmarks/preflight_accuracy.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

KB, MB = 1024, 1024 * 1024
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MB  # kSmallSize: largest "small" request
SMALL_BUFFER = 2 * MB  # kSmallBuffer: small-pool segment
LARGE_BUFFER = 20 * MB  # kLargeBuffer: segment for 1-10 MiB requests
MIN_LARGE_ALLOC = 10 * MB  # kMinLargeAlloc
ROUND_LARGE = 2 * MB  # kRoundLarge
# Where the driver maps a new segment relative to earlier ones: "ascending" (each new segment above the last) or
# "descending" (below). It decides best-fit ties between equal-size free blocks; chosen on the T4 archive's fit rows
# (docs/preflight.md, "How each band was measured").
PLACEMENT = "descending"


def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(size: int) -> int:
    """cudaMalloc size for a (rounded) request that no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


@dataclass
class Block:
    addr: int
    size: int
    small: bool
    seg: int
    free: bool = True
    prev: Block | None = None
    next: Block | None = None


@dataclass
class Replay:
    peak_allocated: int
    peak_reserved: int
    allocated: int  # at the end
    reserved: int
    segments: int


class CachingAllocator:
    """The allocator's block bookkeeping: ``malloc(size) -> handle``, ``free(handle)``; byte counters as torch's
    ``memory_stats`` keeps them (allocated counts whole blocks, reserved counts segments)."""

    def __init__(self, *, expandable: bool = False, placement: str = PLACEMENT):
        self.expandable = expandable
        self.placement = placement
        self.pools: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # sorted (size, addr, id)
        self.blocks: dict[int, Block] = {}  # id -> block (free ones are in pools)
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.segments = 0
        self._next_addr = 1 << 44
        self._tail: dict[bool, Block | None] = {True: None, False: None}  # expandable: last block per pool

    # -- pools
    def _insert(self, b: Block) -> None:
        b.free = True
        bisect.insort(self.pools[b.small], (b.size, b.addr, id(b)))
        self.blocks[id(b)] = b

    def _remove(self, b: Block) -> None:
        pool = self.pools[b.small]
        i = bisect.bisect_left(pool, (b.size, b.addr, id(b)))
        del pool[i]

    def _best_fit(self, size: int, small: bool) -> Block | None:
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        return self.blocks[pool[i][2]] if i < len(pool) else None

    def _new_segment(self, size: int, small: bool) -> Block:
        seg = segment_size(size)
        if self.placement == "descending":
            self._next_addr -= seg
            addr = self._next_addr
        else:
            addr = self._next_addr
            self._next_addr += seg
        self.segments += 1
        self.reserved += seg
        return Block(addr, seg, small, self.segments)

    def _grow(self, size: int, small: bool) -> Block:
        """expandable_segments: map pages at the end of the pool's one segment until ``size`` fits there."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self._tail[small]
        have = tail.size if tail is not None and tail.free else 0
        need = -(-(size - have) // page) * page
        self.reserved += need
        if tail is not None and tail.free:
            self._remove(tail)
            tail.size += need
            return tail
        base = (tail.addr + tail.size) if tail is not None else (1 << 46 if small else 1 << 45)
        b = Block(base, need, small, 0 if small else 1, prev=tail)
        if tail is not None:
            tail.next = b
        self._tail[small] = b
        return b

    # -- public
    def malloc(self, nbytes: int) -> int:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        b = self._best_fit(size, small)
        if b is not None:
            self._remove(b)
        elif self.expandable:
            b = self._grow(size, small)
        else:
            b = self._new_segment(size, small)
        rest = b.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            r = Block(b.addr + size, rest, small, b.seg, prev=b, next=b.next)
            if b.next is not None:
                b.next.prev = r
            b.next = r
            b.size = size
            if self._tail[small] is b:
                self._tail[small] = r
            self._insert(r)
        b.free = False
        self.blocks[id(b)] = b
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return id(b)

    def free(self, handle: int) -> None:
        b = self.blocks[handle]
        self.allocated -= b.size
        for nb in (b.prev, b.next):
            if nb is not None and nb.free:
                self._remove(nb)
                del self.blocks[id(nb)]
                if nb is b.prev:
                    b.addr, b.prev = nb.addr, nb.prev
                    if nb.prev is not None:
                        nb.prev.next = b
                else:
                    b.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = b
                    if self._tail[b.small] is nb:
                        self._tail[b.small] = b
                b.size += nb.size
        del self.blocks[handle]
        self._insert(b)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): every cached segment with no block in use goes back to the driver (expandable
        mode: the free pages at the end of each pool's segment are unmapped)."""
        for small in (True, False):
            for _, _, bid in list(self.pools[small]):
                b = self.blocks[bid]
                if b.prev is None and b.next is None and (not self.expandable or self._tail[small] is b):
                    self._remove(b)
                    del self.blocks[bid]
                    self.reserved -= b.size
                    if self._tail[small] is b:
                        self._tail[small] = None
                elif self.expandable and self._tail[small] is b:  # unmap whole pages past the last used block
                    page = SMALL_BUFFER if small else LARGE_BUFFER
                    cut = b.size // page * page
                    if cut:
                        self._remove(b)
                        b.size -= cut
                        self.reserved -= cut
                        if b.size:
                            self._insert(b)
                        else:
                            del self.blocks[bid]
                            self._tail[small] = b.prev
                            if b.prev is not None:
                                b.prev.next = None

    def reset_peaks(self) -> None:
        """torch.cuda.reset_peak_memory_stats(): peaks restart from the current figures."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


def replay(events: Iterable, *, start: int = 0, expandable: bool = False, placement: str = PLACEMENT) -> Replay:
    """Replay ordered events (objects with ``kind`` alloc/free, ``sid``, ``size``); peaks from event ``start``
    on (the measured step: ``reset_peak_memory_stats`` after the warm-up). Zero-byte allocations take no block,
    as in torch."""
    a = CachingAllocator(expandable=expandable, placement=placement)
    handles: dict[int, int] = {}
    events = list(events)
    for i, e in enumerate(events):
        if i == start:
            a.reset_peaks()
        if e.kind == "empty_cache":
            a.empty_cache()
            continue
        if e.size == 0:
            continue
        if e.kind == "alloc":
            handles[e.sid] = a.malloc(e.size)
        elif e.sid in handles:
            a.free(handles.pop(e.sid))
    if start >= len(events):
        a.reset_peaks()
    return Replay(a.peak_allocated, a.peak_reserved, a.allocated, a.reserved, a.segments)
