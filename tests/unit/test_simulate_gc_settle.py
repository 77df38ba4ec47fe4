"""The GC rule, the address rule of a self-replay and ``settle_capacity``, on small traces built in code.

Every expected number is derived by hand from ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.9-2.11):

- ``get_free_block`` adds one to the request pool's ``get_free_blocks_call_count`` on every call (hit or
  miss) while a fraction is set and ``garbage_collection_threshold`` > 0;
- ``insert_into_blocks`` sets ``gc_count_base`` to that count, so a block's age (``gc_count()``) is the
  calls since it was last put back;
- ``garbage_collect_cached_blocks`` (after a miss, before ``alloc_block``): nothing while
  ``total_allocated_memory <= threshold * allowed_memory_maximum``; else, over the large pool's whole free
  blocks (``!is_split()``), passes that free every one at least as old as the average, in (stream, size,
  address) order, the average recomputed over those left, until the excess is freed or a pass frees none.

All requests below are large (> 1 MiB) and of sizes whose segment is the request itself (>= 10 MiB, a
multiple of 2 MiB), so each ``malloc`` is one call on the large pool's clock.
"""

import numpy as np
import pytest
from builder import SnapBuilder, frames

from oomdoctor.analysis.rounding import round_size
from oomdoctor.simulate.allocator import CachingAllocator
from oomdoctor.simulate.capacity import Capacity, infer_capacity
from oomdoctor.simulate.config import parse_config
from oomdoctor.simulate.replay import aligned_matches, prepare, replay
from oomdoctor.simulate.whatif import settle_capacity
from oomdoctor.trace.load import load
from oomdoctor.trace.model import SEGMENT_ALLOC, SEGMENT_FREE

MiB = 1 << 20


def sim(conf: str = "", **kw) -> CachingAllocator:
    return CachingAllocator(parse_config(conf), **kw)


def malloc(a: CachingAllocator, requested: int, stream: int = 0):
    table = np.asarray(a.config.roundup_power2_divisions, dtype=np.int64)
    return a.malloc(int(round_size(np.array([requested], dtype=np.int64), table)[0]), requested, stream)


