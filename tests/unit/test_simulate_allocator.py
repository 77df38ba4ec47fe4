"""The allocator model's rules, pinned to values that follow from c10/cuda/CUDACachingAllocator.cpp.

Function names below are the ones in that file (PyTorch 2.9-2.11; the 2026 main copy "V-C" of
shared/reference/caching_allocator_spec.md); each test names the rule it pins.
"""

import numpy as np
import pytest

from oomdoctor.analysis.rounding import round_size
from oomdoctor.simulate.allocator import KEY_SHIFT, CachingAllocator
from oomdoctor.simulate.config import AllocatorConfig, parse_config
from oomdoctor.trace.model import SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP

MiB = 1 << 20
KiB = 1 << 10


def sim(conf: str = "", **kw) -> CachingAllocator:
    return CachingAllocator(parse_config(conf), **kw)


def malloc(a: CachingAllocator, requested: int, stream: int = 0, conf: AllocatorConfig | None = None):
    table = np.asarray((conf or a.config).roundup_power2_divisions, dtype=np.int64)
    size = int(round_size(np.array([requested], dtype=np.int64), table)[0])
    return a.malloc(size, requested, stream)


def segs(a: CachingAllocator) -> list[tuple[int, int]]:
    return [(act, size) for act, _addr, size in a.segment_events]


# ---- round_size (round_size, roundup_power2_next_division) --------------------------------------

@pytest.mark.parametrize("divisions, requested, expected", [
    (0, 1, 512),                      # size < kMinBlockSize -> 512
    (0, 1200, 1536),                  # 512-multiple
    (4, 1200, 1536),                  # d=4: 1200 <= 512*4, so plain 512 rounding (spec 1.2 example)
    (4, 5 * MiB + 1, 6 * MiB),        # d=4 in [4, 8) MiB: steps of 1 MiB
    (8, 104857600, 109051904),        # d=8, 100 MB in [64, 128) MiB: steps of 8 MiB -> 104 MiB
    (4, 8 * MiB, 8 * MiB),            # a power of two is returned as is
    (1, 5 * MiB + 1, 5 * MiB + 512),  # divisions 1 behaves as 512 rounding (PR #126830)
])
def test_round_size(divisions, requested, expected):
    a = sim(f"roundup_power2_divisions:{divisions}" if divisions else "")
    b = malloc(a, requested)
    assert b.size == expected
    table = np.full(16, divisions, dtype=np.int64)
    assert int(round_size(np.array([requested]), table)[0]) == expected


# ---- get_allocation_size and get_pool -------------------------------------------------------------

@pytest.mark.parametrize("requested, segment", [
    (1 * KiB, 2 * MiB),      # <= kSmallSize (1 MiB): a kSmallBuffer segment in the small pool
    (1 * MiB, 2 * MiB),      # exactly 1 MiB is still small
    (5 * MiB, 20 * MiB),     # < kMinLargeAlloc (10 MiB): kLargeBuffer
    (15 * MiB, 16 * MiB),    # >= 10 MiB: rounded up to kRoundLarge (2 MiB), not 20 MiB
    (10 * MiB, 10 * MiB),
])
def test_segment_sizes(requested, segment):
    a = sim()
    malloc(a, requested)
    assert segs(a) == [(SEGMENT_ALLOC, segment)]


# ---- should_split ------------------------------------------------------------------------------------

def test_large_block_keeps_a_remainder_up_to_1mib():
    a = sim()
    b = malloc(a, 19 * MiB + 512 * KiB)  # 20 MiB segment, remainder 0.5 MiB <= kSmallSize: not split
    assert b.size == 20 * MiB and b.next is None
    a2 = sim()
    malloc(a2, 5 * MiB)         # 20 MiB segment: 5 MiB + a free 15 MiB remainder
    b2 = malloc(a2, 13 * MiB)   # from the 15 MiB block, remainder 2 MiB > 1 MiB: split
    assert b2.size == 13 * MiB and b2.next.size == 2 * MiB
    a3 = sim()
    malloc(a3, 5 * MiB)
    b3 = malloc(a3, 14 * MiB)   # remainder exactly 1 MiB: not split (strictly greater is required)
    assert b3.size == 15 * MiB and len(a3.segment_events) == 1


def test_small_pool_splits_at_512_bytes():
    a = sim()
    b = malloc(a, 1000)
    assert b.size == 1024 and b.next.size == 2 * MiB - 1024
    c = malloc(a, 512)
    assert c.ptr == b.ptr + 1024  # the front of the remainder


