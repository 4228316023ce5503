"""The CUDA caching allocator, replayed on an alloc/free stream: reserved bytes and segments.

Written from ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch; read at @001074d, see
shared/reference/memory-facts.md section 3, and the current ``find_expandable_block``), cited by
function name (line numbers move), with the constants of the torch 2.13 wheel's
``include/c10/core/AllocatorConfig.h`` (``kMinBlockSize``, ``kSmallSize``, ``kSmallBuffer``,
``kMinLargeAlloc``, ``kRoundLarge``; ``kLargeBuffer`` in the .cpp):

* ``round_size``: every request is a multiple of ``kMinBlockSize`` = 512 bytes, at least 512
  (``roundup_power2_divisions`` unset, the default);
* ``get_pool``: requests up to ``kSmallSize`` = 1 MiB go to the small pool, the rest to the
  large one; blocks never move between pools (one stream here);
* ``get_allocation_size``: a new segment (``cudaMalloc``) is ``kSmallBuffer`` = 2 MiB for the
  small pool, ``kLargeBuffer`` = 20 MiB for requests under ``kMinLargeAlloc`` = 10 MiB, else
  the request rounded up to ``kRoundLarge`` = 2 MiB;
* ``get_free_block``: best fit, the smallest cached block of the pool at least as large
  (ties: the lowest address); with ``max_split_size`` a request below it does not take a block
  at or above it, and a request at or above it does not take a block ``kLargeBuffer`` or more
  larger;
* ``should_split``: what is left after the request becomes a free block when the small pool
  (or expandable segments) leaves at least 512 bytes, or the large pool leaves more than
  ``kSmallSize`` and the request is below ``max_split_size``; else the whole block is handed
  out, and ``allocated_bytes`` counts all of it (``alloc_found_block`` adds ``block->size``);
* ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its
  segment; segments are kept (no ``empty_cache``), so reserved memory only grows;
* ``expandable_segments``: one segment per pool that grows by mapping pages of
  ``kSmallBuffer`` (small pool) or ``kLargeBuffer`` (large pool): ``find_expandable_block``
  extends the free block at the end of the mapped range (``try_allocate_expandable_block``,
  ``map_block``).

* ``garbage_collection_threshold`` (with ``allowed_bytes``: PyTorch runs it only under
  ``torch.cuda.set_per_process_memory_fraction``, ``set_fraction`` in ``DeviceCachingAllocator::
  malloc`` and ``get_free_block``): every ``get_free_block`` call counts one per pool, a free
  block's age is the count since it entered the pool (``BlockPool::insert_into_blocks``,
  ``Block::gc_count``); when no cached block fits, ``garbage_collect_cached_blocks`` runs before
  a new segment: if the reserved bytes exceed threshold x allowed, it releases (``release_block``)
  whole free segments of the large pool whose age is at least the average age, pass after
  pass, until it has reclaimed the excess or frees nothing;
* ``allowed_bytes`` (the memory fraction x the device's total): ``alloc_block`` refuses a segment
  that would pass it; ``malloc`` then releases every whole free segment (``release_cached_blocks``,
  ``release_blocks``) and tries once more, else raises `AllocatorOutOfMemory`.

Not modelled: ``roundup_power2_divisions``, streams other than one, ``empty_cache``, and
``release_available_cached_blocks`` (frees oversize blocks first under ``max_split_size_mb`` and
a memory cap); with expandable segments the cap and the collection are not applied (their
segments are unmapped page by page, ``unmap_block``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20
_GAP = 1 << 50  # address distance between segments: blocks of two segments never touch


@dataclass(frozen=True, slots=True)
class AllocatorConfig:
    """``PYTORCH_CUDA_ALLOC_CONF`` settings the replay follows (defaults: torch 2.13's)."""

    expandable_segments: bool = False
    """``expandable_segments:True``."""
    max_split_size_bytes: int | None = None
    """``max_split_size_mb`` in bytes, or None (unlimited, the default)."""
    garbage_collection_threshold: float | None = None
    """``garbage_collection_threshold`` in (0, 1), or None (off, the default); needs
    ``allowed_bytes``, as PyTorch collects only under a memory fraction."""
    allowed_bytes: int | None = None
    """``torch.cuda.set_per_process_memory_fraction(f)``: f x the device's total
    (``allowed_memory_maximum``), or None (no cap, the default)."""

    def __post_init__(self) -> None:
        m = self.max_split_size_bytes
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m <= K_SMALL_SIZE):
            raise ValueError(f"max_split_size_bytes={m!r} must be None or an int above 1 MiB")
        a = self.allowed_bytes
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a <= 0):
            raise ValueError(f"allowed_bytes={a!r} must be None or a positive int")
        t = self.garbage_collection_threshold
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, int | float) or not 0.0 < t < 1.0
        ):
            raise ValueError(f"garbage_collection_threshold={t!r} must be None or in (0, 1)")
        if t is not None and a is None:
            raise ValueError(
                "garbage_collection_threshold needs allowed_bytes (PyTorch collects only under "
                "set_per_process_memory_fraction)"
            )


