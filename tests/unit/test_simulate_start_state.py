"""The state a replay starts from and the allocator calls that shape it (issue 35 item 3): ``replay._fill`` and
``replay._pieces`` (the start segments as pieces), the reservations ``AddressSpace`` and ``RecordedAddresses``
hand out, and ``CachingAllocator.add_segment``, ``unmap_block``, ``get_free_block``,
``release_available_cached_blocks`` on segments installed directly. Pure functions on values built here."""

from types import SimpleNamespace

import pytest

from oomdoctor.simulate.addresses import AddressSpace, RecordedAddresses
from oomdoctor.simulate.allocator import CachingAllocator
from oomdoctor.simulate.config import DEFAULT, parse_config
from oomdoctor.simulate.replay import _fill, _fresh_base, _pieces
from oomdoctor.trace.model import SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP

MiB = 1 << 20
P = 2 * MiB  # the small pool's page (kSmallBuffer)
L = 20 * MiB  # the large pool's page (kLargeBuffer)


def blk(addr, size, state="allocated", req=None, stream=0):
    return (stream, addr, size, size if req is None else req, state)


# ---- _fill ---------------------------------------------------------------------------------------------------

def test_fill_covers_a_range_with_its_blocks_and_the_gaps_between():
    blocks = [blk(0, 10), blk(100, 20, "pending", 15), blk(130, 10), blk(200, 5), blk(300, 5)]
    addrs = [b[1] for b in blocks]
    # [100, 200): the block at its start (no free piece before it), a gap, one ending inside; 200 is past the end
    assert _fill(100, 200, blocks, addrs) == [(100, 20, "pending", 15), (120, 10, "free", 0),
                                              (130, 10, "allocated", 10), (140, 60, "free", 0)]
    # [90, 140): a gap before the first block, the last one ends at the range's end: no free piece after it
    assert _fill(90, 140, blocks, addrs) == [(90, 10, "free", 0), (100, 20, "pending", 15), (120, 10, "free", 0),
                                             (130, 10, "allocated", 10)]
    assert _fill(20, 60, blocks, addrs) == [(20, 40, "free", 0)]  # no block inside
    assert _fill(0, 10, blocks, addrs) == [(0, 10, "allocated", 10)]
    for lo, hi in ((0, 10), (90, 140), (100, 200), (20, 60)):
        pieces = _fill(lo, hi, blocks, addrs)
        assert sum(p[1] for p in pieces) == hi - lo and all(p[1] > 0 for p in pieces)
        assert all(a[0] + a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


# ---- _pieces -------------------------------------------------------------------------------------------------

def seg(address, size, stype="large", stream=0, expandable=False):
    return SimpleNamespace(address=address, size=size, segment_type=stype, stream=stream, is_expandable=expandable)


def prepared(segments, blocks, total=None):
    return SimpleNamespace(start_segments=segments, start_blocks=sorted(blocks, key=lambda b: b[1]),
                           total_memory=total)


def test_pieces_of_plain_segments():
    a, b = seg(1000 * MiB, 20 * MiB), seg(2000 * MiB, 2 * MiB, "small", stream=1)
    p = prepared([a, b], [blk(1000 * MiB, 4 * MiB), blk(2000 * MiB + 512, 512, stream=1)])
    assert _pieces(p) == [
        (a, [(1000 * MiB, 4 * MiB, "allocated", 4 * MiB), (1004 * MiB, 16 * MiB, "free", 0)], None),
        (b, [(2000 * MiB, 512, "free", 0), (2000 * MiB + 512, 512, "allocated", 512),
             (2000 * MiB + 1024, 2 * MiB - 1024, "free", 0)], None)]


def test_pieces_of_expandable_ranges_make_one_reservation_per_pool_and_stream():
    base = 1 << 40
    r1, r2 = seg(base, 40 * MiB, expandable=True), seg(base + 100 * MiB, 20 * MiB, expandable=True)
    other = seg(base + (1 << 36), 4 * MiB, "small", expandable=True)
    p = prepared([r2, other, r1], [blk(base, 30 * MiB), blk(base + 110 * MiB, 10 * MiB, "pending")],
                 total=80 * MiB)
    out = _pieces(p)
    # va = 80 + 10 MiB = 90 MiB; the large range spans 120 MiB from its base: 120 MiB (6 pages of 20)
    assert out[0] == (r1, [(base, 30 * MiB, "allocated", 30 * MiB), (base + 30 * MiB, 10 * MiB, "free", 0),
                           (base + 40 * MiB, 60 * MiB, "unmapped", 0),
                           (base + 100 * MiB, 10 * MiB, "free", 0),
                           (base + 110 * MiB, 10 * MiB, "pending", 10 * MiB)], (base, 120 * MiB, L))
    # the small one: va 90 MiB rounded to its 2 MiB pages; mapped 4 MiB from its base, unmapped after
    assert out[1] == (other, [(other.address, 4 * MiB, "free", 0),
                              (other.address + 4 * MiB, 86 * MiB, "unmapped", 0)], (other.address, 90 * MiB, P))


def test_pieces_reservation_is_the_va_size_in_whole_pages_when_larger():
    base = 1 << 40
    r = seg(base, 20 * MiB, expandable=True)
    out = _pieces(prepared([r], [], total=100 * MiB + 1))  # va 112.5 MiB + 1 byte: 120 MiB in 20 MiB pages
    assert out == [(r, [(base, 20 * MiB, "free", 0), (base + 20 * MiB, 100 * MiB, "unmapped", 0)],
                    (base, 120 * MiB, L))]
    small = seg(base, 2 * MiB, "small", expandable=True)
    out = _pieces(prepared([small], [], total=100 * MiB + 1))  # 112.5 MiB + 1 byte: 114 MiB in 2 MiB pages
    assert out[0][2] == (base, 114 * MiB, P) and out[0][1][-1] == (base + 2 * MiB, 112 * MiB, "unmapped", 0)
    assert _pieces(prepared([r], []))[0][2] == (base, ((1 << 40) + L - 1) // L * L, L)  # GPU unknown: 1 TiB


def test_pieces_span_counts_the_last_ranges_size():
    # the last range is the largest: the reservation must reach its end (60 + 100 MiB from the base)
    base = 1 << 40
    r1, r2 = seg(base, 20 * MiB, expandable=True), seg(base + 60 * MiB, 100 * MiB, expandable=True)
    out = _pieces(prepared([r1, r2], [], total=8 * MiB))
    assert out[0][2] == (base, 160 * MiB, L)
    assert out[0][1] == [(base, 20 * MiB, "free", 0), (base + 20 * MiB, 40 * MiB, "unmapped", 0),
                         (base + 60 * MiB, 100 * MiB, "free", 0)]  # ends at the reservation's end: nothing after


# ---- reservations --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("va", "page", "size"), [(60 * MiB, L, 60 * MiB), (60 * MiB + 1, L, 80 * MiB),
                                                  (60 * MiB - 1, L, 60 * MiB), (3 * MiB, P, 4 * MiB)])