def test_expandable_splits_large_blocks_at_512_bytes():
    a = sim("expandable_segments:True")
    b = malloc(a, 19 * MiB + 512 * KiB)
    assert b.size == 19 * MiB + 512 * KiB


# ---- get_free_block: best fit, streams, oversize ---------------------------------------------------

def test_best_fit_smallest_then_lowest_address():
    a = sim()
    x = malloc(a, 40 * MiB)
    y = malloc(a, 30 * MiB)
    z = malloc(a, 30 * MiB)
    y_ptr, z_ptr = y.ptr, z.ptr
    a.free(x)
    a.free(z)
    a.free(y)
    # free: 40 MiB at x, 30 MiB at y and at z (separate segments): a 25 MiB request takes the lower 30 MiB
    w = malloc(a, 25 * MiB)
    assert w.ptr == min(y_ptr, z_ptr) and len(a.segment_events) == 3


def test_blocks_are_not_reused_across_streams():
    a = sim()
    x = malloc(a, 40 * MiB, stream=1)
    a.free(x)
    malloc(a, 40 * MiB, stream=2)
    assert segs(a) == [(SEGMENT_ALLOC, 40 * MiB)] * 2


def test_oversize_blocks_serve_only_large_requests_within_20mib():
    a = sim("max_split_size_mb:200")
    x = malloc(a, 300 * MiB)
    a.free(x)
    small = malloc(a, 100 * MiB)       # request < max_split_size, best fit >= max_split_size: refused
    assert small.ptr != x.ptr and len(a.segment_events) == 2
    within = malloc(a, 290 * MiB)      # 300 < 290 + 20: taken whole, never split
    assert within.ptr == x.ptr and within.size == 300 * MiB and within.next is None
    a.free(within)
    beyond = malloc(a, 250 * MiB)      # 300 >= 250 + 20: refused
    assert beyond.ptr != x.ptr and len(a.segment_events) == 3


def test_max_non_split_rounding_widens_the_tolerance():
    a = sim("max_split_size_mb:200,max_non_split_rounding_mb:64")
    x = malloc(a, 300 * MiB)
    a.free(x)
    assert malloc(a, 250 * MiB).ptr == x.ptr  # 300 < 250 + 64


# ---- free_block: merging ---------------------------------------------------------------------------

def test_free_merges_neighbours_but_not_pending_ones():
    a = sim()
    p, q, r = malloc(a, 4 * MiB), malloc(a, 4 * MiB), malloc(a, 4 * MiB)  # one 20 MiB segment
    assert q.ptr == p.ptr + 4 * MiB and r.ptr == q.ptr + 4 * MiB
    p_ptr = p.ptr
    a.free(q, deferred=True)   # record_stream: pending free
    a.free(p)
    assert p.next is q         # p does not merge with the pending q
    a.complete(q)
    malloc(a, 4000)            # any malloc runs process_events
    assert a.active == r.size + 4096    # q is back (the small request went to its own 2 MiB segment)
    assert q.ptr == p_ptr and q.size == 8 * MiB and q.next is r  # ...merged with the free p before it
    a.check([r])


# ---- malloc fallbacks and capacity ------------------------------------------------------------------

def test_release_cached_blocks_then_retry_under_a_fraction_cap():
    a = sim(fraction_limit=100 * MiB)
    x = malloc(a, 60 * MiB)
    a.free(x)                              # 60 MiB cached, nothing allocated
    y = malloc(a, 80 * MiB)                # 60 + 80 > 100: cudaMalloc refused, cache released, retried
    assert y is not None and a.num_alloc_retries == 1
    assert segs(a) == [(SEGMENT_ALLOC, 60 * MiB), (SEGMENT_FREE, 60 * MiB), (SEGMENT_ALLOC, 80 * MiB)]
    assert malloc(a, 30 * MiB) is None     # 80 allocated + 30 > 100, nothing to release: OOM
    assert a.oom_request == (30 * MiB, 30 * MiB)


