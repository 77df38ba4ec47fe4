"""Analyses on traces built in code: lifetimes, timeline, anatomy identities, truncation, expandable."""

import numpy as np
import pytest
from builder import MiB, SnapBuilder

from oomdoctor import load
from oomdoctor.analysis import analyze, anatomy, find_steps, lifetimes, timeline
from oomdoctor.analysis.lifetimes import ALLOCATED_AT_START, PENDING_AT_START
from oomdoctor.analysis.rounding import allocation_size, divisions_table, round_size


def build(tmp_path, b: SnapBuilder, drop_first: int = 0):
    t = load(b.write(tmp_path / "rank0.pickle", drop_first))
    return t, t.primary


def test_deferred_free_lifetime_and_counters(tmp_path):
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    x = b.alloc(s, 0, 16 * MiB, requested=16 * MiB - 100)
    y = b.alloc(s, 16 * MiB, 8 * MiB)
    b.free(x, deferred=True)  # record_stream-ed: completion waits
    z = b.alloc(s, 32 * MiB, 4 * MiB)
    b.complete(x)
    b.free(y)
    t, dt = build(tmp_path, b)
    lt = lifetimes(t, dt)
    assert len(lt) == 3
    row = int(np.flatnonzero(lt.addr == x)[0])
    assert lt.free_completed[row] > lt.free_requested[row] + 1
    assert lt.deferred.sum() == 1
    tl = timeline(dt, lt)
    # after the deferred free_requested (event 3): allocated drops, active does not
    assert tl.at(3) == {"requested": 8 * MiB, "allocated": 8 * MiB, "active": 24 * MiB, "reserved": 64 * MiB}
    assert tl.peak_allocated == (24 * MiB, 2)
    assert int(tl.active.max()) == 28 * MiB and int(tl.active.argmax()) == 4
    assert tl.peak_reserved == (64 * MiB, 1)  # the segment (event 0) for the alloc (event 1): after it
    # rounding: requested 16 MiB - 100 -> block of 16 MiB
    assert tl.at(2)["allocated"] - tl.at(2)["requested"] == 100
    end = tl.at(dt.num_events - 1)
    assert end["allocated"] == 4 * MiB == sum(bl.size for _, bl in dt.blocks if bl.is_allocated)
    assert z in lt.addr.tolist()


@pytest.mark.parametrize("k", [-1, 0, 1, 2, 3, 4, 5, 6, 7])
def test_anatomy_identity_at_every_event(tmp_path, k):
    b = SnapBuilder()
    s1 = b.segment(64 * MiB)
    s2 = b.segment(20 * MiB)
    a = b.alloc(s1, 0, 8 * MiB, requested=8 * MiB - 512)
    c = b.alloc(s1, 40 * MiB, 8 * MiB)
    b.free(a, deferred=True)
    b.alloc(s2, 0, 2 * MiB)
    t, dt = build(tmp_path, b)
    # segment, segment, alloc a, alloc c, free_requested a (deferred), alloc: six events
    assert dt.num_events == 6
    at = min(k, dt.num_events - 1)
    an = anatomy(dt, lifetimes(t, dt), at)
    an.check()
    assert an.unattributed_bytes == 0
    allocated = {-1: 0, 0: 0, 1: 0, 2: 8, 3: 16, 4: 8, 5: 10}[at] * MiB
    assert an.allocated_bytes == allocated
    assert an.pending_free_bytes == (8 * MiB if at >= 4 else 0)
    assert an.reserved_bytes == {-1: 0, 0: 64 * MiB}.get(at, 84 * MiB)
    assert an.rounding_waste_bytes == (512 if at in (2, 3) else 0)  # a's tail while it is allocated
    assert c == b.segments[s1].blocks[c].addr


def test_anatomy_numbers(tmp_path):
    b = SnapBuilder()
    s1 = b.segment(64 * MiB)
    b.segment(20 * MiB)  # stays empty: a whole free segment
    a = b.alloc(s1, 0, 8 * MiB, requested=8 * MiB - 512)
    b.alloc(s1, 40 * MiB, 8 * MiB)
    b.free(a, deferred=True)
    t, dt = build(tmp_path, b)
    an = anatomy(dt, lifetimes(t, dt), dt.num_events - 1)
    assert an.reserved_bytes == 84 * MiB
    assert an.requested_bytes == 8 * MiB
    assert an.rounding_waste_bytes == 0
    assert an.pending_free_bytes == 8 * MiB
    assert an.free_in_used_segments_bytes == 48 * MiB
    assert an.free_segments_bytes == 20 * MiB
    # gaps in s1: [8, 40) = 32 MiB and [48, 64) = 16 MiB; the empty segment is 20 MiB
    assert an.largest_free_block_bytes == 32 * MiB
    assert an.largest_free_block(0, "large") == 32 * MiB
    # at the start nothing was allocated and nothing reserved
    start = anatomy(dt, lifetimes(t, dt), -1)
    assert start.reserved_bytes == 0 and start.segments == 0


