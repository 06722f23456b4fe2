"""A model of PyTorch's CUDA caching allocator, and the device memory outside it.

mpsim predicts each GPU's peak *allocated* memory (live tensors). What runs out on a GPU is
*reserved* memory: the segments PyTorch's caching allocator holds from the driver, which
rounding, pooling, splitting and fragmentation make larger, plus memory the allocator never
sees (the CUDA context, NCCL's buffers). ``replay`` runs one GPU's allocations and frees, in
time order, through a model of the allocator and reports both peaks; ``device_overheads``
lists what comes on top.

Source. The rules are read in PyTorch's ``c10/cuda/CUDACachingAllocator.cpp`` (class
``DeviceCachingAllocator``: ``malloc``, ``round_size``, ``get_pool``, ``get_allocation_size``,
``get_free_block``, ``should_split``, ``alloc_found_block``, ``alloc_block``,
``release_available_cached_blocks``, ``release_cached_blocks``, ``release_blocks``,
``free_block``, ``try_merge_blocks``; for expandable segments ``ExpandableSegment`` and
Note [Expandable Segments], ``find_expandable_block``, ``try_allocate_expandable_block``,
``map_block``, ``unmap_block``), as of torch 2.x; checked against a later, generic (templated)
version of the same code, which keeps these rules, and against the constants and defaults
of ``c10/core/AllocatorConfig.h`` as installed with torch 2.13 (``large_segment_size`` and
``max_non_split_rounding_size`` 20 MiB). Every number below names the constant it mirrors.

What is modelled:

- rounding: a request is rounded up to a multiple of ``kMinBlockSize`` (512 B), at least 512 B;
- two pools: rounded sizes up to ``kSmallSize`` (1 MiB) in the small pool, larger ones in the
  large pool; a block of one pool never serves the other;
- new segments (``cudaMalloc``): ``kSmallBuffer`` (2 MiB) for the small pool,
  ``kLargeBuffer`` (20 MiB) for large requests under ``kMinLargeAlloc`` (10 MiB), else the
  request rounded up to ``kRoundLarge`` (2 MiB);
- best fit: the smallest cached free block of the pool at least as large as the request,
  ties by lowest address;
- splitting (``should_split``): small pool when at least 512 B would remain, large pool when
  more than 1 MiB (``kSmallSize``) would remain and the request is under ``max_split_size``;
  with expandable segments every pool splits at 512 B;
- ``max_split_size`` (``max_split_size_mb``): a request under it never takes a cached block of
  at least that size, and a request of at least that size only takes a block smaller than
  the request plus ``max_non_split_rounding_size`` (20 MiB by default, ``kLargeBuffer`` in
  older releases), whole: a large-pool block is never split for it;
- frees merge with free neighbours of the same segment;
- when a new segment does not fit in ``capacity_bytes``: with ``max_split_size`` set, first
  free cached oversize segments, just enough (``release_available_cached_blocks``); then free
  every cached whole segment of both pools (``release_cached_blocks``, counted in
  ``released_cache_times``) and retry; only then is it out of memory;
- expandable segments (``expandable_segments:True``): one segment per pool (a second only if
  the first's address space is used up) whose physical
  pages are mapped on demand, 2 MiB pages (``kSmallBuffer``) for the small pool and 20 MiB
  pages (``kLargeBuffer``) for the large pool; a request with no fitting free block maps
  pages at the lowest address where free and unmapped space together hold it (growing the
  free block at the segment's end); best fit prefers a block without unmapped space behind
  it; the flush unmaps every whole free page.

Simplifications, all stated:

- one stream: cross-stream use, ``record_stream`` and event-deferred frees are not modelled;
- no CUDA graphs (private pools, ``MemPool``), no ``garbage_collection_threshold`` nor
  ``set_per_process_memory_fraction``, no ``roundup_power2_divisions`` (off by default),
  ``large_segment_size_mb`` and ``max_non_split_rounding_mb`` at their defaults, no
  free-memory callbacks (CUDA IPC), no ``cudaMallocAsync`` backend, one thread;
- addresses are synthetic: each new segment gets fresh addresses above the last one (the
  driver may reuse a freed range), which only matters for ties in best fit;
- an expandable segment reserves ``1 1/8 x capacity_bytes`` of address space (PyTorch:
  ``1 1/8 x`` the GPU's total memory) and at least the request that created it; expandable
  segments are on for the whole replay (PyTorch lets a program switch them mid-run);
- ``capacity_bytes`` is what the allocator may reserve: the GPU's memory less what is held
  outside it (``device_overheads``). cudaMalloc's own granularity adds nothing since every
  segment is a multiple of 2 MiB;
- after an out-of-memory the replay goes on as if the device had room: the allocation is
  served by a segment beyond ``capacity_bytes`` (as mpsim's memory log runs a job that does
  not fit to the end), so the peaks show the demand and ``oom_event_index`` the first
  failure.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

MIB = 1 << 20
"""One mebibyte."""

MIN_BLOCK_BYTES = 512
"""``kMinBlockSize`` (CUDACachingAllocator.cpp; AllocatorConfig.h): all sizes are rounded to a multiple of it."""
SMALL_SIZE_BYTES = 1 * MIB
"""``kSmallSize``: the largest rounded request of the small pool; also the remainder a large block must exceed
to be split (``should_split``)."""
SMALL_BUFFER_BYTES = 2 * MIB
"""``kSmallBuffer``: the segment of the small pool; the page of a small-pool expandable segment."""
MIN_LARGE_ALLOC_BYTES = 10 * MIB
"""``kMinLargeAlloc``: large requests under it get a ``kLargeBuffer`` segment (``get_allocation_size``)."""
LARGE_BUFFER_BYTES = 20 * MIB
"""``kLargeBuffer`` (``large_segment_size`` in torch 2.13, 20 MiB by default): the segment for large requests
under 10 MiB; the page of a large-pool expandable segment; the least ``max_split_size_mb`` accepted."""
ROUND_LARGE_BYTES = 2 * MIB
"""``kRoundLarge``: requests of 10 MiB or more get a segment rounded up to it."""
MAX_NON_SPLIT_ROUNDING_BYTES = 20 * MIB
"""``max_non_split_rounding_size`` (AllocatorConfig.h, 20 MiB by default; ``kLargeBuffer`` in older releases):
a request of at least ``max_split_size`` takes a cached block only if the block is smaller than the request
plus this."""
EXPANDABLE_ADDRESS_SPACE_FRACTION = (9, 8)
"""``ExpandableSegment``: address space reserved per segment, 1 1/8 of the memory (numerator, denominator)."""

_ADDR_BITS = 64
_ADDR_MASK = (1 << _ADDR_BITS) - 1
_FIRST_ADDR = 1 << 32
_NO_LIMIT = 1 << 126  # max_split_size unset (PyTorch: SIZE_MAX)


def round_size_bytes(size_bytes: int) -> int:
    """The block size a request of ``size_bytes`` takes (``round_size``, no power-of-2 divisions)."""
    if size_bytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return -(-size_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def allocation_size_bytes(rounded_bytes: int) -> int:
    """The size of the segment cudaMalloc'd for a rounded request no cached block serves (``get_allocation_size``)."""
    if rounded_bytes <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if rounded_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-rounded_bytes // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


