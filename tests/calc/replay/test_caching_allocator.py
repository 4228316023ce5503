"""`calc.replay.caching_allocator` on hand-made streams, each expected value derived by hand
from the rules of ``c10/cuda/CUDACachingAllocator.cpp`` its module docstring cites by function
name (constants: the torch 2.13 wheel's ``include/c10/core/AllocatorConfig.h``: kSmallBuffer
2 MiB, kMinBlockSize 512, kSmallSize 1 MiB, kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB;
kLargeBuffer 20 MiB from the .cpp)."""

from __future__ import annotations

import pytest

from calc.replay.caching_allocator import (
    AllocatorConfig,
    AllocatorOutOfMemory,
    CachingAllocator,
    allocation_size,
    replay,
    round_size,
)

MIB = 1 << 20
EXPANDABLE = AllocatorConfig(expandable_segments=True)


def test_round_size_and_allocation_size() -> None:
    # round_size: max(512, ceil(n/512)*512); get_allocation_size: <=1 MiB -> 2 MiB,
    # <10 MiB -> 20 MiB, else ceil to 2 MiB.
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert allocation_size(1024) == 2 * MIB
    assert allocation_size(MIB) == 2 * MIB
    assert allocation_size(MIB + 512) == 20 * MIB
    assert allocation_size(10 * MIB - 512) == 20 * MIB
    assert allocation_size(10 * MIB) == 10 * MIB
    assert allocation_size(11 * MIB + 512) == 12 * MIB


def test_small_requests_share_one_2mib_segment() -> None:
    # 1000 B -> 1024 in a new 2 MiB small segment, split (2 MiB - 1024 >= 512 left); the second
    # request takes the remainder: one segment, 2048 B allocated.
    st = replay([(True, "a", 1000), (True, "b", 1000)])
    assert (st.reserved_bytes, st.allocated_bytes, st.segments) == (2 * MIB, 2048, 1)


def test_medium_requests_share_a_20mib_segment() -> None:
    # 3 MiB: large pool, a 20 MiB segment, 17 MiB left > 1 MiB: split; the second 3 MiB fits.
    st = replay([(True, "a", 3 * MIB), (True, "b", 3 * MIB)])
    assert (st.reserved_bytes, st.allocated_bytes, st.segments) == (20 * MIB, 6 * MIB, 1)