def test_truncated_trace_reconstructs_the_start(tmp_path):
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    early = b.alloc(s, 0, 16 * MiB)  # its alloc will be dropped
    ghost = b.alloc(s, 16 * MiB, 8 * MiB)  # never appears again: a ghost at the end
    pending = b.alloc(s, 32 * MiB, 4 * MiB)
    b.free(pending, deferred=True)
    b.free(early)
    b.complete(pending)
    late = b.alloc(s, 0, 4 * MiB)
    t, dt = build(tmp_path, b, drop_first=5)  # keep: free_requested(early) onward
    lt = lifetimes(t, dt)
    assert lt.truncated
    assert lt.unmatched_frees == 2  # early's free_requested and pending's free_completed
    assert lt.ghost_blocks == 1
    by_addr = {int(a): i for i, a in enumerate(lt.addr)}
    assert lt.start_state[by_addr[early]] == ALLOCATED_AT_START
    assert lt.start_state[by_addr[pending]] == PENDING_AT_START
    assert lt.start_state[by_addr[ghost]] == ALLOCATED_AT_START
    tl = timeline(dt, lt)
    assert tl.reserved_start == 64 * MiB  # segment_alloc was dropped: reserved comes from the final state
    assert tl.allocated_start == 24 * MiB and tl.active_start == 28 * MiB
    assert tl.at(dt.num_events - 1)["allocated"] == 12 * MiB
    anatomy(dt, lt, -1).check()
    rows = np.flatnonzero(lt.addr == late)  # early's address, reused
    assert len(rows) == 2 and sorted(lt.alloc[rows].tolist()) == [-1, dt.num_events - 1]
    assert lt.size[rows[lt.alloc[rows] >= 0][0]] == 4 * MiB  # the last event made it


def _masks_by_definition(lt, k):
    """alive_mask / allocated_mask as their docstrings define them, element by element in NumPy (the form before
    the precomputed spans)."""
    born = (lt.alloc <= k) & ((lt.alloc >= 0) | (lt.start_state != 0))
    alive = born & ((lt.free_completed > k) | (lt.free_completed < 0))
    not_freed = (lt.free_requested > k) | ((lt.free_requested < 0) & (lt.start_state != PENDING_AT_START))
    return alive, alive & not_freed


def test_masks_match_their_definition_on_a_truncated_trace(tmp_path):
    """Every state a block can start in (in the trace, allocated or pending at the start, a ghost), at every event."""
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    early = b.alloc(s, 0, 16 * MiB)
    b.alloc(s, 16 * MiB, 8 * MiB)
    pending = b.alloc(s, 32 * MiB, 4 * MiB)
    b.free(pending, deferred=True)
    b.free(early)
    b.complete(pending)
    x = b.alloc(s, 0, 4 * MiB)
    b.free(x, deferred=True)
    b.alloc(s, 40 * MiB, 2 * MiB)
    t, dt = build(tmp_path, b, drop_first=5)
    lt = lifetimes(t, dt)
    assert set(lt.start_state.tolist()) == {0, ALLOCATED_AT_START, PENDING_AT_START}
    for k in range(-1, dt.num_events + 1):
        alive, allocated = _masks_by_definition(lt, k)
        assert np.array_equal(lt.alive_mask(k), alive) and np.array_equal(lt.allocated_mask(k), allocated), k