def _ceil_to(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class _Pool:
    """The cached free blocks of one pool: sorted keys (size, then address) for best fit, and by address."""

    __slots__ = ("small", "page_bytes", "keys", "free", "unmapped")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.page_bytes = SMALL_BUFFER_BYTES if small else LARGE_BUFFER_BYTES
        self.keys: list[int] = []  # (size << 64) | address, ascending
        self.free: dict[int, _Block] = {}  # free mapped blocks by address
        self.unmapped: dict[int, _Block] = {}  # unmapped blocks of expandable segments by address


class _Segment:
    __slots__ = ("base", "size", "pool", "expandable")

    def __init__(self, base: int, size: int, pool: _Pool, expandable: bool) -> None:
        self.base = base
        self.size = size  # cudaMalloc'd bytes, or the address space of an expandable segment
        self.pool = pool
        self.expandable = expandable


class _Block:
    __slots__ = ("addr", "size", "requested", "allocated", "mapped", "prev", "next", "seg")

    def __init__(self, addr: int, size: int, seg: _Segment, mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.requested = 0
        self.allocated = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.seg = seg


def _link_after(blk: _Block, new: _Block) -> None:
    new.prev = blk
    new.next = blk.next
    if blk.next is not None:
        blk.next.prev = new
    blk.next = new


def _link_before(blk: _Block, new: _Block) -> None:
    new.next = blk
    new.prev = blk.prev
    if blk.prev is not None:
        blk.prev.next = new
    blk.prev = new


def _absorb(dst: _Block, src: _Block) -> None:
    """``try_merge_blocks``: ``dst`` takes over its neighbour ``src``."""
    if src is dst.prev:
        dst.addr = src.addr
        dst.prev = src.prev
        if dst.prev is not None:
            dst.prev.next = dst
    else:
        dst.next = src.next
        if dst.next is not None:
            dst.next.prev = dst
    dst.size += src.size


def _has_room(blk: _Block | None, size_bytes: int) -> bool:
    """``find_expandable_block``'s test: free and unmapped blocks from ``blk`` on hold ``size_bytes``."""
    total = 0
    while total < size_bytes and blk is not None and not blk.allocated:
        total += blk.size
        blk = blk.next
    return total >= size_bytes


class CachingAllocator:
    """One GPU's caching allocator (one stream); see the module docstring for the rules and their source.

    ``malloc`` and ``free`` change it; the ``*_bytes`` attributes and the peaks are its statistics, and
    ``segment_ranges``, ``live_blocks``, ``free_blocks`` and ``invariant_violations`` look inside.
    """

    def __init__(self, capacity_bytes: int, *, expandable_segments: bool = False,
                 max_split_size_bytes: int | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, not {capacity_bytes}")
        if max_split_size_bytes is not None and max_split_size_bytes < LARGE_BUFFER_BYTES:
            raise ValueError(f"max_split_size_bytes must be at least {LARGE_BUFFER_BYTES} (20 MiB, as "
                             f"max_split_size_mb), not {max_split_size_bytes}")
        self.capacity_bytes = capacity_bytes
        self.expandable = expandable_segments
        self.max_split_bytes = _NO_LIMIT if max_split_size_bytes is None else max_split_size_bytes
        self._small = _Pool(small=True)
        self._large = _Pool(small=False)
        self._live: dict[Hashable, _Block | None] = {}
        self._segments: set[_Segment] = set()
        self._next_addr = _FIRST_ADDR
        self._force = False
        self.allocated_bytes = 0
        """Sum of the live requests' sizes (what mpsim calls allocated)."""
        self.allocated_rounded_bytes = 0
        """Sum of the live blocks' sizes (PyTorch's ``allocated_bytes``, ``torch.cuda.memory_allocated``)."""
        self.reserved_bytes = 0
        """Bytes held from the driver (``reserved_bytes``, ``torch.cuda.memory_reserved``)."""
        self.segment_count = 0
        self.allocated_peak_bytes = 0
        self.allocated_rounded_peak_bytes = 0
        self.reserved_peak_bytes = 0
        self.reserved_at_allocated_peak_bytes = 0
        self.largest_free_block_at_allocated_peak_bytes = 0
        self.segments_peak = 0
        self.released_cache_times = 0
        self.oom_count = 0

    # -- the two operations -------------------------------------------------------------------

    def malloc(self, block_id: Hashable, size_bytes: int) -> bool:
        """Allocate ``size_bytes`` under ``block_id``; False when it did not fit even after flushing the cache
        (it is then served beyond the capacity, see the module docstring)."""
        if block_id in self._live:
            raise ValueError(f"block {block_id!r} is allocated twice without a free")
        if size_bytes < 0:
            raise ValueError(f"block {block_id!r}: size_bytes must be >= 0, not {size_bytes}")
        if size_bytes == 0:  # PyTorch's allocate() hands out a null pointer without the allocator
            self._live[block_id] = None
            return True
        size = round_size_bytes(size_bytes)
        pool = self._small if size <= SMALL_SIZE_BYTES else self._large
        served = True
        blk = self._get_free_block(pool, size)
        if blk is None:
            blk = self._allocate(pool, size)
        if blk is None:
            served = False
            self.oom_count += 1
            blk = self._allocate_forced(pool, size)
        self._use_block(pool, blk, size, size_bytes)
        self._live[block_id] = blk
        return served

    def free(self, block_id: Hashable) -> None:
        """Free the block allocated under ``block_id`` (``free_block``: it merges with free neighbours)."""
        try:
            blk = self._live.pop(block_id)
        except KeyError:
            raise ValueError(f"free of block {block_id!r}, which is not allocated") from None
        if blk is None:
            return
        self.allocated_bytes -= blk.requested
        self.allocated_rounded_bytes -= blk.size
        blk.allocated = False
        pool = blk.seg.pool
        self._merge_neighbours(pool, blk)
        self._insert_free(pool, blk)

    # -- finding and using a block ------------------------------------------------------------

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """``get_free_block``: best fit among the pool's cached blocks, with the ``max_split_size`` rules."""
        keys = pool.keys
        i = bisect_left(keys, size << _ADDR_BITS)
        if i == len(keys):
            return None
        if self.expandable:
            i = self._prefer_without_unmapped_tail(pool, i)
        key = keys[i]
        block_bytes = key >> _ADDR_BITS
        if size < self.max_split_bytes <= block_bytes:
            return None
        if size >= self.max_split_bytes and block_bytes >= size + MAX_NON_SPLIT_ROUNDING_BYTES:
            return None
        del keys[i]
        return pool.free.pop(key & _ADDR_MASK)

    def _prefer_without_unmapped_tail(self, pool: _Pool, i: int) -> int:
        """Best fit counts a block followed by unmapped space at the size it could grow to."""
        keys = pool.keys
        while i + 1 < len(keys) and self._growable_bytes(pool, keys[i + 1]) < self._growable_bytes(pool, keys[i]):
            i += 1
        return i

    @staticmethod
    def _growable_bytes(pool: _Pool, key: int) -> int:
        blk = pool.free[key & _ADDR_MASK]
        nxt = blk.next
        return blk.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

    def _should_split(self, pool: _Pool, blk: _Block, size: int) -> bool:
        remaining = blk.size - size
        if pool.small or self.expandable:
            return remaining >= MIN_BLOCK_BYTES
        return size < self.max_split_bytes and remaining > SMALL_SIZE_BYTES

    def _use_block(self, pool: _Pool, blk: _Block, size: int, requested: int) -> None:
        """``alloc_found_block``: split off the remainder if it is worth keeping, then count the block."""
        if self._should_split(pool, blk, size):
            rest = _Block(blk.addr + size, blk.size - size, blk.seg)
            _link_after(blk, rest)
            blk.size = size
            self._insert_free(pool, rest)
        blk.allocated = True
        blk.requested = requested
        self.allocated_bytes += requested
        self.allocated_rounded_bytes += blk.size
        if self.allocated_rounded_bytes > self.allocated_rounded_peak_bytes:
            self.allocated_rounded_peak_bytes = self.allocated_rounded_bytes
        if self.allocated_bytes > self.allocated_peak_bytes:
            self.allocated_peak_bytes = self.allocated_bytes
            self.reserved_at_allocated_peak_bytes = self.reserved_bytes
            self.largest_free_block_at_allocated_peak_bytes = self._largest_free_bytes()

    def _largest_free_bytes(self) -> int:
        return max((pool.keys[-1] >> _ADDR_BITS for pool in (self._small, self._large) if pool.keys), default=0)

    # -- new memory, and the flushes that make room for it ------------------------------------

    def _allocate(self, pool: _Pool, size: int) -> _Block | None:
        """``alloc_block``, then ``release_available_cached_blocks`` and retry, then ``release_cached_blocks``
        and retry."""
        blk = self._new_memory(pool, size)
        if blk is None and self._release_available(pool, size):
            blk = self._new_memory(pool, size)
        if blk is None:
            self._release_cached()
            blk = self._new_memory(pool, size)
        return blk

    def _allocate_forced(self, pool: _Pool, size: int) -> _Block:
        self._force = True
        try:
            blk = self._new_memory(pool, size)
        finally:
            self._force = False
        assert blk is not None, "a forced allocation always finds memory"
        return blk

    def _new_memory(self, pool: _Pool, size: int) -> _Block | None:
        if self.expandable:
            return self._allocate_expandable(pool, size)
        return self._cuda_malloc(pool, allocation_size_bytes(size))

    def _fits(self, nbytes: int) -> bool:
        return self._force or self.reserved_bytes + nbytes <= self.capacity_bytes

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        if self.reserved_bytes > self.reserved_peak_bytes:
            self.reserved_peak_bytes = self.reserved_bytes

    def _new_segment(self, pool: _Pool, size: int, expandable: bool) -> _Segment:
        seg = _Segment(self._next_addr, size, pool, expandable)
        self._next_addr += size
        self._segments.add(seg)
        self.segment_count += 1
        self.segments_peak = max(self.segments_peak, self.segment_count)
        return seg

    def _drop_segment(self, seg: _Segment) -> None:
        self._segments.discard(seg)
        self.segment_count -= 1

    def _cuda_malloc(self, pool: _Pool, alloc_bytes: int) -> _Block | None:
        if not self._fits(alloc_bytes):
            return None
        seg = self._new_segment(pool, alloc_bytes, expandable=False)
        self._reserve(alloc_bytes)
        return _Block(seg.base, alloc_bytes, seg)

    def _release_segment(self, pool: _Pool, blk: _Block) -> None:
        """``release_block``: cudaFree a cached whole segment."""
        self._remove_free(pool, blk)
        self.reserved_bytes -= blk.size
        self._drop_segment(blk.seg)

    def _release_available(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: with ``max_split_size`` set, free the smallest cached oversize
        segment that is large enough, else oversize segments from the largest down until enough is freed."""
        if self.max_split_bytes >= _NO_LIMIT or self.expandable:
            return False
        target = max(size, self.max_split_bytes)
        keys = pool.keys
        i = bisect_left(keys, target << _ADDR_BITS)
        if i < len(keys):
            blk = pool.free[keys[i] & _ADDR_MASK]
            if blk.prev is not None or blk.next is not None:  # never an oversize block (guard)
                return False
            self._release_segment(pool, blk)
            return True
        released = 0
        j = len(keys) - 1
        while released < target and j >= 0:
            blk = pool.free[keys[j] & _ADDR_MASK]
            if blk.size < self.max_split_bytes:
                break
            j -= 1
            if blk.prev is None and blk.next is None:
                released += blk.size
                self._release_segment(pool, blk)
        return released >= target

    def _release_cached(self) -> None:
        """``release_cached_blocks``: free every cached whole segment (unmap every whole free page), large pool
        first."""
        self.released_cache_times += 1
        for pool in (self._large, self._small):
            if self.expandable:
                self._unmap_pool(pool)
                continue
            for blk in [b for b in pool.free.values() if b.prev is None and b.next is None]:
                self._release_segment(pool, blk)

    # -- expandable segments ------------------------------------------------------------------

    def _allocate_expandable(self, pool: _Pool, size: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages until a free block of ``size`` exists at the lowest
        address where free and unmapped space hold it."""
        cand = self._find_expandable(pool, size)
        if not cand.mapped and not self._map(pool, cand, min(cand.size, size)):
            return None
        while cand.size < size:
            nxt = cand.next
            assert nxt is not None and not nxt.mapped, "a free block short of the request precedes unmapped space"
            if not self._map(pool, nxt, min(size - cand.size, nxt.size)):
                return None
            cand = nxt
        self._remove_free(pool, cand)
        return cand

    def _find_expandable(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: the lowest unmapped block (or the free block before it) with room,
        else a new segment."""
        for addr in sorted(pool.unmapped):
            cand = pool.unmapped[addr]
            if cand.prev is not None and not cand.prev.allocated:
                cand = cand.prev
            if _has_room(cand, size):
                return cand
        num, den = EXPANDABLE_ADDRESS_SPACE_FRACTION
        span = max(_ceil_to(self.capacity_bytes * num // den, pool.page_bytes), _ceil_to(size, pool.page_bytes))
        seg = self._new_segment(pool, span, expandable=True)
        blk = _Block(seg.base, span, seg, mapped=False)
        pool.unmapped[blk.addr] = blk
        return blk

    def _map(self, pool: _Pool, blk: _Block, size: int) -> bool:
        """``map_block``: map the pages covering the first ``size`` bytes of an unmapped block."""
        start = blk.addr - blk.seg.base
        mapped = _ceil_to(start + size, pool.page_bytes) - start
        if not self._fits(mapped):
            return False
        del pool.unmapped[blk.addr]
        blk.mapped = True
        if mapped < blk.size:
            rest = _Block(blk.addr + mapped, blk.size - mapped, blk.seg, mapped=False)
            _link_after(blk, rest)
            pool.unmapped[rest.addr] = rest
            blk.size = mapped
        self._merge_neighbours(pool, blk)
        self._insert_free(pool, blk)
        self._reserve(mapped)
        return True

    def _unmap_pool(self, pool: _Pool) -> None:
        """``release_blocks`` on expandable segments: unmap each free block's whole pages; drop a segment
        left wholly unmapped."""
        for blk in list(pool.free.values()):
            self._unmap(pool, blk)
            if blk.prev is None and blk.next is None and not blk.mapped:
                del pool.unmapped[blk.addr]
                self._drop_segment(blk.seg)

    def _unmap(self, pool: _Pool, blk: _Block) -> None:
        """``unmap_block``: the free block's whole pages become unmapped; the partial pages at either end stay
        mapped as free blocks."""
        seg, page = blk.seg, pool.page_bytes
        off = blk.addr - seg.base
        first, last = _ceil_to(off, page), (off + blk.size) // page * page
        if first >= last:
            return
        self._remove_free(pool, blk)
        if first > off:
            before = _Block(blk.addr, first - off, seg)
            _link_before(blk, before)
            self._insert_free(pool, before)
        if off + blk.size > last:
            after = _Block(seg.base + last, off + blk.size - last, seg)
            _link_after(blk, after)
            self._insert_free(pool, after)
        blk.addr, blk.size, blk.mapped = seg.base + first, last - first, False
        self._merge_neighbours(pool, blk)
        pool.unmapped[blk.addr] = blk
        self.reserved_bytes -= last - first

    # -- the free lists -----------------------------------------------------------------------

    @staticmethod
    def _insert_free(pool: _Pool, blk: _Block) -> None:
        insort(pool.keys, (blk.size << _ADDR_BITS) | blk.addr)
        pool.free[blk.addr] = blk

    @staticmethod
    def _remove_free(pool: _Pool, blk: _Block) -> None:
        keys = pool.keys
        del keys[bisect_left(keys, (blk.size << _ADDR_BITS) | blk.addr)]
        del pool.free[blk.addr]

    def _merge_neighbours(self, pool: _Pool, blk: _Block) -> None:
        """Absorb each neighbour that is free and mapped alike (neither is in a free list while it changes)."""
        for nb in (blk.prev, blk.next):
            if nb is None or nb.allocated or nb.mapped != blk.mapped:
                continue
            if nb.mapped:
                self._remove_free(pool, nb)
            else:
                del pool.unmapped[nb.addr]
            _absorb(blk, nb)

    # -- looking inside -----------------------------------------------------------------------

    def _blocks(self) -> list[_Block]:
        blocks = [b for b in self._live.values() if b is not None]
        for pool in (self._small, self._large):
            blocks += pool.free.values()
            blocks += pool.unmapped.values()
        return blocks

    def segment_ranges(self) -> list[tuple[int, int]]:
        """(address, bytes) of each reserved range: a segment, or a run of mapped pages of an expandable one."""
        ranges: list[tuple[int, int]] = []
        for blk in sorted((b for b in self._blocks() if b.mapped), key=lambda b: b.addr):
            prev = blk.prev
            if ranges and prev is not None and prev.mapped and ranges[-1][0] + ranges[-1][1] == blk.addr:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + blk.size)
            else:
                ranges.append((blk.addr, blk.size))
        return ranges

    def live_blocks(self) -> list[tuple[int, int]]:
        """(address, bytes) of each allocated block, by address."""
        return sorted((b.addr, b.size) for b in self._live.values() if b is not None)

    def free_blocks(self) -> list[tuple[int, int]]:
        """(address, bytes) of each cached free block, by address."""
        return sorted((b.addr, b.size) for pool in (self._small, self._large) for b in pool.free.values())

    def invariant_violations(self) -> list[str]:
        """What is inconsistent in the allocator's state (empty when all is well): every segment is tiled by
        its blocks, linked in address order, free neighbours are merged, and the counters match the blocks."""
        problems: list[str] = []
        by_seg: dict[_Segment, list[_Block]] = {seg: [] for seg in self._segments}
        for blk in self._blocks():
            if blk.seg not in by_seg:
                problems.append(f"block at {blk.addr:#x} belongs to a released segment")
                continue
            by_seg[blk.seg].append(blk)
        for seg, blocks in by_seg.items():
            problems += _segment_violations(seg, sorted(blocks, key=lambda b: b.addr))
        mapped_bytes = sum(size for _, size in self.segment_ranges())
        if mapped_bytes != self.reserved_bytes:
            problems.append(f"reserved_bytes {self.reserved_bytes} but the mapped blocks hold {mapped_bytes}")
        live = [b for b in self._live.values() if b is not None]
        if sum(b.size for b in live) != self.allocated_rounded_bytes:
            problems.append("allocated_rounded_bytes differs from the live blocks' sizes")
        if sum(b.requested for b in live) != self.allocated_bytes:
            problems.append("allocated_bytes differs from the live requests")
        if self.segment_count != len(self._segments):
            problems.append("segment_count differs from the segments held")
        return problems


def _segment_violations(seg: _Segment, blocks: list[_Block]) -> list[str]:
    """A segment's blocks, by address, must tile it, be linked in that order, and not leave mergeable pairs."""
    where = f"segment at {seg.base:#x}"
    if not blocks:
        return [f"{where} has no blocks"]
    problems: list[str] = []
    if blocks[0].addr != seg.base or blocks[0].prev is not None or blocks[-1].next is not None:
        problems.append(f"{where}: its blocks do not start and end with it")
    if sum(b.size for b in blocks) != seg.size:
        problems.append(f"{where}: its blocks hold {sum(b.size for b in blocks)} of {seg.size} bytes")
    for a, b in zip(blocks, blocks[1:]):
        if a.addr + a.size != b.addr or a.next is not b or b.prev is not a:
            problems.append(f"{where}: blocks at {a.addr:#x} and {b.addr:#x} are not adjacent and linked")
        if not a.allocated and not b.allocated and a.mapped == b.mapped:
            problems.append(f"{where}: free blocks at {a.addr:#x} and {b.addr:#x} were not merged")
    return problems


@dataclass(frozen=True)
class AllocatorResult:
    """What one GPU's replay through the caching allocator gives."""

    allocated_peak_bytes: int
    """Peak of the live requests' sizes (mpsim's allocated memory)."""
    allocated_rounded_peak_bytes: int
    """Peak of the live blocks' sizes: what ``torch.cuda.max_memory_allocated`` reports."""
    reserved_peak_bytes: int
    """Peak of the memory held from the driver: ``torch.cuda.max_memory_reserved``."""
    reserved_at_allocated_peak_bytes: int
    """Reserved memory when the allocated peak was first reached."""
    largest_free_block_at_allocated_peak_bytes: int
    """The largest cached free block then (how fragmented the cache was at the peak)."""
    segments_peak: int
    """Most segments held at once (cudaMalloc'd segments; with expandable segments, the segments' count)."""
    oom_event_index: int | None
    """Index of the first event that could not be served even after flushing the cache; None if all fit."""
    oom_count: int
    """Allocations that did not fit (each was then served beyond the capacity)."""
    released_cache_times: int
    """How many times the whole cache was flushed (``release_cached_blocks``, PyTorch's ``num_alloc_retries``)."""
    final_allocated_bytes: int
    final_reserved_bytes: int
    events: int
    allocated_series_bytes: np.ndarray | None = field(default=None, compare=False, repr=False)
    """Allocated bytes after each event, when asked for (``record_series``)."""
    reserved_series_bytes: np.ndarray | None = field(default=None, compare=False, repr=False)
    """Reserved bytes after each event, when asked for."""


def replay(events: Iterable[tuple[str, Hashable, int]], capacity_bytes: int, *,
           expandable_segments: bool = False, max_split_size_bytes: int | None = None,
           record_series: bool = False) -> AllocatorResult:
    """Replay one GPU's ``(kind, block_id, size_bytes)`` events, in time order, through the caching allocator.

    ``kind`` is "alloc" or "free"; a free names an earlier alloc's id (its size is ignored).
    ``capacity_bytes`` is the memory the allocator may reserve. ``max_split_size_bytes`` mirrors
    ``max_split_size_mb`` (at least 20 MiB); ``expandable_segments`` mirrors ``expandable_segments:True``.
    """
    alloc = CachingAllocator(capacity_bytes, expandable_segments=expandable_segments,
                             max_split_size_bytes=max_split_size_bytes)
    oom_index: int | None = None
    allocated_series: list[int] = []
    reserved_series: list[int] = []
    n = 0
    for kind, block_id, size_bytes in events:
        if kind == "alloc":
            if not alloc.malloc(block_id, size_bytes) and oom_index is None:
                oom_index = n
        elif kind == "free":
            alloc.free(block_id)
        else:
            raise ValueError(f"event {n}: kind must be 'alloc' or 'free', not {kind!r}")
        if record_series:
            allocated_series.append(alloc.allocated_bytes)
            reserved_series.append(alloc.reserved_bytes)
        n += 1
    series = (np.array(allocated_series, dtype=np.int64), np.array(reserved_series, dtype=np.int64)) \
        if record_series else (None, None)
    return AllocatorResult(
        allocated_peak_bytes=alloc.allocated_peak_bytes,
        allocated_rounded_peak_bytes=alloc.allocated_rounded_peak_bytes,
        reserved_peak_bytes=alloc.reserved_peak_bytes,
        reserved_at_allocated_peak_bytes=alloc.reserved_at_allocated_peak_bytes,
        largest_free_block_at_allocated_peak_bytes=alloc.largest_free_block_at_allocated_peak_bytes,
        segments_peak=alloc.segments_peak, oom_event_index=oom_index, oom_count=alloc.oom_count,
        released_cache_times=alloc.released_cache_times, final_allocated_bytes=alloc.allocated_bytes,
        final_reserved_bytes=alloc.reserved_bytes, events=n,
        allocated_series_bytes=series[0], reserved_series_bytes=series[1])


# -- device memory outside the caching allocator ------------------------------------------------

CUBLAS_WORKSPACE_DEFAULT_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
"""8,519,680 B: PyTorch's default cuBLAS workspace, ``CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8``
(``parseChosenWorkspaceSize`` in aten/src/ATen/cuda/CublasHandlePool.cpp)."""
CUBLAS_WORKSPACE_LARGE_BYTES = 4096 * 8 * 1024
"""32 MiB: the default there for compute capability major 9 (Hopper; 9.0 only in releases before Blackwell
support), 10 and 12 (Blackwell)."""
CUBLAS_WORKSPACE_LARGE_MAJORS = (9, 10, 12)
"""Compute-capability majors given ``CUBLAS_WORKSPACE_LARGE_BYTES`` (``parseChosenWorkspaceSize``)."""
CUBLAS_WORKSPACES_TRAINING = 2
"""Workspaces a training process holds per GPU: CublasHandlePool.cpp keeps one per (device, stream) in a
thread-local map (``cublas_stream_to_workspace``), and the forward runs on the main thread while autograd
runs the backward on its own device thread. Our reading of the source, not a measurement. cuBLASLt shares
this workspace by default (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``)."""

CUDA_CONTEXT_LAZY_LOW_BYTES = 287_047_680 - LARGE_BUFFER_BYTES
"""266,076,160 B: ``total - free`` measured with ``CUDA_MODULE_LOADING=LAZY`` in pytorch/pytorch#86509
(torch 1.13, CUDA 11.7; the GPU is not stated), less the 20 MiB segment of the 6.4 MB test tensor."""
CUDA_CONTEXT_LAZY_HIGH_BYTES = 400 * MIB
"""'around 400MB' for the context with CUDA >= 11.7 and lazy loading (PyTorch default), ptrblck in
pytorch/pytorch#109888 (2023); taken as 400 MiB, the high end. No measured Hopper figure was found: for an
H100 treat the context as an estimate in [LOW, HIGH]."""
CUDA_CONTEXT_EAGER_LOW_BYTES = 666_632_192 - LARGE_BUFFER_BYTES
"""645,660,672 B: the same measurement with eager module loading (pytorch/pytorch#86509)."""
CUDA_CONTEXT_EAGER_HIGH_BYTES = 1687 * MIB
"""1687 MiB: a context on an RTX 3090 with torch 1.8.2+cu111, eager loading (pytorch/pytorch#55277); ptrblck
in pytorch/pytorch#107667: '>1000MB' before CUDA 11.7."""
LAZY_LOADING_CUDA = (11, 7)
"""Lazy module loading exists from CUDA 11.7 (CUDA Programming Guide, Lazy Loading); PyTorch sets
``CUDA_MODULE_LOADING=LAZY`` when unset since 1.13 (pytorch/pytorch#86509), and it is CUDA's default on Linux
from 12.2."""

NCCL_LL_BUFFSIZE_BYTES = 8 * 512 * 8 * 16
"""524,288 B: NCCL's ``DEFAULT_LL_BUFFSIZE`` (src/init.cc) = ``NCCL_LL_LINES_PER_THREAD`` (8) x
``NCCL_LL_MAX_NTHREADS`` (512) x ``NCCL_STEPS`` (8) x ``sizeof(union ncclLLFifoLine)`` (16) (src/include/device.h);
``NCCL_LL_BUFFSIZE`` overrides it."""
NCCL_LL128_BUFFSIZE_BYTES = 120 * 640 * 8 * 8
"""4,915,200 B: ``DEFAULT_LL128_BUFFSIZE`` = ``NCCL_LL128_ELEMS_PER_THREAD`` (120) x ``NCCL_LL128_MAX_NTHREADS``
(640) x ``NCCL_STEPS`` (8) x 8 B; ``NCCL_LL128_BUFFSIZE`` overrides it."""
NCCL_BUFFSIZE_BYTES = 1 << 22
"""4 MiB: ``DEFAULT_BUFFSIZE``, the SIMPLE protocol's buffer (``NCCL_BUFFSIZE``, NCCL docs: Environment
Variables; 1 MiB on Arm hosts)."""
NCCL_CUDA_IPC_MIN_BYTES = 2 * MIB
"""``CUDA_IPC_MIN`` (src/include/comm.h): P2P buffers are allocated in multiples of it (``ALIGN_SIZE``)."""
NCCL_P2P_CONNECTION_BYTES = (_ceil_to(NCCL_LL_BUFFSIZE_BYTES + NCCL_LL128_BUFFSIZE_BYTES + NCCL_BUFFSIZE_BYTES,
                                      NCCL_CUDA_IPC_MIN_BYTES) + NCCL_CUDA_IPC_MIN_BYTES)
"""12 MiB per channel and peer on one GPU: src/transport/p2p.cc gives the receiving GPU the three protocols'
buffers (9,633,792 B) plus an ``ncclRecvMem`` header of a few KiB, aligned up to 2 MiB (10 MiB), and the
sending GPU an ``ncclSendMem`` header aligned to 2 MiB; in P2P read mode (NVLink, Ampere and later) the
SIMPLE buffer moves to the sender's side (6 MiB + 6 MiB), the same 12 MiB in all. A GPU in a ring receives
from one peer and sends to another, so it holds 12 MiB per channel and ring."""
NCCL_CHANNELS_ESTIMATE = 16
"""An estimate, not a sourced figure: NCCL picks the channel count from its topology search (bounded by
``NCCL_MIN_NCHANNELS``/``NCCL_MAX_NCHANNELS``). Pass the count ``NCCL_DEBUG=INFO`` prints for the real system."""


def cublas_workspace_bytes(compute_capability: float | None) -> int:
    """One cuBLAS workspace as PyTorch sizes it by default (``parseChosenWorkspaceSize``); an unknown GPU
    gets the general default, as PyTorch does without device properties."""
    if compute_capability is not None and int(compute_capability) in CUBLAS_WORKSPACE_LARGE_MAJORS:
        return CUBLAS_WORKSPACE_LARGE_BYTES
    return CUBLAS_WORKSPACE_DEFAULT_BYTES


@dataclass(frozen=True)
class DeviceOverheads:
    """Memory that counts against a GPU besides mpsim's tensors.

    ``cuda_context_bytes`` and ``nccl_buffers_bytes`` are outside the caching allocator: take them off the
    GPU's memory to get ``replay``'s ``capacity_bytes``. ``cublas_workspace_bytes`` is allocated *through*
    the caching allocator (``getNewWorkspace`` in CublasHandlePool.cpp calls it) and held for the process's
    life: add one ``("alloc", id, cublas_workspace_bytes(cc))`` event per workspace at the start of a replay
    (a 32 MiB one takes its own segment; an 8,519,680 B one a 20 MiB segment it splits), or add it on top.
    """

    cuda_context_bytes: int
    cublas_workspace_bytes: int
    nccl_buffers_bytes: int

    @property
    def outside_allocator_bytes(self) -> int:
        return self.cuda_context_bytes + self.nccl_buffers_bytes

    @property
    def total_bytes(self) -> int:
        return self.outside_allocator_bytes + self.cublas_workspace_bytes

    def as_dict(self) -> dict[str, int]:
        return {"cuda_context_bytes": self.cuda_context_bytes, "cublas_workspace_bytes": self.cublas_workspace_bytes,
                "nccl_buffers_bytes": self.nccl_buffers_bytes,
                "outside_allocator_bytes": self.outside_allocator_bytes, "total_bytes": self.total_bytes}

    @classmethod
    def of(cls, compute_capability: float | None, *, nccl_peers: int = 0,
           nccl_channels: int = NCCL_CHANNELS_ESTIMATE, cublas_workspaces: int = CUBLAS_WORKSPACES_TRAINING,
           cuda_version: tuple[int, int] | None = None,
           context_bound: Literal["low", "high"] = "high") -> DeviceOverheads:
        """See ``device_overheads``."""
        if min(nccl_peers, nccl_channels, cublas_workspaces) < 0:
            raise ValueError("nccl_peers, nccl_channels and cublas_workspaces must be >= 0")
        if context_bound not in ("low", "high"):
            raise ValueError(f"context_bound must be 'low' or 'high', not {context_bound!r}")
        lazy = cuda_version is None or cuda_version >= LAZY_LOADING_CUDA
        low, high = ((CUDA_CONTEXT_LAZY_LOW_BYTES, CUDA_CONTEXT_LAZY_HIGH_BYTES) if lazy
                     else (CUDA_CONTEXT_EAGER_LOW_BYTES, CUDA_CONTEXT_EAGER_HIGH_BYTES))
        return cls(cuda_context_bytes=high if context_bound == "high" else low,
                   cublas_workspace_bytes=cublas_workspaces * cublas_workspace_bytes(compute_capability),
                   nccl_buffers_bytes=nccl_peers * nccl_channels * NCCL_P2P_CONNECTION_BYTES)


def device_overheads(compute_capability: float | None, *, nccl_peers: int = 0,
                     nccl_channels: int = NCCL_CHANNELS_ESTIMATE, cublas_workspaces: int = CUBLAS_WORKSPACES_TRAINING,
                     cuda_version: tuple[int, int] | None = None,
                     context_bound: Literal["low", "high"] = "high") -> dict[str, int]:
    """The memory besides mpsim's tensors that counts against one GPU, by item (see ``DeviceOverheads``).

    - ``cuda_context_bytes``: an estimate range from published measurements, chosen by ``context_bound``;
      lazy module loading unless ``cuda_version`` is older than 11.7. It does not depend on the GPU here:
      no per-generation figure was found.
    - ``cublas_workspace_bytes``: ``cublas_workspaces`` x ``cublas_workspace_bytes(compute_capability)``.
    - ``nccl_buffers_bytes``: ``nccl_peers`` x ``nccl_channels`` x ``NCCL_P2P_CONNECTION_BYTES`` (12 MiB),
      where ``nccl_peers`` counts the peers this GPU receives from on each channel (1 for a ring, up to 3 more
      for NCCL's trees); NVLS (NVLink SHARP) buffers and network-transport buffers are not counted.
    """
    return DeviceOverheads.of(compute_capability, nccl_peers=nccl_peers, nccl_channels=nccl_channels,
                              cublas_workspaces=cublas_workspaces, cuda_version=cuda_version,
                              context_bound=context_bound).as_dict()