def segs(a: CachingAllocator) -> list[tuple[int, int]]:
    return [(act, size // MiB) for act, _addr, size in a.segment_events]


# ---- garbage_collect_cached_blocks --------------------------------------------------------------

@pytest.mark.parametrize(("last", "freed", "reserved_after"), [
    # reserved 180 > 0.5 x 200: excess 80. Ages 3, 2, 1 (average 2): the first pass frees the 30 and the
    # 40 (70 < 80); the average of what is left is 1, and the second pass frees the 110 too.
    (110, [30, 40, 110], 60),
    # reserved 160: excess 60; the first pass frees 70 >= 60 and stops: the 90 (age 1) stays.
    (90, [30, 40], 150),
])
def test_gc_passes_recompute_the_average_age(last, freed, reserved_after):
    a = sim("garbage_collection_threshold:0.5", fraction_limit=200 * MiB)
    for size, stream in ((30, 1), (40, 2), (last, 3)):  # clock 1, 2, 3 (70 <= 100: no GC yet): bases 1, 2, 3
        a.free(malloc(a, size * MiB, stream))
    assert a.large.gc_calls == 3 and a.reserved == (70 + last) * MiB and len(a.segment_events) == 3
    b = malloc(a, 60 * MiB)  # clock 4, a miss: ages 3, 2, 1
    assert b is not None and a.num_alloc_retries == 0
    assert segs(a) == [(SEGMENT_ALLOC, 30), (SEGMENT_ALLOC, 40), (SEGMENT_ALLOC, last)] + [
        (SEGMENT_FREE, f) for f in freed] + [(SEGMENT_ALLOC, 60)]
    assert a.reserved == reserved_after * MiB
    a.check([b])


@pytest.mark.parametrize(("cap", "freed", "reserved_after"), [
    # 0.5 x 160 = 80: excess 40. Ages 4, 2, 1 (average 7/3): the first pass frees the 30 alone; then the
    # average of the 2 left is 3/2: the 40 (age 2) goes, the 50 (age 1) stays. 50 + 60 = 110 after.
    (160, [30, 40], 110),
    # 0.5 x 180 = 90: excess 30: the first pass frees exactly 30 and GC stops (reclaimed < target is false).
    (180, [30], 150),
])
def test_gc_average_is_recomputed_over_the_blocks_left(cap, freed, reserved_after):
    a = sim("garbage_collection_threshold:0.5", fraction_limit=cap * MiB)
    a.free(malloc(a, 30 * MiB, 1))  # clock 1: base 1
    a.free(malloc(a, 40 * MiB, 2))  # clock 2
    a.free(malloc(a, 40 * MiB, 2))  # clock 3: a hit; base 3
    a.free(malloc(a, 50 * MiB, 3))  # clock 4: base 4 (misses at 0, 30, 70 MiB: under either threshold)
    assert a.reserved == 120 * MiB and len(a.segment_events) == 3
    b = malloc(a, 60 * MiB)  # clock 5, a miss: ages 4, 2, 1
    assert segs(a)[3:] == [(SEGMENT_FREE, f) for f in freed] + [(SEGMENT_ALLOC, 60)]
    assert a.reserved == reserved_after * MiB and a.num_alloc_retries == 0
    a.check([b])


def test_gc_age_counts_hits_and_restarts_when_a_block_is_put_back():
    a = sim("garbage_collection_threshold:0.5", fraction_limit=100 * MiB)
    a.free(malloc(a, 30 * MiB, 1))  # clock 1: base 1
    a.free(malloc(a, 40 * MiB, 2))  # clock 2: base 2
    for _ in range(3):  # clock 3, 4, 5: hits on the 40 MiB block, which goes back with base 3, 4, 5
        a.free(malloc(a, 40 * MiB, 2))
    assert a.large.gc_calls == 5 and len(a.segment_events) == 2
    # clock 6, a miss at 70 MiB > 50: ages 5 and 1 (average 3): the 30 MiB block alone; 40 + 60 <= 100
    b = malloc(a, 60 * MiB)
    assert segs(a)[2:] == [(SEGMENT_FREE, 30), (SEGMENT_ALLOC, 60)] and a.num_alloc_retries == 0
    a.check([b])


def test_gc_leaves_split_blocks_and_the_small_pool():
    a = sim("garbage_collection_threshold:0.5", fraction_limit=100 * MiB)
    a.free(malloc(a, 30 * MiB, 1))  # clock 1
    y = malloc(a, 10 * MiB, 1)      # clock 2: a hit, split: 10 allocated + 20 free (is_split)
    a.free(malloc(a, 4096, 1))      # a small-pool segment (2 MiB), free and whole; not on the large clock
    a.free(malloc(a, 30 * MiB, 2))  # clock 3: base 3
    assert a.reserved == 62 * MiB and a.large.gc_calls == 3 and a.small.gc_calls == 1
    # clock 4, a miss at 62 > 50: the only whole free large block is the 30 MiB one of stream 2
    b = malloc(a, 40 * MiB)
    assert segs(a) == [(SEGMENT_ALLOC, 30), (SEGMENT_ALLOC, 2), (SEGMENT_ALLOC, 30), (SEGMENT_FREE, 30),
                       (SEGMENT_ALLOC, 40)]
    assert a.reserved == 72 * MiB
    a.check([y, b])


@pytest.mark.parametrize(("size", "gc_runs"), [(50, False), (52, True)])
def test_gc_runs_only_above_the_threshold(size, gc_runs):
    """``total_allocated_memory <= gc_threshold`` returns: at exactly 0.5 x 100 MiB nothing is freed."""
    a = sim("garbage_collection_threshold:0.5", fraction_limit=100 * MiB)
    a.free(malloc(a, size * MiB, 1))
    malloc(a, 30 * MiB)
    assert ((SEGMENT_FREE, size) in segs(a)) is gc_runs


def step(b: SnapBuilder, n: int, segments: dict) -> None:
    """One step of a variable-size job (a graph of n MiB of features): two n MiB activations, then freed."""
    acts = [b.alloc(segments[k], 0, n * MiB) for k in ("s1", "s2")]
    for x in acts:
        b.free(x)


def test_gc_under_a_cap_runs_out_where_live_memory_exceeds_it(tmp_path):
    """A GraphSAGE-like job of variable-size graphs under a 100 MiB fraction cap: 20 MiB of weights, then
    two activations per step of 30, 20 and 46 MiB. Step 3 needs 20 + 46 + 46 = 112 MiB allocated at once:
    no allocator setting fits it, and GC (which frees only cached memory) must not be predicted to.

    Recorded (no GC): step 3's first activation misses (the cached 30 MiB segments are too small),
    80 + 46 > 100 fails, ``release_cached_blocks`` frees both 30s, the retry gets 46 (reserved 66); the
    second misses, 66 + 46 > 100, nothing is cached: the OOM. With ``garbage_collection_threshold:0.6``
    (60 MiB) GC frees both 30s first (80 > 60; both went back at clock 5, when step 2 freed them, so both
    are 1 old, the average) and the first activation needs no retry; the second misses at 66 > 60 with no
    whole free block to collect, and runs out at the same request. (The GraphSAGE trace of issue 35 is not
    in the repository; this one is built from the C++ rules.)"""
    b = SnapBuilder()
    w = b.segment(20 * MiB)
    b.alloc(w, 0, 20 * MiB)
    s = {"s1": b.segment(30 * MiB)}
    x1 = b.alloc(s["s1"], 0, 30 * MiB)
    s["s2"] = b.segment(30 * MiB)
    x2 = b.alloc(s["s2"], 0, 30 * MiB)
    b.free(x1)
    b.free(x2)
    step(b, 20, s)                 # step 2: hits, split, merged back on free
    b.free_segment(s["s1"])            # step 3: the fallback's release_cached_blocks
    b.free_segment(s["s2"])
    s3 = b.segment(46 * MiB)
    b.alloc(s3, 0, 46 * MiB, requested=45 * MiB)
    b.oom(45 * MiB, device_free=60 << 30)  # an oom entry holds the rounded request
    trace = load(b.write(tmp_path / "sage.pickle"))
    p = prepare(trace)
    cap = Capacity(limit_bytes=100 * MiB, kind="fraction", source="given", certainty="given",
                   lower_bytes=100 * MiB, upper_bytes=100 * MiB, evidence="given")
    recorded = replay(p, capacity=cap)
    assert recorded.validation.exact and recorded.oom.event_index == p.recorded_oom
    assert recorded.num_alloc_retries == 2
    gc = replay(p, parse_config("garbage_collection_threshold:0.6"), capacity=cap)
    assert gc.oom is not None and gc.oom.event_index == p.recorded_oom
    assert gc.oom.alloc_size_bytes == 46 * MiB and gc.num_alloc_retries == 1  # only the failing request's
    frees = [(act, size // MiB) for act, _a, size in gc.model.segment_events if act == SEGMENT_FREE]
    assert frees == [(SEGMENT_FREE, 30), (SEGMENT_FREE, 30)]
    assert gc.peak_reserved_bytes == 80 * MiB and gc.end_reserved_bytes == 66 * MiB


# ---- recorded addresses after a refusal (issue 35) ------------------------------------------------

def test_after_a_refused_address_later_segments_follow_the_recording(tmp_path):
    """The recording freed a 40 MiB segment (a fallback: 40 + 60 > the peak, 80) and got a 60 MiB one at its
    address. Replayed under a 1 GiB cap, no fallback runs and the 40 MiB segment stays cached: the 60 MiB
    one's recorded address is inside it and refused (a fresh one), and the next segment follows the
    recording again (it went to a fresh address too before issue 35's fix)."""
    b = SnapBuilder()
    s1 = b.segment(40 * MiB)
    x = b.alloc(s1, 0, 40 * MiB)
    b.free(x)
    b.free_segment(s1)
    b.next_addr = s1  # the driver hands the same address out again
    s2 = b.segment(60 * MiB)
    y = b.alloc(s2, 0, 60 * MiB)
    s3 = b.segment(20 * MiB, stream=1)  # another stream: the cached 40 MiB block cannot serve it
    z = b.alloc(s3, 0, 20 * MiB)
    b.free(y)
    b.free(z)
    trace = load(b.write(tmp_path / "reuse.pickle"))
    p = prepare(trace)
    r = replay(p, capacity=Capacity(limit_bytes=1 << 30, kind="fraction", source="given"))
    events = r.model.segment_events
    assert events[0] == (SEGMENT_ALLOC, s1, 40 * MiB)
    assert events[1][0] == SEGMENT_ALLOC and events[1][1] != s1 and events[1][2] == 60 * MiB
    assert events[2] == (SEGMENT_ALLOC, s3, 20 * MiB)
    v = r.validation
    assert (v.segment_events_recorded, v.segment_events_simulated) == (4, 3)
    # recorded +s1 -s1 +s2 +s3, simulated +s1 +fresh +s3: 2 in common in order, so 2 unmatched, where
    # position by position 3 differ
    assert v.segment_events_differing == 3 and v.segment_events_unmatched == 2
    assert (r.model.addresses.refused, r.model.addresses.n) == (1, 3)  # s2's refused, s3's followed


@pytest.mark.parametrize(("a", "b", "common"), [
    ([1, 2, 3, 4], [1, 2, 3, 4], 4),
    ([1, 2, 3, 4], [1, 3, 2, 4], 3),        # a swap: one of the two is unmatched
    ([1, 2, 3, 4, 5], [1, 2, 9, 3, 4, 5], 5),  # one inserted: everything after it still matches
    ([1, 2, 3], [], 0),
    ([7, 1, 2, 3], [1, 2, 3, 8], 3),
])
def test_aligned_matches(a, b, common):
    assert aligned_matches(a, b) == common == aligned_matches(b, a)


def lcs(a: list, b: list) -> int:
    """The longest common subsequence's length, by the textbook table."""
    row = [0] * (len(b) + 1)
    for x in a:
        prev, row = row, [0]
        for j, y in enumerate(b):
            row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
    return row[-1]


def test_aligned_matches_never_counts_more_than_in_common_and_is_exact_for_one_edit():
    import random

    rnd = random.Random(35)
    for _ in range(400):
        a = [rnd.randrange(3) for _ in range(rnd.randrange(9))]
        b = [rnd.randrange(3) for _ in range(rnd.randrange(9))]
        assert aligned_matches(a, b) <= lcs(a, b)
        edited = list(a)
        k = rnd.randrange(len(a) + 1)
        kind = rnd.randrange(3)
        if kind == 0:
            edited.insert(k, rnd.randrange(3))
        elif k < len(a):
            if kind == 1:
                del edited[k]
            else:
                edited[k] = 3
        assert aligned_matches(a, edited) == lcs(a, edited) == aligned_matches(edited, a)
    assert aligned_matches([1, 2, 3], [1, 3, 9, 3]) == 2 == aligned_matches([1, 3, 9, 3], [1, 2, 3])
    # long sequences of one popular entry: difflib's autojunk would drop it (0 in common); it is off
    assert aligned_matches([1] + [0] * 250, [2] + [0] * 249 + [3]) == 249


# ---- settle_capacity --------------------------------------------------------------------------------

def gc_trace(tmp_path):
    """Recorded under a 100 MiB fraction cap with ``garbage_collection_threshold:0.5`` (50 MiB):

    1. 44 MiB on stream 1: a segment (clock 1), freed (base 1);
    2. 12 MiB on stream 0: a miss (clock 2) at 44 <= 50 MiB: no GC; a 12 MiB segment (56 reserved), freed;
    3. 50 MiB on stream 0: a miss (clock 3) at 56 > 50: GC, excess 6; ages 1 (the 12, stream 0, first in
       order) and 2 (the 44): average 1.5, the 44 alone is freed; 12 + 50 <= 100: a 50 MiB segment.

    Segment events: +44, +12, -44, +50; peak reserved 62 MiB."""
    b = SnapBuilder()
    b.settings["garbage_collection_threshold"] = 0.5
    s1 = b.segment(44 * MiB, stream=1)
    b.free(b.alloc(s1, 0, 44 * MiB))
    s2 = b.segment(12 * MiB)
    b.free(b.alloc(s2, 0, 12 * MiB))
    b.free_segment(s1)
    s3 = b.segment(50 * MiB)
    b.alloc(s3, 0, 50 * MiB)
    return b.write(tmp_path / "gc.pickle")


def test_the_fallback_bounds_of_the_gc_trace(tmp_path):
    """Rule 4 of simulate/capacity: the free before the 50 MiB malloc is a fallback (56 + 50 > the peak
    62), so cap < max(56 + 50 MiB, 56 / 0.5 MiB) = 112 MiB, and cap >= the peak, 62 MiB."""
    t = load(gc_trace(tmp_path))
    c = infer_capacity(t, t.primary)
    assert (c.evidence, c.certainty, c.kind) == ("fallbacks", "bounded", "fraction")
    assert (c.lower_bytes, c.upper_bytes, c.limit_bytes) == (62 * MiB, 112 * MiB, 62 * MiB)


@pytest.mark.parametrize(("cap_mib", "exact", "unmatched"), [
    # 62: GC at step 2 already (44 > 31): +44 -44 +12 +50: one of four unmatched (two positions differ)
    (62, False, 1),
    (87, False, 1),   # 44 > 43.5: the same early GC
    (88, True, 0),    # 44 <= 44: no GC at step 2; 56 > 44 at step 3: as recorded
    (111, True, 0),   # 56 > 55.5
    (112, False, 1),  # 56 <= 56: no GC, and 56 + 50 <= 112: the 44 is never freed (+44 +12 +50)
])
def test_which_caps_reproduce_the_gc_trace(tmp_path, cap_mib, exact, unmatched):
    p = prepare(load(gc_trace(tmp_path)))
    v = replay(p, capacity=Capacity(limit_bytes=cap_mib * MiB, kind="fraction", source="test")).validation
    assert v.exact is exact and v.segment_events_unmatched == unmatched
    assert v.segment_events_unmatched <= v.segment_events_differing


def test_settle_capacity_finds_a_cap_that_reproduces_the_gc_trace(tmp_path):
    """The lower bound (62 MiB) runs GC too early; so does no cap at all (the frees are then an
    empty_cache() of both cached segments). Of the 9 caps spread over [62, 112] MiB, 62 + 50 x k / 8, the
    first in the exact window [88, 112) MiB is k = 5: 93.25 MiB."""
    t = load(gc_trace(tmp_path))
    p = prepare(t)
    c = settle_capacity(p, infer_capacity(t, p.device))
    assert c.limit_bytes == 62 * MiB + 50 * MiB * 5 // 8 == 97_779_712
    assert (c.source, c.certainty) == ("fallbacks", "bounded")
    assert c.source_values == {"runs": 1, "settled_caps": 10, "settled_cap": 97_779_712, "settled_exact": True,
                               "settled_unmatched": 0}
    assert replay(p, capacity=c).validation.exact


def test_settle_capacity_leaves_other_evidence_alone(tmp_path):
    t = load(gc_trace(tmp_path))
    p = prepare(t)
    given = Capacity(limit_bytes=70 * MiB, kind="fraction", source="given", certainty="given",
                     lower_bytes=70 * MiB, upper_bytes=70 * MiB, evidence="given")
    assert settle_capacity(p, given) is given


# ---- the rest of a larger step (simulate/extend.py) -------------------------------------------------

F1, F2, BWD = (frames(("/work/model.py", line, name)) for line, name in ((10, "conv1"), (20, "conv2"), (0, "backward")))


def variable_step_trace(tmp_path):
    """20 MiB of weights; step 1 on a small graph: conv1 20, conv2 20, the backward 20 MiB, all freed; step 2
    on a graph 2.25x larger: conv1 asks 45 MiB (the three cached 20s are freed for it under the recorded
    100 MiB cap), and conv2's 45 MiB runs out (20 + 46 + 46 > 100)."""
    b = SnapBuilder()
    w = b.segment(20 * MiB)
    b.alloc(w, 0, 20 * MiB)
    start1 = len(b.events)
    segs_ = [b.segment(20 * MiB) for _ in range(3)]
    xs = [b.alloc(s, 0, 20 * MiB, fr=f) for s, f in zip(segs_, (F1, F2, BWD))]
    for x in xs:
        b.free(x)
    start2 = len(b.events)
    for s in segs_:
        b.free_segment(s)
    s4 = b.segment(46 * MiB)
    b.alloc(s4, 0, 46 * MiB, requested=45 * MiB, fr=F1)
    b.oom(45 * MiB, device_free=60 << 30)
    b.events[-1]["frames"] = F2
    return load(b.write(tmp_path / "sage.pickle")), np.array([start1, start2])


def test_the_rest_of_a_larger_step_is_scaled_by_how_much_larger_it_is(tmp_path, monkeypatch):
    """conv1, the one allocation matched before the OOM, is 45 / 20 = 2.25x step 1's: conv2 and the backward
    are scaled by 2.25 too, 45 MiB each, where the previous step's sizes (20) had the rest of
    the step fit. Under a 140 MiB cap: conv1 46 (126 reserved), conv2 frees the three cached 20s and gets 46
    (112), the backward's 46 runs out (158 > 140). At step 1's sizes both 20s are served from the cache and
    the step completes at 126 MiB."""
    from oomdoctor.simulate.extend import extend_by_previous_step
    from oomdoctor.trace.model import ALLOC

    trace, starts = variable_step_trace(tmp_path)
    ext = extend_by_previous_step(trace.primary, starts)
    assert ext.scale == 2.25 and ext.scaled == 2 and ext.appended == 8  # 2 allocs, 3 frees (requested, completed)
    ev = ext.device.events
    tail = ev["action"][ext.first_appended:] == ALLOC
    assert (ev["size"][ext.first_appended:][tail] == [45 * MiB, 45 * MiB]).all()
    cap = Capacity(limit_bytes=140 * MiB, kind="fraction", source="test")
    r = replay(prepare(trace, ext.device), capacity=cap)
    assert r.oom is not None and r.oom.requested_bytes == 45 * MiB and r.oom.alloc_size_bytes == 46 * MiB
    assert r.oom.event_index == len(ev["action"]) - 7  # the backward's alloc, before the three frees
    assert r.peak_reserved_bytes == 126 * MiB
    import oomdoctor.simulate.extend as extend
    monkeypatch.setattr(extend, "_growth", lambda *a: 1.0)  # the extension as it was: step 1's sizes
    flat = extend.extend_by_previous_step(trace.primary, starts)
    r = replay(prepare(trace, flat.device), capacity=cap)
    assert r.oom is None and r.peak_reserved_bytes == 126 * MiB


def test_steps_of_the_same_shapes_are_extended_as_recorded(tmp_path):
    """The same job with step 2 as large as step 1 up to the OOM: every ratio is 1, nothing is scaled."""
    from oomdoctor.simulate.extend import _growth

    sizes = np.array([20, 20, 20, 40, 50, 60, 10])  # previous step: events 0-2; cut step: events 3-6
    keys = {0: (1, 0), 1: (1, 1), 2: (2, 0)}
    assert _growth(sizes, {3: (1, 0), 4: (1, 1), 5: (2, 0)}, {v: k for k, v in keys.items()}) == 2.5  # 2, 2.5, 3
    assert _growth(sizes, {3: (1, 0), 6: (1, 1)}, {v: k for k, v in keys.items()}) == 1.0  # 2 and 0.5: lower median
    assert _growth(sizes, {}, {}) == 1.0
    from oomdoctor.simulate.extend import extend_by_previous_step

    b = SnapBuilder()
    start1 = len(b.events)
    s = [b.segment(20 * MiB) for _ in range(2)]
    xs = [b.alloc(g, 0, 20 * MiB, fr=f) for g, f in zip(s, (F1, F2))]
    for x in xs:
        b.free(x)
    start2 = len(b.events)
    b.alloc(s[0], 0, 20 * MiB, fr=F1)
    b.oom(20 * MiB, device_free=60 << 30)
    b.events[-1]["frames"] = F2
    trace = load(b.write(tmp_path / "same.pickle"))
    ext = extend_by_previous_step(trace.primary, np.array([start1, start2]))
    assert (ext.scale, ext.scaled) == (1.0, 0)
    assert ext.device.events["size"][ext.first_appended] == 20 * MiB


def test_settle_capacity_reads_frees_no_cap_reproduces_as_empty_cache(tmp_path):
    """``max_split_size_mb:100``: a free 150 MiB (oversize) and a free 30 MiB segment, both freed, smallest
    first, right before a 200 MiB segment (peak 200 MiB). Read as a fallback (180 + 200 > 200), any cap in
    [200, 380) MiB replays ``release_available_cached_blocks`` first: it frees the 150 alone (150 < 200: it
    returns False), then ``release_cached_blocks`` the 30: -150 -30, where the recording has -30 -150. Without
    a cap the frees are the empty_cache() they were, in the recorded order: the cap is none."""
    b = SnapBuilder()
    b.settings["max_split_size"] = 100 * MiB
    s1 = b.segment(150 * MiB)
    b.free(b.alloc(s1, 0, 150 * MiB))
    s2 = b.segment(30 * MiB)  # 30 < 100 <= 150: the oversize block is not used for it
    b.free(b.alloc(s2, 0, 30 * MiB))
    b.free_segment(s2)
    b.free_segment(s1)
    b.alloc(b.segment(200 * MiB), 0, 200 * MiB)
    t = load(b.write(tmp_path / "mss.pickle"))
    p = prepare(t)
    c = infer_capacity(t, p.device)
    assert (c.lower_bytes, c.upper_bytes, c.evidence) == (200 * MiB, 380 * MiB - 1, "fallbacks")
    v = replay(p, capacity=c).validation
    assert (v.segment_events_differing, v.segment_events_unmatched) == (2, 1)
    settled = settle_capacity(p, c)
    assert settled == Capacity(limit_bytes=None, kind="none", source="fallbacks-unreproduced",
                               certainty="bounded", lower_bytes=200 * MiB, upper_bytes=None,
                               evidence="fallbacks", source_values={"runs": 1})
    assert replay(p, capacity=settled).validation.exact


def test_settle_capacity_keeps_a_lower_bound_that_reproduces_the_recording(tmp_path, monkeypatch):
    """A free 60 MiB segment freed before an 80 MiB one (peak 80): at the lower bound, 80 MiB, 60 + 80 > 80
    and ``release_cached_blocks`` frees it, as recorded: one replay, and the capacity comes back as it was."""
    import oomdoctor.simulate.whatif as whatif

    b = SnapBuilder()
    s1 = b.segment(60 * MiB)
    b.free(b.alloc(s1, 0, 60 * MiB))
    b.free_segment(s1)
    b.alloc(b.segment(80 * MiB), 0, 80 * MiB)
    t = load(b.write(tmp_path / "retry.pickle"))
    p = prepare(t)
    c = infer_capacity(t, p.device)
    assert (c.lower_bytes, c.upper_bytes) == (80 * MiB, 140 * MiB - 1)
    calls = []
    monkeypatch.setattr(whatif, "replay", lambda *a, **k: calls.append(k["capacity"].limit_bytes) or replay(*a, **k))
    assert settle_capacity(p, c) is c and calls == [80 * MiB]


def test_fallback_bounds_keep_only_frees_that_can_be_a_fallback(tmp_path):
    """``simulate/capacity.fallback_bounds`` over a trace with every kind of release run (MiB; the peak
    reserved is 110, reached last):

    1. a cached 40 freed, then a ``free_requested``: no malloc follows, no fallback;
    2. a cached 12 freed, then a malloc served from the cache (no new segment): an empty_cache();
    3. a cached 20 freed under an ``empty_cache`` frame, before a new 50: an empty_cache();
    4. a cached 12 freed before a new 30 at 62 reserved: 62 + 30 <= 110, room to the peak: an empty_cache();
    5. a cached 30 freed before a new 40 at 80: a fallback, cap < 80 + 40;
    6. a cached 40 freed before a new 60 at 90: a fallback, cap < 90 + 60;
    7. the last segment freed at the end of the trace: no malloc follows.

    The cap lies in [110, 120 MiB - 1] bytes, from 2 runs."""
    from oomdoctor.simulate.capacity import fallback_bounds

    empty_cache = frames(("/usr/lib/python3/site-packages/torch/cuda/memory.py", 222, "empty_cache"))
    b = SnapBuilder()
    s0 = b.segment(12 * MiB)
    b.free(b.alloc(s0, 0, 12 * MiB))
    s1 = b.segment(40 * MiB)
    b.free(b.alloc(s1, 0, 40 * MiB))
    s2 = b.segment(20 * MiB)
    x2 = b.alloc(s2, 0, 20 * MiB)
    b.free_segment(s1)                       # 1
    b.free(x2)
    b.free_segment(s0)                       # 2
    b.free(b.alloc(s2, 0, 20 * MiB))
    b.free_segment(s2, fr=empty_cache)       # 3
    s3 = b.segment(50 * MiB)
    b.alloc(s3, 0, 50 * MiB)
    s7 = b.segment(12 * MiB)
    b.free(b.alloc(s7, 0, 12 * MiB))
    b.free_segment(s7)                       # 4
    s4 = b.segment(30 * MiB)
    b.free(b.alloc(s4, 0, 30 * MiB))
    b.free_segment(s4)                       # 5
    s5 = b.segment(40 * MiB)
    b.free(b.alloc(s5, 0, 40 * MiB))
    b.free_segment(s5)                       # 6
    s6 = b.segment(60 * MiB)
    x7 = b.alloc(s6, 0, 60 * MiB)
    b.free(x7)
    b.free_segment(s6)                       # 7
    t = load(b.write(tmp_path / "runs.pickle"))
    assert fallback_bounds(t, t.primary) == (120 * MiB - 1, 110 * MiB, 2)
    c = infer_capacity(t, t.primary)
    assert (c.lower_bytes, c.upper_bytes, c.limit_bytes, c.kind) == (110 * MiB, 120 * MiB - 1, 110 * MiB, "fraction")
    assert (c.source, c.source_values) == ("fallbacks", {"runs": 2})


def test_settle_capacity_narrows_to_a_window_between_its_first_caps(tmp_path):
    """GC at 0.5, recorded under a cap in [400, 420) MiB: a cached 200 MiB segment (stream 1) is not
    collected when a 10 MiB one is made (200 <= cap / 2), the 10 is reused five times, and it is collected
    before a 50 (210 > cap / 2); then the 10 is reused once more. Bounds [210, 420] MiB; none of the 9 first
    caps (210 + 26.25 k MiB) is in [400, 420). Those below 400 collect the 200 one step early (1 entry
    unmatched, reserved off for the 20 events from the 10 MiB segment to the recording's free); 420 never
    collects it (1 unmatched, reserved off for the 6 events after); no cap empties the 10 MiB one too and
    makes it again (2 unmatched, 3 events off). So 420 scores best, the search narrows to [393.75, 420] and its third cap, 400.3125 MiB,
    reproduces the recording."""
    b = SnapBuilder()
    b.settings["garbage_collection_threshold"] = 0.5
    s1 = b.segment(200 * MiB, stream=1)
    b.free(b.alloc(s1, 0, 200 * MiB))
    s2 = b.segment(10 * MiB)
    for _ in range(6):
        b.free(b.alloc(s2, 0, 10 * MiB))
    b.free_segment(s1)
    b.alloc(b.segment(50 * MiB), 0, 50 * MiB)
    b.free(b.alloc(s2, 0, 10 * MiB))
    t = load(b.write(tmp_path / "narrow.pickle"))
    p = prepare(t)
    c = infer_capacity(t, p.device)
    assert (c.lower_bytes, c.upper_bytes) == (210 * MiB, 420 * MiB)
    v = {cap: replay(p, capacity=Capacity(limit_bytes=cap, kind="fraction", source="test")).validation
         for cap in (210 * MiB, 393 * MiB, 400 * MiB, 420 * MiB, None)}
    assert [(x.segment_events_unmatched, x.reserved_events_differing) for x in v.values()] == [
        (1, 20), (1, 20), (0, 0), (1, 6), (2, 3)]
    settled = settle_capacity(p, c)
    assert settled.limit_bytes == 419_758_080 and isinstance(settled.limit_bytes, int)
    assert (settled.source, settled.source_values) == ("fallbacks", {
        "runs": 1, "settled_caps": 17, "settled_cap": 419_758_080, "settled_exact": True, "settled_unmatched": 0})
