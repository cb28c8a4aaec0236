"""The CUDA caching-allocator model on small hand-made traces."""

from dataclasses import dataclass

from fitburst.memory.allocator import CachingAllocator, replay, round_size, segment_size

KiB, MiB = 1024, 1024 * 1024


@dataclass
class Ev:
    kind: str
    sid: int
    size: int


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(513) == 1024 and round_size(4096) == 4096
    assert segment_size(100) == 2 * MiB and segment_size(MiB) == 2 * MiB  # small pool: 2 MiB segments
    assert segment_size(MiB + 512) == 20 * MiB and segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 1) == 12 * MiB  # rounded to 2 MiB


def test_small_requests_share_a_two_mib_segment_and_split():
    a = CachingAllocator()
    a.malloc(700 * KiB)
    a.malloc(700 * KiB)
    assert a.reserved == 2 * MiB and a.segments == 1
    a.malloc(700 * KiB)  # 648 KiB left in the first segment: a new one
    assert a.reserved == 4 * MiB and a.segments == 2
    assert a.allocated == 3 * 700 * KiB


def test_large_pool_split_threshold_keeps_small_remainders_in_the_block():
    a = CachingAllocator()
    h = a.malloc(19 * MiB + 512 * KiB)  # 20 MiB segment; remainder 512 KiB <= 1 MiB: not split
    assert a.allocated == 20 * MiB
    a.free(h)
    a.malloc(2 * MiB)  # the whole free segment is reused and split (18 MiB remainder > 1 MiB)
    assert a.allocated == 2 * MiB and a.reserved == 20 * MiB
    a.malloc(18 * MiB)  # fits the remainder exactly
    assert a.reserved == 20 * MiB and a.segments == 1


def test_small_and_large_pools_do_not_share_segments():
    a = CachingAllocator()
    h = a.malloc(3 * MiB)  # large pool: 20 MiB segment with 17 MiB free
    a.free(h)
    a.malloc(64 * KiB)  # small request: never carved from the large pool
    assert a.segments == 2 and a.reserved == 22 * MiB


def test_free_blocks_merge_with_free_neighbours():
    a = CachingAllocator()
    x, y, z = (a.malloc(6 * MiB) for _ in range(3))  # one 20 MiB segment: 6+6+6, 2 MiB tail (kept: > 1 MiB)
    assert a.segments == 1
    a.free(x)
    a.free(z)  # z merges with the 2 MiB tail: 8 MiB free
    a.malloc(7 * MiB)  # fits only the merged 8 MiB block
    assert a.segments == 1
    a.free(y)  # merges: x's 6 MiB + y's 6 MiB (z's block is in use by the 7 MiB request)
    a.malloc(12 * MiB)
    assert a.segments == 1 and a.reserved == 20 * MiB


def test_best_fit_takes_the_smallest_block_that_fits():
    a = CachingAllocator()
    big = a.malloc(30 * MiB)  # own 30 MiB segment
    small = a.malloc(12 * MiB)  # own 12 MiB segment
    a.free(big)
    a.free(small)
    a.malloc(11 * MiB)  # 12 MiB block wins over the 30 MiB one
    a.malloc(25 * MiB)  # so this still fits without a new segment
    assert a.segments == 2 and a.reserved == 42 * MiB


def test_segments_are_never_released_and_peaks_follow_the_measured_step():
    ev = [Ev("alloc", 1, 40 * MiB), Ev("free", 1, 40 * MiB), Ev("alloc", 2, 12 * MiB), Ev("alloc", 3, 12 * MiB)]
    r = replay(ev, start=2)  # the warm-up made a 40 MiB segment; the measured step carves both requests from it
    assert r.peak_reserved == 40 * MiB and r.segments == 1
    assert r.peak_allocated == 24 * MiB  # the warm-up's 40 MiB peak is before the reset
    assert replay(ev).peak_allocated == 40 * MiB


def test_expandable_segments_grow_in_place():
    ev = [Ev("alloc", i, 6 * MiB) for i in range(5)]  # 30 MiB of 1-10 MiB requests
    default = replay(ev)
    exp = replay(ev, expandable=True)
    assert default.peak_reserved == 40 * MiB  # two 20 MiB segments (3 + 2 requests)
    assert exp.peak_reserved == 40 * MiB and exp.segments == 0  # pages of 20 MiB, one growing segment
    ev2 = [Ev("alloc", 1, 30 * MiB), Ev("free", 1, 30 * MiB), Ev("alloc", 2, 32 * MiB)]
    assert replay(ev2).peak_reserved == 62 * MiB  # a 30 MiB segment cannot hold 32 MiB: a new one
    assert replay(ev2, expandable=True).peak_reserved == 40 * MiB  # the free tail grows to fit


def test_placement_decides_ties_between_equal_free_blocks():
    for placement in ("ascending", "descending"):
        a = CachingAllocator(placement=placement)
        h1, h2 = a.malloc(12 * MiB), a.malloc(12 * MiB)  # two 12 MiB segments
        first, second = a.blocks[h1].addr, a.blocks[h2].addr
        a.free(h1)
        a.free(h2)
        h = a.malloc(5 * MiB)  # equal best fits: the lower address wins
        assert a.blocks[h].addr == min(first, second)
        assert (a.blocks[h].addr == first) == (placement == "ascending")


def test_empty_cache_returns_only_wholly_free_segments():
    a = CachingAllocator()
    keep = a.malloc(4 * MiB)  # a 20 MiB segment, partly in use
    gone = a.malloc(12 * MiB)  # a 12 MiB segment of its own
    small = a.malloc(100 * KiB)  # a 2 MiB small-pool segment
    for h in (gone, small):
        a.free(h)
    a.empty_cache()
    assert a.reserved == 20 * MiB and a.allocated == 4 * MiB  # the in-use segment stays whole
    a.malloc(17 * MiB)  # more than the 16 MiB left beside the block in use: a fresh segment (18 MiB)
    assert a.reserved == 38 * MiB
    a.free(keep)
    ev = [Ev("alloc", 1, 12 * MiB), Ev("free", 1, 12 * MiB), Ev("empty_cache", -1, 0), Ev("alloc", 2, 4 * MiB)]
    r = replay(ev, start=2)
    assert r.peak_reserved == 20 * MiB and r.reserved == 20 * MiB  # the 12 MiB segment went back before the step
    ex = CachingAllocator(expandable=True)
    h1, h2 = ex.malloc(30 * MiB), ex.malloc(15 * MiB)  # one large segment mapped in 20 MiB pages: 60 MiB
    ex.free(h2)
    ex.empty_cache()  # the free pages past the last block in use are unmapped
    assert ex.reserved == 40 * MiB
    ex.free(h1)
    ex.empty_cache()
    assert ex.reserved == 0