class AllocatorOutOfMemory(MemoryError):
    """A request the replay cannot place under ``AllocatorConfig.allowed_bytes`` (PyTorch's
    ``OutOfMemoryError``)."""


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """What the replay ends with (``torch.cuda.memory_stats`` names)."""

    reserved_bytes: int
    """Peak reserved (``max_memory_reserved``): segments or mapped pages; never released."""
    allocated_bytes: int
    """Peak allocated (``max_memory_allocated``): block sizes, unsplit tails included."""
    requested_bytes: int
    """Peak of the rounded requests (what calc's peak counts)."""
    segments: int
    """Segments created (``cudaMalloc`` calls); with expandable segments, one per pool used."""

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved bytes never covered by the peak allocation: ``reserved - allocated``."""
        return self.reserved_bytes - self.allocated_bytes


@dataclass(slots=True)
class _Block:
    addr: int
    size: int
    small: bool
    gc_base: int = 0  # the pool's get_free_block count when the block entered the pool


def round_size(nbytes: int) -> int:
    """``round_size``: a multiple of 512 bytes, at least 512."""
    return K_MIN_BLOCK if nbytes < K_MIN_BLOCK else -(-nbytes // K_MIN_BLOCK) * K_MIN_BLOCK


def allocation_size(nbytes: int) -> int:
    """``get_allocation_size``: the segment a request of ``nbytes`` (rounded) makes."""
    if nbytes <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if nbytes < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-nbytes // K_ROUND_LARGE) * K_ROUND_LARGE


class CachingAllocator:
    """One device, one stream: `malloc` and `free` by the caller's ids."""

    def __init__(self, config: AllocatorConfig | None = None) -> None:
        self.config = config or AllocatorConfig()
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # (size, addr)
        self._by_start: dict[int, _Block] = {}  # free blocks by address
        self._by_end: dict[int, _Block] = {}  # free blocks by end address
        self._live: dict[object, tuple[_Block, int]] = {}  # key -> (block, rounded request)
        self._next_addr = _GAP
        self._mapped_end: dict[bool, int] = {}  # expandable: per pool, end of the mapped range
        self.reserved = self.allocated = self.requested = 0
        self.peak_reserved = self.peak_allocated = self.peak_requested = 0
        self.segments = 0
        self._segment_size: dict[int, int] = {}  # cudaMalloc segments: start -> size
        self._calls = {True: 0, False: 0}  # get_free_block calls per pool (collection on)
        self._collect = self.config.garbage_collection_threshold is not None

    # -- free lists ---------------------------------------------------------------------------
    def _insert_free(self, b: _Block) -> None:
        b.gc_base = self._calls[b.small]
        bisect.insort(self._free[b.small], (b.size, b.addr))
        self._by_start[b.addr] = b
        self._by_end[b.addr + b.size] = b

    def _remove_free(self, b: _Block) -> None:
        lst = self._free[b.small]
        del lst[bisect.bisect_left(lst, (b.size, b.addr))]
        del self._by_start[b.addr]
        del self._by_end[b.addr + b.size]

    def _best_fit(self, small: bool, size: int) -> _Block | None:
        if self._collect:  # get_free_block: counts its calls while collection is on
            self._calls[small] += 1
        lst = self._free[small]
        i = bisect.bisect_left(lst, (size, -1))
        if i == len(lst):
            return None
        found, addr = lst[i]
        cap = self.config.max_split_size_bytes
        if cap is not None:
            if size < cap <= found:
                return None
            if size >= cap and found >= size + K_LARGE_BUFFER:
                return None
        return self._by_start[addr]

    # -- new memory ---------------------------------------------------------------------------
    def _new_segment(self, small: bool, size: int) -> _Block:
        seg = allocation_size(size)
        cap = self.config.allowed_bytes
        if cap is not None and self.reserved + seg > cap:  # alloc_block refuses, then
            self._release_whole(small=None)  # release_cached_blocks, and one more try
            if self.reserved + seg > cap:
                raise AllocatorOutOfMemory(
                    f"{size:,} B: {self.reserved:,} B reserved + a {seg:,} B segment > "
                    f"allowed {cap:,} B"
                )
        b = _Block(self._next_addr, seg, small)
        self._segment_size[b.addr] = seg
        self._next_addr += seg + _GAP
        self.segments += 1
        self.reserved += seg
        return b

    def _whole(self, b: _Block) -> bool:
        """Not split: the free block is its whole segment (``!block->is_split()``)."""
        return self._segment_size.get(b.addr) == b.size

    def _release(self, b: _Block) -> None:
        """``release_block``: the free whole segment goes back to CUDA."""
        self._remove_free(b)
        del self._segment_size[b.addr]
        self.reserved -= b.size

    def _release_whole(self, small: bool | None) -> None:
        """``release_blocks`` of one pool (``small``) or both (None)."""
        for pool in (True, False) if small is None else (small,):
            for _size, addr in list(self._free[pool]):
                b = self._by_start[addr]
                if self._whole(b):
                    self._release(b)

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: whole free segments of the large pool, oldest
        (at least the average age) first, until the reserve is back under the threshold."""
        threshold = self.config.garbage_collection_threshold
        cap = self.config.allowed_bytes
        assert threshold is not None and cap is not None
        limit = int(threshold * cap)
        if self.reserved <= limit:
            return
        target, reclaimed = self.reserved - limit, 0
        count = self._calls[False]
        ages = {a: count - self._by_start[a].gc_base for _s, a in self._free[False]
                if self._whole(self._by_start[a])}  # fmt: skip
        freed = True
        while reclaimed < target and freed and ages:
            average = sum(ages.values()) / len(ages)
            freed = False
            for _size, addr in list(self._free[False]):  # by size, then address
                if addr in ages and ages[addr] >= average:
                    freed = True
                    reclaimed += self._by_start[addr].size
                    del ages[addr]
                    self._release(self._by_start[addr])

    def _expand(self, small: bool, size: int) -> _Block:
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        end = self._mapped_end.get(small)
        if end is None:  # a new expandable segment for this pool
            end = self._next_addr
            self._next_addr += _GAP
            self.segments += 1
        tail = self._by_end.get(end)
        start = end
        if tail is not None and tail.small == small:
            self._remove_free(tail)
            start = tail.addr
        new_end = end + -(-(start + size - end) // page) * page
        self.reserved += new_end - end
        self._mapped_end[small] = new_end
        return _Block(start, new_end - start, small)

    def _should_split(self, b: _Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.config.expandable_segments:
            return remaining >= K_MIN_BLOCK
        cap = self.config.max_split_size_bytes
        return (cap is None or size < cap) and remaining > K_SMALL_SIZE

    # -- the API ------------------------------------------------------------------------------
    def malloc(self, key: object, nbytes: int) -> None:
        """Allocate ``nbytes`` for the caller's ``key`` (``DeviceCachingAllocator::malloc``)."""
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        b = self._best_fit(small, size)
        if b is not None:
            self._remove_free(b)
        elif self.config.expandable_segments:
            b = self._expand(small, size)
        else:
            if self._collect:
                self._garbage_collect()
            b = self._new_segment(small, size)
        if self._should_split(b, size):
            self._insert_free(_Block(b.addr + size, b.size - size, small))
            b.size = size
        self._live[key] = (b, size)
        self.allocated += b.size
        self.requested += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, key: object) -> None:
        """Free ``key``'s block (``free_block``), merging it with free neighbours."""
        b, size = self._live.pop(key)
        self.allocated -= b.size
        self.requested -= size
        prev = self._by_end.get(b.addr)
        if prev is not None and prev.small == b.small:
            self._remove_free(prev)
            b = _Block(prev.addr, prev.size + b.size, b.small)
        nxt = self._by_start.get(b.addr + b.size)
        if nxt is not None and nxt.small == b.small:
            self._remove_free(nxt)
            b = _Block(b.addr, b.size + nxt.size, b.small)
        self._insert_free(b)

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            reserved_bytes=self.peak_reserved,
            allocated_bytes=self.peak_allocated,
            requested_bytes=self.peak_requested,
            segments=self.segments,
        )


def replay(
    stream: Iterable[tuple[bool, object, int]], config: AllocatorConfig | None = None
) -> AllocatorStats:
    """Run ``(is_alloc, key, nbytes)`` events through `CachingAllocator`."""
    alloc = CachingAllocator(config)
    for is_alloc, key, nbytes in stream:
        if is_alloc:
            alloc.malloc(key, nbytes)
        else:
            alloc.free(key)
    return alloc.stats()