def test_no_search_after_release_cached_blocks():
    # issue #189504: blocks returned by synchronize_and_free_events are not searched; only cudaMalloc is
    # retried, so a request can OOM while a fitting block sits in the pool.
    a = sim(fraction_limit=100 * MiB)
    x = malloc(a, 40 * MiB)                # 60 MiB would be split: x + a free 20 MiB...
    a.free(x)
    x = malloc(a, 40 * MiB)
    y = malloc(a, 20 * MiB)
    a.free(malloc(a, 20 * MiB))
    assert len(a.segment_events) == 3 and a.reserved == 80 * MiB
    a2 = sim(fraction_limit=100 * MiB)
    s = malloc(a2, 60 * MiB)               # a 60 MiB segment...
    a2.free(s)
    x2 = malloc(a2, 40 * MiB)              # ...split: 40 MiB + a free 20 MiB remainder
    y2 = malloc(a2, 20 * MiB)              # takes the remainder: the segment is full
    z2 = malloc(a2, 30 * MiB)              # a new 30 MiB segment: reserved 90
    y2_ptr = y2.ptr
    a2.free(y2, deferred=True)             # 20 MiB pending inside the first segment
    assert malloc(a2, 20 * MiB) is None    # 90 + 20 > 100; the sync frees y2 but nothing is whole-free
    assert a2.num_alloc_retries == 1 and a2.reserved == 90 * MiB
    assert a2.large.by_key[(20 * MiB << KEY_SHIFT) | y2_ptr].size == 20 * MiB  # the fitting block is in the pool
    assert x2.allocated and z2.allocated and y.allocated


def test_release_available_cached_blocks_frees_oversize_first():
    a = sim("max_split_size_mb:100", fraction_limit=700 * MiB)
    b1, b2 = malloc(a, 150 * MiB), malloc(a, 400 * MiB)
    a.free(b1)
    a.free(b2)
    # 300 MiB: the 400 MiB block is refused (400 >= 300 + 20); 550 + 300 > 700: the smallest oversize
    # block >= 300 MiB is released alone, and the cudaMalloc is tried again (not a retry)
    c = malloc(a, 300 * MiB)
    assert c is not None and a.num_alloc_retries == 0
    assert segs(a)[2:] == [(SEGMENT_FREE, 400 * MiB), (SEGMENT_ALLOC, 300 * MiB)]


def test_release_available_cached_blocks_frees_several_from_the_largest():
    a = sim("max_split_size_mb:100", fraction_limit=500 * MiB)
    b1, b2 = malloc(a, 150 * MiB), malloc(a, 200 * MiB)
    a.free(b1)
    a.free(b2)
    c = malloc(a, 300 * MiB)  # no single block >= 300: free from the largest down until 300 MiB are freed
    assert c is not None and a.num_alloc_retries == 0
    assert segs(a)[2:] == [(SEGMENT_FREE, 200 * MiB), (SEGMENT_FREE, 150 * MiB), (SEGMENT_ALLOC, 300 * MiB)]


def test_device_limit_counts_segments():
    a = sim(device_limit=50 * MiB)
    assert malloc(a, 30 * MiB) is not None
    assert malloc(a, 30 * MiB) is None


# ---- garbage_collect_cached_blocks ---------------------------------------------------------------

def test_gc_frees_old_whole_segments_above_the_threshold():
    a = sim("garbage_collection_threshold:0.3", fraction_limit=200 * MiB)
    old = malloc(a, 60 * MiB)
    a.free(old)
    for _ in range(4):                  # large-pool get_free_block calls (another stream) age the old block
        a.free(malloc(a, 10 * MiB, stream=1))
    # 100 MiB misses; reserved 70 > 0.3 * 200: GC frees whole free segments at least as old as the
    # average (the 60 MiB block, age 5; not the 10 MiB one, age 1) before cudaMalloc
    big = malloc(a, 100 * MiB)
    assert big is not None and a.num_alloc_retries == 0
    assert segs(a) == [(SEGMENT_ALLOC, 60 * MiB), (SEGMENT_ALLOC, 10 * MiB), (SEGMENT_FREE, 60 * MiB),
                       (SEGMENT_ALLOC, 100 * MiB)]


def test_gc_is_off_without_a_fraction_cap():
    a = sim("garbage_collection_threshold:0.5")
    a.free(malloc(a, 60 * MiB))
    malloc(a, 100 * MiB)
    assert not any(act == SEGMENT_FREE for act, _ in segs(a))


# ---- expandable segments ---------------------------------------------------------------------------

def test_expandable_maps_20mib_pages_and_grows_in_place():
    a = sim("expandable_segments:True")
    b = malloc(a, 1536 * KiB)            # spec 7.2 example: a 1.5 MiB request maps 20 MiB
    assert segs(a) == [(SEGMENT_MAP, 20 * MiB)]
    c = malloc(a, 30 * MiB)              # grows from the free tail: maps only the missing pages
    assert c.ptr == b.ptr + b.size
    assert segs(a)[1] == (SEGMENT_MAP, 20 * MiB) and a.reserved == 40 * MiB
    a.free(c)
    a.empty_cache()                      # unmap whole free pages, keep the mapped sliver
    assert segs(a)[-1][0] == SEGMENT_UNMAP and a.reserved == 20 * MiB
    a.check([b])