def test_address_space_reservation_is_whole_pages(va, page, size):
    space = AddressSpace(1 << 44, va)
    assert space.reservation(page, False, 0) == (1 << 44, size)
    assert space.reservation(page, False, 0) == ((1 << 44) + size, size)  # fresh addresses, 2 MiB aligned


def recorded_addresses(va, rec_seg, max_address=(1 << 40) + 5):
    p = SimpleNamespace(rec_seg=rec_seg, start_segments=[], max_address=max_address)
    return RecordedAddresses(_fresh_base(p), va, p.rec_seg, p.start_segments)


def test_recorded_reservations_follow_the_recorded_bases_then_go_fresh():
    a, b = 1 << 41, (1 << 41) + (1 << 36)
    rec = [(SEGMENT_MAP, a, L), (SEGMENT_ALLOC, 5 << 30, L), (SEGMENT_MAP, a + L, L),  # extends a's range
           (SEGMENT_UNMAP, a, L), (SEGMENT_MAP, b, 2 * L)]
    space = recorded_addresses(60 * MiB + 1, rec)
    assert space.bases == [a, b]
    assert space.reservation(L, False, 0) == (a, 80 * MiB)
    assert space.reservation(L, False, 0) == (b, 80 * MiB)
    fresh = (1 << 40) // (1 << 36) * (1 << 36) + (1 << 36)  # _fresh_base: past the highest recorded address
    assert space.reservation(L, False, 0) == (fresh, 80 * MiB)
    space = recorded_addresses(60 * MiB, rec)
    assert [space.reservation(L, False, 0)[1] for _ in range(3)] == [60 * MiB] * 3


# ---- add_segment, unmap_block ----------------------------------------------------------------------------------

BASE = 1 << 44


def expandable_model(pieces, size=10 * P):
    sim = CachingAllocator(parse_config("expandable_segments:True"))
    active = sim.add_segment(pieces, 0, True, (BASE, size, P))
    return sim, active


