"""The caching-allocator model (mpsim/sim/allocator.py) on hand-built sequences whose byte counts are derived
by hand in the comments from PyTorch's rules (kMinBlockSize 512 B, kSmallSize 1 MiB, kSmallBuffer 2 MiB,
kMinLargeAlloc 10 MiB, kLargeBuffer 20 MiB, kRoundLarge 2 MiB), plus one property over random sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsim.sim.allocator import (
    CUBLAS_WORKSPACE_DEFAULT_BYTES,
    CUBLAS_WORKSPACE_LARGE_BYTES,
    CUDA_CONTEXT_LAZY_HIGH_BYTES,
    CachingAllocator,
    DeviceOverheads,
    allocation_size_bytes,
    cublas_workspace_bytes,
    device_overheads,
    replay,
    round_size_bytes,
)

MiB = 1 << 20
BIG = 80 << 30  # capacity that never runs out


def allocs(*sizes: int) -> list[tuple[str, int, int]]:
    return [("alloc", i, s) for i, s in enumerate(sizes)]


def frees(*ids: int) -> list[tuple[str, int, int]]:
    return [("free", i, 0) for i in ids]


def test_rounding_of_a_1_byte_and_a_513_byte_request() -> None:
    # 1 B -> 512 B (at least kMinBlockSize); 513 B -> 1024 B (next multiple of 512). Both small: one 2 MiB segment,
    # the first block splits it (2 MiB - 512 B >= 512 B remain), the second is cut from the remainder.
    r = replay(allocs(1, 513), BIG)
    assert (round_size_bytes(1), round_size_bytes(512), round_size_bytes(513)) == (512, 512, 1024)
    assert r.allocated_peak_bytes == 514
    assert r.allocated_rounded_peak_bytes == 512 + 1024
    assert r.reserved_peak_bytes == 2 * MiB
    assert r.segments_peak == 1


def test_a_zero_byte_request_takes_nothing() -> None:
    r = replay(allocs(0) + frees(0), BIG)
    assert (r.allocated_peak_bytes, r.reserved_peak_bytes, r.segments_peak) == (0, 0, 0)


def test_small_requests_share_a_2_mib_segment() -> None:
    # 1 MiB is the largest small request: the first takes a 2 MiB segment and splits it (1 MiB remains), the
    # second fits the remainder exactly, the third needs a second 2 MiB segment: 4 MiB reserved for 3 MiB.
    r = replay(allocs(MiB, MiB, MiB), BIG)
    assert r.reserved_peak_bytes == 4 * MiB
    assert r.segments_peak == 2
    # one byte more rounds to 1 MiB + 512 B: the large pool, a 20 MiB segment (under kMinLargeAlloc)
    assert allocation_size_bytes(round_size_bytes(MiB + 1)) == 20 * MiB
    assert replay(allocs(MiB + 1), BIG).reserved_peak_bytes == 20 * MiB


def test_a_5_mib_request_takes_20_mib_and_a_second_one_splits_it() -> None:
    # 5 MiB < 10 MiB: a 20 MiB segment, split (15 MiB > 1 MiB remains); the second 5 MiB takes the 15 MiB block
    # (best fit) and splits it again (10 MiB remain): still one 20 MiB segment.
    r = replay(allocs(5 * MiB, 5 * MiB), BIG)
    assert r.allocated_peak_bytes == 10 * MiB
    assert r.reserved_peak_bytes == 20 * MiB
    assert r.segments_peak == 1


def test_large_requests_get_a_segment_rounded_to_2_mib() -> None:
    # >= 10 MiB: the request rounded up to 2 MiB. 30 MiB -> 30 MiB; 31 MiB -> 32 MiB; exactly 10 MiB -> 10 MiB,
    # one block under it (10 MiB - 512 B) -> 20 MiB.
    assert replay(allocs(30 * MiB), BIG).reserved_peak_bytes == 30 * MiB
    assert replay(allocs(31 * MiB), BIG).reserved_peak_bytes == 32 * MiB
    assert replay(allocs(10 * MiB), BIG).reserved_peak_bytes == 10 * MiB
    assert replay(allocs(10 * MiB - 512), BIG).reserved_peak_bytes == 20 * MiB


def test_best_fit_takes_the_smallest_adequate_cached_block() -> None:
    # Three segments of 12, 16 and 14 MiB (each request >= 10 MiB gets its own), all freed. A 13 MiB request takes
    # the 14 MiB block (not 12: too small; not 16: larger) whole, since 1 MiB remaining is not > 1 MiB.
    a = CachingAllocator(BIG)
    for i, size in enumerate((12 * MiB, 16 * MiB, 14 * MiB)):
        a.malloc(i, size)
    starts = [addr for addr, _ in a.live_blocks()]
    for i in range(3):
        a.free(i)
    a.malloc("x", 13 * MiB)
    assert a.live_blocks() == [(starts[2], 14 * MiB)]
    assert (a.allocated_bytes, a.allocated_rounded_bytes, a.reserved_bytes) == (13 * MiB, 14 * MiB, 42 * MiB)
    # a 12 MiB request then fits the 12 MiB block exactly; the 16 MiB block is split by a 12 MiB request
    # (4 MiB > 1 MiB remains) and the 4 MiB remainder is cached
    a.malloc("y", 12 * MiB)
    a.malloc("z", 12 * MiB)
    assert a.live_blocks() == [(starts[0], 12 * MiB), (starts[1], 12 * MiB), (starts[2], 14 * MiB)]
    assert a.free_blocks() == [(starts[1] + 12 * MiB, 4 * MiB)]
    assert a.reserved_bytes == 42 * MiB


def test_best_fit_ties_go_to_the_lowest_address() -> None:
    a = CachingAllocator(BIG)
    a.malloc(0, 14 * MiB)
    a.malloc(1, 14 * MiB)
    (low, _), (high, _) = a.live_blocks()
    a.free(1)
    a.free(0)
    a.malloc("x", 14 * MiB)
    assert a.live_blocks() == [(low, 14 * MiB)] and low < high


def fragmentation_events() -> list[tuple[str, int, int]]:
    # nine 6 MiB blocks, every other one freed, then a 10 MiB request
    return allocs(*[6 * MiB] * 9) + frees(0, 2, 4, 6, 8) + [("alloc", 9, 10 * MiB)]


def test_fragmentation_makes_reserved_exceed_allocated() -> None:
    # Each 20 MiB segment holds three 6 MiB blocks: 20 -> 14 -> 8 -> 2 MiB free, and 2 MiB > 1 MiB is split off, so
    # nine blocks take three segments (60 MiB reserved, 54 MiB allocated). Freeing blocks 0, 2, 4, 6, 8 leaves holes
    # of 6, 6+2, 6, 6, 6+2 MiB (and segment 2's 2 MiB tail): none holds 10 MiB, which gets a 10 MiB segment
    # (>= kMinLargeAlloc, rounded to 2 MiB). Reserved 70 MiB for 4 x 6 + 10 = 34 MiB allocated.
    a = CachingAllocator(BIG)
    for kind, i, size in fragmentation_events():
        a.malloc(i, size) if kind == "alloc" else a.free(i)
    assert sorted(size for _, size in a.free_blocks()) == [2 * MiB, 6 * MiB, 6 * MiB, 6 * MiB, 8 * MiB, 8 * MiB]
    assert (a.allocated_bytes, a.reserved_bytes, a.segment_count) == (34 * MiB, 70 * MiB, 4)
    r = replay(fragmentation_events(), BIG)
    assert (r.allocated_peak_bytes, r.reserved_peak_bytes) == (54 * MiB, 70 * MiB)
    assert r.reserved_at_allocated_peak_bytes == 60 * MiB
    assert r.largest_free_block_at_allocated_peak_bytes == 2 * MiB  # three 2 MiB tails at that point
    assert (r.final_allocated_bytes, r.final_reserved_bytes) == (34 * MiB, 70 * MiB)


def test_expandable_segments_lower_the_reserved_peak_of_the_fragmentation_sequence() -> None:
    # One large-pool segment grown in 20 MiB pages: the nine 6 MiB blocks lie end to end in [0, 54) MiB of three
    # mapped pages (60 MiB), the free tail [54, 60) merges with freed block 8 into a 12 MiB block, which serves the
    # 10 MiB request (best fit; 2 MiB >= 512 B remains, split). Reserved stays 60 MiB, not 70.
    r = replay(fragmentation_events(), BIG, expandable_segments=True)
    assert (r.allocated_peak_bytes, r.reserved_peak_bytes, r.final_reserved_bytes) == (54 * MiB, 60 * MiB, 60 * MiB)
    assert r.segments_peak == 1


def test_expandable_segments_grow_in_pages_of_the_pool() -> None:
    # growing requests: cudaMalloc segments of 12 + 14 + 16 + 22 MiB = 64 MiB; an expandable segment maps one 20 MiB
    # page for the first three (each fits the freed block) and a second page when 22 MiB needs 2 MiB more: 40 MiB
    events = allocs(12 * MiB) + frees(0) + [("alloc", 1, 14 * MiB), ("free", 1, 0), ("alloc", 2, 16 * MiB),
                                            ("free", 2, 0), ("alloc", 3, 22 * MiB)]
    assert replay(events, BIG).reserved_peak_bytes == 64 * MiB
    assert replay(events, BIG, expandable_segments=True).reserved_peak_bytes == 40 * MiB
    # the small pool maps 2 MiB pages: 3 x 700 KiB = 2100 KiB -> two pages
    small = allocs(700 << 10, 700 << 10, 700 << 10)
    assert replay(small, BIG, expandable_segments=True).reserved_peak_bytes == 4 * MiB


def test_frees_merge_with_free_neighbours() -> None:
    # Five 4 MiB blocks fill one 20 MiB segment (the last takes the 4 MiB remainder whole). Freeing blocks 1 and 3
    # leaves two 4 MiB holes; freeing 2 merges the three into one 12 MiB block, which a 12 MiB request then takes
    # without a new segment.
    a = CachingAllocator(BIG)
    for i in range(5):
        a.malloc(i, 4 * MiB)
    base = a.live_blocks()[0][0]
    a.free(1)
    a.free(3)
    assert a.free_blocks() == [(base + 4 * MiB, 4 * MiB), (base + 12 * MiB, 4 * MiB)]
    a.free(2)
    assert a.free_blocks() == [(base + 4 * MiB, 12 * MiB)]
    a.malloc("x", 12 * MiB)
    assert (a.reserved_bytes, a.segment_count, a.free_blocks()) == (20 * MiB, 1, [])
    for block_id in (0, 4, "x"):
        a.free(block_id)
    assert a.free_blocks() == [(base, 20 * MiB)]
    assert a.invariant_violations() == []


def test_the_cache_is_flushed_when_a_new_segment_does_not_fit_then_it_succeeds() -> None:
    # capacity 40 MiB: 30 MiB cached after its free; 32 MiB does not fit the cached block, and 30 + 32 > 40, so the
    # allocator releases the cached whole segment (reserved 0) and retries: 32 MiB, peak 32 MiB, one flush.
    r = replay(allocs(30 * MiB) + frees(0) + [("alloc", 1, 32 * MiB)], 40 * MiB)
    assert r.oom_event_index is None
    assert r.released_cache_times == 1
    assert (r.reserved_peak_bytes, r.final_reserved_bytes, r.segments_peak) == (32 * MiB, 32 * MiB, 1)


def test_an_out_of_memory_that_survives_the_flush() -> None:
    # capacity 30 MiB: 5 MiB takes a 20 MiB segment and splits it (15 MiB cached, but split: it cannot be released).
    # 16 MiB does not fit the 15 MiB block; a 16 MiB segment would make 36 MiB > 30; the flush frees nothing; so the
    # event at index 1 is out of memory. The replay goes on beyond capacity to show the demand (36 MiB).
    # The 512 B request then needs a 2 MiB small segment, 38 > 30 MiB: a second flush and a second OOM.
    events = allocs(5 * MiB, 16 * MiB) + [("alloc", 2, 512)]
    r = replay(events, 30 * MiB)
    assert r.oom_event_index == 1
    assert (r.oom_count, r.released_cache_times) == (2, 2)
    assert r.reserved_peak_bytes == 38 * MiB
    assert r.allocated_peak_bytes == 21 * MiB + 512
    r2 = replay(events, 40 * MiB)
    assert (r2.oom_event_index, r2.released_cache_times, r2.reserved_peak_bytes) == (None, 0, 38 * MiB)


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    # max_split_size 32 MiB. A freed 40 MiB segment: a 34 MiB request (>= max_split) may take it since
    # 40 < 34 + 20 MiB, and does not split it (rounded 40 MiB); without the option it splits off 6 MiB (> 1 MiB).
    for max_split, rounded in ((32 * MiB, 40 * MiB), (None, 34 * MiB)):
        a = CachingAllocator(BIG, max_split_size_bytes=max_split)
        a.malloc(0, 40 * MiB)
        a.free(0)
        a.malloc(1, 34 * MiB)
        assert (a.allocated_rounded_bytes, a.reserved_bytes) == (rounded, 40 * MiB)
        assert len(a.free_blocks()) == (0 if max_split else 1)
    # a 12 MiB request (< max_split) never takes the oversize 40 MiB block: a new 12 MiB segment (52 MiB)
    small = allocs(40 * MiB) + frees(0) + [("alloc", 1, 12 * MiB)]
    assert replay(small, BIG, max_split_size_bytes=32 * MiB).reserved_peak_bytes == 52 * MiB
    assert replay(small, BIG).reserved_peak_bytes == 40 * MiB
    # a 34 MiB request does not take a 60 MiB block (60 >= 34 + 20): a new 34 MiB segment (94 MiB)
    much_larger = allocs(60 * MiB) + frees(0) + [("alloc", 1, 34 * MiB)]
    assert replay(much_larger, BIG, max_split_size_bytes=32 * MiB).reserved_peak_bytes == 94 * MiB


def test_max_split_size_releases_just_an_oversize_segment_before_flushing() -> None:
    # capacity 50 MiB, max_split_size 32 MiB: 40 MiB cached; a 12 MiB request skips it (oversize) and needs a new
    # segment, 52 > 50: release_available_cached_blocks frees the smallest cached block of >= 32 MiB (the 40 MiB
    # one) and the retry fits, without a full flush.
    r = replay(allocs(40 * MiB) + frees(0) + [("alloc", 1, 12 * MiB)], 50 * MiB, max_split_size_bytes=32 * MiB)
    assert (r.oom_event_index, r.released_cache_times) == (None, 0)
    assert (r.reserved_peak_bytes, r.final_reserved_bytes) == (40 * MiB, 12 * MiB)
    with pytest.raises(ValueError, match="20 MiB"):
        replay([], BIG, max_split_size_bytes=16 * MiB)


def test_the_expandable_flush_unmaps_whole_free_pages() -> None:
    # capacity 40 MiB, expandable: ten 1 MiB requests map five 2 MiB pages of the small pool (10 MiB); freed, they
    # merge into one free 10 MiB block. A 35 MiB request needs two 20 MiB pages of the large pool, 10 + 40 > 40 MiB:
    # the flush unmaps the small pool's five whole free pages (reserved 0; its segment, now wholly unmapped, is
    # dropped) and the retry maps 40 MiB. Peak 40 MiB, one flush, two segments at most.
    events = allocs(*[MiB] * 10) + frees(*range(10)) + [("alloc", 10, 35 * MiB)]
    r = replay(events, 40 * MiB, expandable_segments=True)
    assert (r.oom_event_index, r.released_cache_times) == (None, 1)
    assert (r.reserved_peak_bytes, r.final_reserved_bytes, r.segments_peak) == (40 * MiB, 40 * MiB, 2)
    assert replay(events[:10], 40 * MiB, expandable_segments=True).reserved_peak_bytes == 10 * MiB


def test_the_series_follow_each_event_and_bad_events_are_refused() -> None:
    r = replay(allocs(5 * MiB) + frees(0), BIG, record_series=True)
    assert r.allocated_series_bytes is not None and r.reserved_series_bytes is not None
    assert r.allocated_series_bytes.tolist() == [5 * MiB, 0]
    assert r.reserved_series_bytes.tolist() == [20 * MiB, 20 * MiB]
    with pytest.raises(ValueError, match="not allocated"):
        replay(frees(0), BIG)
    with pytest.raises(ValueError, match="twice"):
        replay(allocs(1) + [("alloc", 0, 1)], BIG)
    with pytest.raises(ValueError, match="kind"):
        replay([("malloc", 0, 1)], BIG)


def test_device_overheads_name_each_item() -> None:
    # Hopper: 32 MiB cuBLAS workspace, two of them (forward thread, autograd thread); an 8-GPU ring on 16 channels
    # holds 16 x 12 MiB of NCCL buffers; the context at the high end of the lazy-loading range.
    o = device_overheads(9.0, nccl_peers=1, nccl_channels=16)
    assert o["cublas_workspace_bytes"] == 2 * 32 * MiB
    assert o["nccl_buffers_bytes"] == 16 * 12 * MiB
    assert o["cuda_context_bytes"] == CUDA_CONTEXT_LAZY_HIGH_BYTES
    assert o["outside_allocator_bytes"] == o["cuda_context_bytes"] + o["nccl_buffers_bytes"]
    assert o["total_bytes"] == o["outside_allocator_bytes"] + o["cublas_workspace_bytes"]
    assert cublas_workspace_bytes(8.0) == 8_519_680  # :4096:2:16:8 -> 4096 KiB x 2 + 16 KiB x 8
    assert cublas_workspace_bytes(None) == CUBLAS_WORKSPACE_DEFAULT_BYTES
    assert cublas_workspace_bytes(10.0) == CUBLAS_WORKSPACE_LARGE_BYTES
    eager = DeviceOverheads.of(8.0, cuda_version=(11, 1), context_bound="low")
    assert eager.cuda_context_bytes == 666_632_192 - 20 * MiB
    assert device_overheads(8.0)["nccl_buffers_bytes"] == 0


# -- property: random sequences keep the allocator consistent ----------------------------------------------------

SIZES = st.one_of(st.integers(0, 3 * MiB), st.integers(MiB, 48 * MiB), st.sampled_from([512, MiB, 10 * MiB]))
OPS = st.lists(st.one_of(st.tuples(st.just("alloc"), SIZES), st.tuples(st.just("free"), st.integers(0, 10**6))),
               max_size=80)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(ops=OPS, capacity_mib=st.sampled_from([48, 160, 100_000]), expandable=st.booleans(),
       max_split_mib=st.sampled_from([None, 20, 32]))
def test_random_sequences_keep_the_allocator_consistent(ops: list[tuple[str, int]], capacity_mib: int,
                                                        expandable: bool, max_split_mib: int | None) -> None:
    max_split = None if max_split_mib is None else max_split_mib * MiB
    a = CachingAllocator(capacity_mib * MiB, expandable_segments=expandable, max_split_size_bytes=max_split)
    live: list[int] = []
    events: list[tuple[str, int, int]] = []
    for n, (kind, arg) in enumerate(ops):
        if kind == "alloc":
            a.malloc(n, arg)
            live.append(n)
            events.append(("alloc", n, arg))
        elif live:
            block_id = live.pop(arg % len(live))
            a.free(block_id)
            events.append(("free", block_id, 0))
        assert a.invariant_violations() == []
        ranges = a.segment_ranges()
        assert all(s0 + n0 <= s1 for (s0, n0), (s1, _) in zip(ranges, ranges[1:])), "segments overlap"
        assert all(any(s <= addr and addr + size <= s + n for s, n in ranges) for addr, size in a.live_blocks())
        assert a.allocated_bytes <= a.allocated_rounded_bytes <= a.reserved_bytes
    for block_id in live:
        a.free(block_id)
        events.append(("free", block_id, 0))
    assert (a.allocated_bytes, a.allocated_rounded_bytes, a.live_blocks()) == (0, 0, [])
    assert a.invariant_violations() == []
    r = replay(events, capacity_mib * MiB, expandable_segments=expandable, max_split_size_bytes=max_split)
    assert r.reserved_peak_bytes >= r.allocated_rounded_peak_bytes >= r.allocated_peak_bytes
    assert r.final_allocated_bytes == 0
    assert (r.reserved_peak_bytes, r.segments_peak, r.oom_count) == (a.reserved_peak_bytes, a.segments_peak,
                                                                      a.oom_count)
    assert (r.oom_event_index is None) == (r.oom_count == 0)