def test_unsplit_tail_counts_as_allocated() -> None:
    # 11.5 MiB: a 12 MiB segment; 0.5 MiB left is not > 1 MiB: not split, and allocated_bytes
    # counts the whole 12 MiB block while the request was 11.5 MiB.
    st = replay([(True, "a", 11 * MIB + MIB // 2)])
    assert (st.reserved_bytes, st.allocated_bytes, st.requested_bytes) == (
        12 * MIB, 12 * MIB, 11 * MIB + MIB // 2,
    )  # fmt: skip


def test_split_remainder_is_reused_by_the_large_pool() -> None:
    # 10.5 MiB: 12 MiB segment, 1.5 MiB left > 1 MiB: split. 1.25 MiB (large pool) best-fits
    # the 1.5 MiB block; 0.25 MiB left is not > 1 MiB: the whole 1.5 MiB block is handed out.
    st = replay([(True, "a", 10 * MIB + MIB // 2), (True, "b", MIB + MIB // 4)])
    assert (st.reserved_bytes, st.segments) == (12 * MIB, 1)
    assert st.allocated_bytes == 12 * MIB
    assert st.requested_bytes == 11 * MIB + 3 * MIB // 4


FRAGMENTING = [
    (True, "a", 12 * MIB), (True, "b", 12 * MIB), (False, "a", 12 * MIB), (True, "c", 14 * MIB),
]  # fmt: skip


def test_a_freed_block_too_small_for_the_next_request_stays_reserved() -> None:
    # a, b: 12 MiB segments each (exact); a freed (12 MiB cached); c = 14 MiB does not fit:
    # a third segment. Reserved 38 MiB, peak allocated max(24, 26) = 26 MiB.
    st = replay(FRAGMENTING)
    assert (st.reserved_bytes, st.allocated_bytes, st.segments) == (38 * MIB, 26 * MIB, 3)
    assert st.fragmentation_bytes == 12 * MIB


def test_expandable_segments_map_20mib_pages_in_the_large_pool() -> None:
    # One large segment growing in 20 MiB pages (kLargeBuffer). a: map [0, 20), split ->
    # a [0, 12), free [12, 20). b: the free 8 MiB is too small: extend from 12: map to 40,
    # b [12, 24), free [24, 40). a freed: [0, 12) free (b is its neighbour). c = 14 MiB:
    # best fit is [24, 40) (16 MiB): c [24, 38). Reserved 40 MiB, one segment, peak 26 MiB.
    st = replay(FRAGMENTING, EXPANDABLE)
    assert (st.reserved_bytes, st.allocated_bytes, st.segments) == (40 * MIB, 26 * MIB, 1)


def test_expandable_small_pool_maps_2mib_pages() -> None:
    # Five 512 KiB requests (small pool, 2 MiB pages): four fill the first page exactly (the
    # last is not split: nothing left), the fifth maps a second page: [2, 2.5) MiB.
    events = [(True, i, 512 * 1024) for i in range(5)]
    st = replay(events, EXPANDABLE)
    assert (st.reserved_bytes, st.allocated_bytes, st.segments) == (4 * MIB, 5 * MIB // 2, 1)


def test_freed_neighbours_merge() -> None:
    # Two 1024 B blocks at the start of a 2 MiB segment, both freed: merged with the rest into
    # one 2 MiB block, so two 1 MiB requests fit in it. Without merging, the second 1 MiB
    # request would not fit (2 MiB - 2048 - 1 MiB < 1 MiB) and open a second segment.
    events = [(True, "a", 1024), (True, "b", 1024), (False, "a", 0), (False, "b", 0)]
    events += [(True, "c", MIB), (True, "d", MIB)]
    st = replay(events)
    assert (st.reserved_bytes, st.segments) == (2 * MIB, 1)


def test_max_split_size_keeps_small_requests_out_of_big_blocks() -> None:
    # max_split_size 4 MiB: 3 MiB opens a 20 MiB segment and is split (3 < 4, 17 > 1 left);
    # the 17 MiB free block is >= 4 MiB, so a 2 MiB request (< 4 MiB) may not use it: a
    # second 20 MiB segment. Unlimited (the default): one segment.
    events = [(True, "a", 3 * MIB), (True, "b", 2 * MIB)]
    capped = replay(events, AllocatorConfig(max_split_size_bytes=4 * MIB))
    assert (capped.reserved_bytes, capped.segments) == (40 * MIB, 2)
    assert replay(events).reserved_bytes == 20 * MIB


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="max_split_size_bytes"):
        AllocatorConfig(max_split_size_bytes=MIB)


def test_reserved_never_below_allocated() -> None:
    alloc = CachingAllocator()
    for i, n in enumerate((700, 5 * MIB, 33 * MIB, 1 << 12)):
        alloc.malloc(i, n)
    st = alloc.stats()
    assert st.reserved_bytes >= st.allocated_bytes >= st.requested_bytes


def _seq(*steps: tuple[str, int]) -> list[tuple[bool, object, int]]:
    """``("+a", n)`` allocates ``n`` MiB for ``a``; ``("-a", 0)`` frees it."""
    return [(k[0] == "+", k[1:], n * MIB) for k, n in steps]


# Four large requests, each freed before the next, none fitting a cached block: 12, 14, 16 MiB
# (each >= kMinLargeAlloc: a segment of its own size, get_allocation_size), then 30 MiB.
FOUR = _seq(("+a", 12), ("-a", 0), ("+b", 14), ("-b", 0), ("+c", 16), ("-c", 0), ("+d", 30))


def test_garbage_collection_frees_old_whole_segments_first() -> None:
    # garbage_collection_threshold 0.25 of allowed 60 MiB: collect above 15 MiB reserved.
    # get_free_block counts a call per malloc (collection on); a free block's age is the count
    # since it entered the pool (insert_into_blocks, Block::gc_count).
    # a: call 1, segment 12 (reserved 12); freed at count 1.
    # b: call 2, no fit; 12 <= 15: no collection; segment 14 -> 26; freed at count 2.
    # c: call 3, no fit; 26 > 15: target 11; ages A 2, B 1, average 1.5: A (12) released,
    #    12 >= 11, done: 14; segment 16 -> 30; freed at count 3.
    # d: call 4, no fit; 30 > 15: target 15; ages B 2, C 1, average 1.5: B released (14 < 15);
    #    a second pass, average over C alone 1: C released (30); segment 30 -> 30.
    config = AllocatorConfig(garbage_collection_threshold=0.25, allowed_bytes=60 * MIB)
    st = replay(FOUR, config)
    assert (st.reserved_bytes, st.segments) == (30 * MIB, 4)
    # without collection, the cap alone: d finds 42 + 30 > 60, release_cached_blocks frees
    # every whole cached segment (42 -> 0) and retries: 30; the peak was 42.
    capped = replay(FOUR, AllocatorConfig(allowed_bytes=60 * MIB))
    assert (capped.reserved_bytes, capped.segments) == (42 * MIB, 4)
    # no cap at all: every segment stays cached, 12 + 14 + 16 + 30
    assert replay(FOUR).reserved_bytes == 72 * MIB


def test_collection_keeps_young_blocks_when_one_pass_reclaims_enough() -> None:
    # allowed 100 MiB, threshold 0.4: collect above 40 MiB. a 30 (freed at count 1), b 40:
    # 30 <= 40, segment 40 -> 70 (freed at count 2). c 50: call 3; 70 > 40, target 30; ages
    # A 2, B 1, average 1.5: A (30) released, 30 >= 30: B stays; 40 + 50 = 90.
    steps = _seq(("+a", 30), ("-a", 0), ("+b", 40), ("-b", 0), ("+c", 50))
    config = AllocatorConfig(garbage_collection_threshold=0.4, allowed_bytes=100 * MIB)
    assert replay(steps, config).reserved_bytes == 90 * MIB


def test_a_request_beyond_the_allowed_memory_is_out_of_memory() -> None:
    # allowed 20 MiB: a (12) live, b (12): 24 > 20 and nothing cached to release
    with pytest.raises(AllocatorOutOfMemory, match="allowed"):
        replay(_seq(("+a", 12), ("+b", 12)), AllocatorConfig(allowed_bytes=20 * MIB))


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"garbage_collection_threshold": 0.5}, "allowed_bytes"),  # needs a memory fraction
        ({"garbage_collection_threshold": 1.0, "allowed_bytes": MIB}, "garbage_collection"),
        ({"allowed_bytes": 0}, "allowed_bytes"),
    ],
)
def test_collection_settings_are_validated(fields: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        AllocatorConfig(**fields)