def test_add_segment_counts_each_kind_of_piece():
    sim, active = expandable_model([(BASE, P // 2, "allocated", 1000), (BASE + P // 2, P // 2, "pending", 900),
                                    (BASE + P, P, "free", 0), (BASE + 2 * P, 8 * P, "unmapped", 0)])
    assert sorted(active) == [BASE, BASE + P // 2]
    a, pend = active[BASE], active[BASE + P // 2]
    assert (a.allocated, a.event_count, a.requested, pend.allocated, pend.event_count, pend.requested) == (
        True, 0, 1000, False, 1, 900)
    assert list(sim.pending.values()) == [pend]
    assert (sim.reserved, sim.allocated, sim.requested, sim.peak_reserved, sim.peak_allocated) == (
        2 * P, P // 2, 1900, 2 * P, P // 2)
    assert [(p, b.size, b.mapped) for p, b in sim.small.unmapped[0]] == [(BASE + 2 * P, 8 * P, False)]
    free = pend.next
    assert (free.ptr, free.size, free.mapped, sim.small.by_key[free.key] is free) == (BASE + P, P, True, True)
    assert free.next.prev is free and free.next.segment is a.segment and a.segment.base == BASE
    assert sim.large.by_key == {} and sim.segment_events == []
    sim.check([a])


def test_add_segment_plain_is_no_reservation():
    sim = CachingAllocator(DEFAULT)
    active = sim.add_segment([(BASE, 4 * MiB, "allocated", 3 * MiB), (BASE + 4 * MiB, 16 * MiB, "free", 0)], 2, False)
    b = active[BASE]
    assert b.segment is None and b.stream == 2 and b.pool is sim.large and b.next.segment is None
    assert sim.large.lists[2] and sim.reserved == 20 * MiB and sim.allocated == 4 * MiB
    sim.check([b])


def test_unmap_block_keeps_mapped_slivers_on_both_sides():
    # allocated [0, P/2), free [P/2, 3.5P), allocated [3.5P, 4P), unmapped after: the pages [P, 3P) go
    sim, active = expandable_model([(BASE, P // 2, "allocated", 1), (BASE + P // 2, 3 * P, "free", 0),
                                    (BASE + 7 * P // 2, P // 2, "allocated", 1), (BASE + 4 * P, 6 * P, "unmapped", 0)])
    first, last = active[BASE], active[BASE + 7 * P // 2]
    b = first.next
    sim.unmap_block(b)
    assert sim.segment_events == [(SEGMENT_UNMAP, BASE + P, 2 * P)] and sim.reserved == 2 * P
    before, after = b.prev, b.next
    assert (before.ptr, before.size, before.mapped, b.ptr, b.size, b.mapped, after.ptr, after.size, after.mapped) == (
        BASE + P // 2, P // 2, True, BASE + P, 2 * P, False, BASE + 3 * P, P // 2, True)
    assert first.next is before and before.prev is first and after.next is last and last.prev is after
    assert before.segment is after.segment is first.segment and after.stream == 0 and after.pool is sim.small
    assert sorted(x.ptr for x in sim.small.by_key.values()) == [BASE + P // 2, BASE + 3 * P]
    assert [p for p, _ in sim.small.unmapped[0]] == [BASE + P, BASE + 4 * P]
    sim.check([first, last])


def test_unmap_block_merges_with_the_unmapped_pages_after_it():
    sim, active = expandable_model([(BASE, P // 2, "allocated", 1), (BASE + P // 2, 7 * P // 2, "free", 0),
                                    (BASE + 4 * P, 6 * P, "unmapped", 0)])
    first = active[BASE]
    b = first.next
    sim.unmap_block(b)
    assert sim.segment_events == [(SEGMENT_UNMAP, BASE + P, 3 * P)]
    assert [(p, x.size) for p, x in sim.small.unmapped[0]] == [(BASE + P, 9 * P)]  # one unmapped block to the end
    assert b.next is None and b.prev.ptr == BASE + P // 2 and b.prev.size == P // 2
    sim.check([first])


def test_unmap_block_merges_with_the_unmapped_pages_before_it():
    sim, active = expandable_model([(BASE, 2 * P, "unmapped", 0), (BASE + 2 * P, 3 * P, "free", 0),
                                    (BASE + 5 * P, P, "allocated", 1), (BASE + 6 * P, 4 * P, "unmapped", 0)])
    last = active[BASE + 5 * P]
    b = last.prev
    sim.unmap_block(b)
    assert [(p, x.size) for p, x in sim.small.unmapped[0]] == [(BASE, 5 * P), (BASE + 6 * P, 4 * P)]
    assert sim.reserved == P and sim.small.by_key == {}
    sim.check([last])


def test_unmap_block_within_one_page_does_nothing():
    sim, active = expandable_model([(BASE, P // 2, "allocated", 1), (BASE + P // 2, P, "free", 0),
                                    (BASE + 3 * P // 2, P // 2, "allocated", 1), (BASE + 2 * P, 8 * P, "unmapped", 0)])
    b = active[BASE].next
    sim.unmap_block(b)
    assert sim.segment_events == [] and sim.reserved == 2 * P and b.mapped and sim.small.by_key[b.key] is b


# ---- get_free_block, release_available_cached_blocks -----------------------------------------------------------

def test_get_free_block_looks_on_the_requests_stream():
    sim = CachingAllocator(DEFAULT)
    sim.add_segment([(BASE, 20 * MiB, "free", 0)], 1, False)
    assert sim.get_free_block(sim.large, 12 * MiB, 0) is None
    assert sim.get_free_block(sim.large, 22 * MiB, 1) is None  # too small
    b = sim.get_free_block(sim.large, 12 * MiB, 1)
    assert (b.ptr, b.size, b.stream) == (BASE, 20 * MiB, 1)


def cached(mss, sizes_mib):
    """Whole free segments of ``sizes_mib`` (MiB) in the large pool, under ``max_split_size_mb:mss``."""
    sim = CachingAllocator(parse_config(f"max_split_size_mb:{mss}") if mss else DEFAULT)
    ptrs = {}
    for k, m in enumerate(sizes_mib):
        ptrs[m] = BASE + k * (1 << 32)
        sim.add_segment([(ptrs[m], m * MiB, "free", 0)], 0, False)
    return sim, ptrs


def test_release_available_frees_the_smallest_oversize_block_that_is_enough():
    sim, ptrs = cached(100, [150, 120, 60, 200])
    assert sim.release_available_cached_blocks(sim.large, 130 * MiB, 0) is True
    assert sim.segment_events == [(SEGMENT_FREE, ptrs[150], 150 * MiB)]
    assert sim.reserved == (120 + 60 + 200) * MiB
    # a small request asks for max_split_size at least: the 120 MiB one
    assert sim.release_available_cached_blocks(sim.large, 10 * MiB, 0) is True
    assert sim.segment_events[1:] == [(SEGMENT_FREE, ptrs[120], 120 * MiB)]


def test_release_available_frees_from_the_largest_down_until_enough():
    sim, ptrs = cached(100, [150, 120, 60])
    assert sim.release_available_cached_blocks(sim.large, 200 * MiB, 0) is True
    assert sim.segment_events == [(SEGMENT_FREE, ptrs[150], 150 * MiB), (SEGMENT_FREE, ptrs[120], 120 * MiB)]
    assert sim.reserved == 60 * MiB


def test_release_available_stops_below_max_split_size_and_keeps_what_it_freed():
    sim, ptrs = cached(100, [150, 120, 60])
    assert sim.release_available_cached_blocks(sim.large, 300 * MiB, 0) is False
    assert sim.segment_events == [(SEGMENT_FREE, ptrs[150], 150 * MiB), (SEGMENT_FREE, ptrs[120], 120 * MiB)]
    assert sim.reserved == 60 * MiB  # the 60 MiB one is below max_split_size: kept
    assert sim.release_available_cached_blocks(sim.large, 300 * MiB, 1) is False  # nothing on stream 1


def test_release_available_needs_max_split_size():
    sim, _ = cached(None, [150, 120])
    assert sim.release_available_cached_blocks(sim.large, 100 * MiB, 0) is False
    assert sim.segment_events == [] and sim.reserved == 270 * MiB


def test_segment_alloc_is_the_grown_action():
    # what release_block undoes: a malloc that needs a segment records segment_alloc with its size
    sim = CachingAllocator(DEFAULT)
    b = sim.malloc(12 * MiB, 12 * MiB, 0)
    assert sim.segment_events == [(SEGMENT_ALLOC, b.ptr, 12 * MiB)]


def test_a_split_in_an_expandable_segment_keeps_the_segment_on_a_reused_block():
    # malloc reuses a merged-away Block for the front of a split (issue 38): it must carry the segment it lies in
    sim = CachingAllocator(parse_config("expandable_segments:True"))
    x = sim.malloc(512, 512, 0)
    y = sim.malloc(512, 512, 0)
    seg = x.segment
    assert seg is not None and y.segment is seg and not sim.spare
    sim.free(x)
    sim.free(y)  # merges with x's block and the rest: a Block goes spare
    assert sim.spare
    z = sim.malloc(1024, 1024, 0)
    assert z.segment is seg and z.next.segment is seg and (z.ptr, z.size) == (x.ptr, 1024)
    sim.check([z])