def test_expandable_small_pool_uses_2mib_pages():
    a = sim("expandable_segments:True")
    malloc(a, 4000)
    assert segs(a) == [(SEGMENT_MAP, 2 * MiB)]


# ---- deferred frees ---------------------------------------------------------------------------------

def test_deferred_free_holds_the_block_until_process_events():
    a = sim()
    x = malloc(a, 12 * MiB)
    a.free(x, deferred=True)
    y = malloc(a, 12 * MiB)            # x still pending: a new segment
    assert y.ptr != x.ptr and a.active == 24 * MiB
    a.complete(x)
    assert a.active == 24 * MiB        # returned only at the next malloc's process_events
    z = malloc(a, 12 * MiB)
    assert z.ptr == x.ptr and len(a.segment_events) == 2


def test_no_room_left_in_the_address_space_is_a_failed_cudamalloc():
    """A segment past the end of the 64-bit address space is a cudaMalloc that fails (an OOM), not an
    exception: a fuzzed size past the address space was an OverflowError, then a KeyError in get_free_block."""
    from oomdoctor.simulate.addresses import ADDRESS_END, AddressSpace
    a = CachingAllocator(parse_config(""), addresses=AddressSpace(ADDRESS_END - 2 * MiB, 1 << 40))
    assert malloc(a, 512) is not None               # a 2 MiB small segment: the last 2 MiB of addresses
    assert malloc(a, 3 * MiB) is None               # a 20 MiB segment: no addresses left
    assert a.oom_request == (3 * MiB, 20 * MiB) and a.reserved == 2 * MiB


def test_a_recorded_address_held_by_a_live_segment_is_not_handed_out_again(tmp_path):
    """A recording whose segments overlap (two segment_alloc at one address, no free between) would put two
    free blocks under one free-list key (a KeyError in get_free_block); the replay stops following the
    recorded addresses there and takes fresh ones."""
    import pickle

    from builder import SnapBuilder

    from oomdoctor import load
    from oomdoctor.simulate.whatif import simulate
    b = SnapBuilder()
    s1 = b.segment(20 * MiB)
    x = b.alloc(s1, 0, 20 * MiB)
    s2 = b.segment(20 * MiB)
    y = b.alloc(s2, 0, 20 * MiB)
    b.free(x)
    b.free(y)
    b.alloc(s1, 0, 20 * MiB)
    b.alloc(s2, 0, 20 * MiB)
    snap = b.snapshot()
    for e in snap["device_traces"][0]:
        if e["addr"] == s2:
            e["addr"] = s1
    snap["segments"] = [g for g in snap["segments"] if g["address"] != s2]
    p = tmp_path / "overlap.pickle"
    p.write_bytes(pickle.dumps(snap))
    r = simulate(load(p)).self_replay
    # the second alloc at s1 hides the first (its free frees the second, the next free is skipped): 60 MiB
    assert r.oom is None and r.peak_allocated_bytes == 60 * MiB
    assert any("1 frees of blocks the replay does not hold" in w for w in r.warnings)


# ---- Block objects reused (issue 38: CachingAllocator.spare) -----------------------------------------

def test_a_block_merged_away_is_reused_by_the_next_split_and_the_counts_hold():
    a = sim()
    x = malloc(a, 4 * MiB)              # a 20 MiB segment split: x, then the 16 MiB remainder r
    r = x.next
    a.free(x)                           # x absorbs r: r is merged away, kept for reuse
    assert a.spare == [r] and x.size == 20 * MiB
    base = x.ptr
    y = malloc(a, 6 * MiB)              # the split's front part is r's object, made over
    assert y is r and (y.ptr, y.size, y.allocated, y.next) == (base, 6 * MiB, True, x) and a.spare == []
    assert (x.ptr, x.size, x.prev) == (base + 6 * MiB, 14 * MiB, y)
    a.check([y])                        # chains, free lists (keys) and byte counts hold
    assert (a.allocated, a.active, a.requested) == (6 * MiB, 6 * MiB, 6 * MiB)


def test_active_counts_allocated_and_pending_blocks():
    a = sim()
    x, y = malloc(a, 12 * MiB), malloc(a, 30 * MiB)
    a.free(x, deferred=True)
    assert (a.allocated, a.active) == (30 * MiB, 42 * MiB)
    a.free(y)
    assert (a.allocated, a.active) == (0, 12 * MiB)
    a.complete(x)
    malloc(a, 1 * MiB)                  # process_events returns x
    assert a.active == a.allocated == 1 * MiB