def test_masks_match_their_definition_on_real_snapshots(snapshots):
    for path in sorted(snapshots.glob("*/rank0.pickle")):
        t = load(path)
        lt = lifetimes(t, t.primary)
        n = t.primary.num_events
        for k in sorted({-1, 0, n // 3, n // 2, n - 1, *np.linspace(0, n - 1, 25, dtype=int).tolist()}):
            alive, allocated = _masks_by_definition(lt, k)
            assert np.array_equal(lt.alive_mask(k), alive), (path, k)
            assert np.array_equal(lt.allocated_mask(k), allocated), (path, k)


def test_expandable_segments_map_and_unmap(tmp_path):
    b = SnapBuilder()
    b.settings["expandable_segments"] = True
    s = b.segment(40 * MiB, expandable=True)
    a = b.alloc(s, 0, 30 * MiB)
    b.free(a)
    t, dt = build(tmp_path, b)
    tl = timeline(dt, lifetimes(t, dt))
    assert tl.peak_reserved == (40 * MiB, 1)  # the map (event 0) then the alloc it was for (event 1)
    an = anatomy(dt, lifetimes(t, dt), 1)
    an.check()
    assert an.pools[0].is_expandable and an.allocated_bytes == 30 * MiB


def test_round_size_matches_the_allocator():
    # CUDACachingAllocator.cpp round_size / roundup_power2_next_division; caching_allocator_spec.md §1.2
    sizes = np.array([1, 511, 512, 513, 1200, 5 * MiB + 1, 104857600])
    assert round_size(sizes).tolist() == [512, 512, 512, 1024, 1536, 5 * MiB + 512, 104857600]
    t4 = divisions_table({"roundup_power2_divisions": {str(1 << i): 4 for i in range(16)}})
    assert round_size(np.array([1200, 5 * MiB + 1]), t4).tolist() == [1536, 6 * MiB]
    t8 = divisions_table({"roundup_power2_divisions": {str(1 << i): 8 for i in range(16)}})
    assert round_size(np.array([104857600, 64 * MiB]), t8).tolist() == [109051904, 64 * MiB]
    assert allocation_size(512) == 2 * MiB and allocation_size(MiB + 512) == 20 * MiB
    assert allocation_size(15 * MiB) == 16 * MiB


def test_steps_from_sidecar_markers_never_from_repetition(tmp_path):
    """Code that repeats (layers of one forward pass) is not a step: only markers, optimizer
    annotations or optimizer frames are (tests/unit/test_accounting.py has those)."""
    b = SnapBuilder()
    s = b.segment(256 * MiB)
    times = []
    for step in range(5):
        times.append(b.t)
        addrs = [b.alloc(s, i * 8 * MiB, 8 * MiB, fr=[{"filename": "/w/train.py", "line": 20 + i, "name": "f"}])
                 for i in range(4)]
        for x in addrs:
            b.free(x)
    t, dt = build(tmp_path, b)
    assert find_steps(t, dt) is None
    t.meta["step_markers"] = [{"step": i, "time_us": tm} for i, tm in enumerate(times)]
    st = find_steps(t, dt)
    assert st.source == "markers" and st.starts.tolist() == [1, 13, 25, 37, 49]


def test_analyze_without_history(tmp_path):
    b = SnapBuilder()
    s = b.segment(20 * MiB, record=False)
    b.alloc(s, 0, 4 * MiB, record=False)
    snap = b.snapshot()
    snap["device_traces"] = [[]]
    import pickle

    p = tmp_path / "state.pickle"
    p.write_bytes(pickle.dumps(snap))
    a = analyze(load(p))
    assert a.peak_reserved == (20 * MiB, -1)
    assert a.peak_allocated == (4 * MiB, -1)
    a.anatomy_at(-1).check()


def test_site_is_the_first_frame_outside_torch_and_the_stdlib(tmp_path):
    from builder import frames

    from oomdoctor.analysis.sites import NO_STACK, PRE_TRACE, is_internal, site_label, sites_at

    assert is_internal(("/opt/torch/.venv/lib/python3.12/site-packages/torch/nn/modules/linear.py", 1, "f"))
    assert is_internal(("/usr/lib/python3.12/contextlib.py", 1, "f"))
    assert is_internal(("at::native::mm", 0, "??"))
    assert not is_internal(("/opt/torch/.venv/lib/python3.12/site-packages/transformers/x.py", 1, "f"))
    assert not is_internal(("/opt/torch/train.py", 1, "main"))  # a user path containing "torch/" is user code
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    b.alloc(s, 0, 8 * MiB, record=False, fr=[])  # before recording: the final block has no frames
    b.alloc(s, 8 * MiB, 4 * MiB, fr=frames(("/v/site-packages/torch/nn/functional.py", 5, "linear"),
                                        ("/w/model.py", 12, "forward"), ("/w/train.py", 3, "main")))
    b.alloc(s, 16 * MiB, 2 * MiB, fr=[])
    t, dt = build(tmp_path, b)
    got = {site_label(t, x.frame): (x.bytes, x.count) for x in sites_at(t, lifetimes(t, dt), dt.num_events - 1)}
    assert got == {"/w/model.py:12 in forward": (4 * MiB, 1), "<allocated before recording started>": (8 * MiB, 1),
                   "<no stack recorded>": (2 * MiB, 1)}
    assert {site_label(t, PRE_TRACE), site_label(t, NO_STACK)} == {"<allocated before recording started>",
                                                                  "<no stack recorded>"}


def test_private_pools_are_their_own_group(tmp_path):
    b = SnapBuilder()
    s1 = b.segment(20 * MiB)
    s2 = b.segment(20 * MiB)
    b.alloc(s1, 0, 4 * MiB)
    b.alloc(s2, 0, 2 * MiB)
    snap = b.snapshot()
    snap["segments"][1]["segment_pool_id"] = (1, 3)  # a CUDA graph / MemPool private pool
    import pickle

    p = tmp_path / "rank0.pickle"
    p.write_bytes(pickle.dumps(snap))
    t = load(p)
    an = anatomy(t.primary, lifetimes(t, t.primary), t.primary.num_events - 1)
    an.check()
    by_pool = {g.pool_id: g for g in an.pools}
    assert by_pool[(1, 3)].requested_bytes == 2 * MiB and by_pool[(0, 0)].requested_bytes == 4 * MiB
