"""Replay of small traces built in code, laid out as the real allocator would lay them out."""

import pytest
from builder import SnapBuilder, frames

from oomdoctor.errors import UsageError
from oomdoctor.simulate.capacity import Capacity, infer_capacity, parse_bytes
from oomdoctor.simulate.config import parse_config
from oomdoctor.simulate.replay import (
    _FREE,
    _FREE_DEFERRED,
    _MALLOC_RUN,
    IMMEDIATE,
    SimulationError,
    prepare,
    replay,
)
from oomdoctor.trace.load import load
from oomdoctor.trace.model import SEGMENT_ALLOC

MiB = 1 << 20
EMPTY_CACHE = frames(("/usr/lib/python3/site-packages/torch/cuda/memory.py", 222, "empty_cache"),
                     ("/work/train.py", 40, "step"))


def build_deferred(tmp_path):
    b = SnapBuilder()
    s1 = b.segment(12 * MiB)                 # get_allocation_size(12 MiB) = 12 MiB
    a = b.alloc(s1, 0, 12 * MiB)
    b.free(a, deferred=True)                 # record_stream: free_requested only
    s2 = b.segment(12 * MiB)                 # a is pending: the next 12 MiB request needs a new segment
    x = b.alloc(s2, 0, 12 * MiB)
    b.free(x)
    b.complete(a)                            # process_events of the next malloc returns a
    y = b.alloc(s1, 0, 12 * MiB)             # two free 12 MiB blocks: the lower address wins
    b.free(y)
    return b.write(tmp_path / "deferred.pickle")


def test_deferred_frees_replay_exactly_and_immediate_saves_a_segment(tmp_path):
    prepared = prepare(load(build_deferred(tmp_path)))
    rec = replay(prepared)
    assert rec.matches_recorded is True
    assert rec.validation.segment_events_recorded == rec.validation.segment_events_simulated == 2
    assert rec.peak_reserved_bytes == 24 * MiB
    imm = replay(prepared, deferred_frees=IMMEDIATE)
    assert imm.matches_recorded is None and imm.peak_reserved_bytes == 12 * MiB


def test_prepare_makes_one_op_per_request_in_event_order(tmp_path):
    # events: 0 segment_alloc, 1 alloc a, 2 free_requested a (deferred), 3 segment_alloc, 4 alloc x,
    # 5-6 free x (immediate), 7 free_completed a, 8 alloc y, 9-10 free y
    p = prepare(load(build_deferred(tmp_path)))
    assert p.op_kind == [_MALLOC_RUN, _FREE_DEFERRED, _MALLOC_RUN, _FREE, _MALLOC_RUN, _FREE]
    assert p.op_event == [1, 2, 4, 5, 8, 9]
    a = p.op_arg[1]
    # the malloc after a run carries its address, the completions before it, the fallback flag and the
    # events its segment entries are aligned with
    assert p.op_arg[0] == (a, None, None, False, (0, 1))
    assert p.op_arg[4] == (a, [a], None, False, (7, 8))
    assert p.requests[p.op_event_index].tolist() == [12 * MiB, 0, 12 * MiB, 0, 12 * MiB, 0]


def test_validation_counts_what_differs(tmp_path):
    # a recording the allocator could not have made: a 20 MiB segment for a 12 MiB request
    # (get_allocation_size gives 12 MiB); validation must count it, not pass
    b = SnapBuilder()
    s1 = b.segment(20 * MiB)
    b.alloc(s1, 0, 12 * MiB)
    s2 = b.segment(2 * MiB)
    b.alloc(s2, 0, 4096)
    r = replay(prepare(load(b.write(tmp_path / "odd.pickle"))))
    v = r.validation
    assert r.matches_recorded is False
    # only the first differs: the 12 MiB segment has no recorded segment_alloc of its size (it gets a fresh
    # address), the 2 MiB one follows the recording again (issue 35: it used to go fresh too, 2 of 2)
    assert (v.segment_events_recorded, v.segment_events_simulated, v.segment_events_differing) == (2, 2, 1)
    assert v.segment_events_unmatched == 1
    assert r.model.segment_events[1] == (SEGMENT_ALLOC, s2, 2 * MiB)
    assert v.first_differing_event == 0
    assert v.reserved_events_differing == 4 and v.max_reserved_difference_bytes == 8 * MiB


def test_empty_cache_is_replayed_as_one(tmp_path):
    b = SnapBuilder()
    s1 = b.segment(20 * MiB)
    keep = b.alloc(s1, 0, 4 * MiB)
    s2 = b.segment(40 * MiB)
    t = b.alloc(s2, 0, 40 * MiB)
    b.free(t)
    b.free_segment(s2, fr=EMPTY_CACHE)      # torch.cuda.empty_cache(): the whole free segment goes
    b.alloc(s1, 4 * MiB, 4 * MiB)           # then a request served from the cache (no new segment)
    b.free(keep)
    prepared = prepare(load(b.write(tmp_path / "ec.pickle")))
    r = replay(prepared)
    assert r.matches_recorded is True
    assert r.end_reserved_bytes == 20 * MiB and r.peak_reserved_bytes == 60 * MiB


def test_truncated_trace_starts_from_the_rebuilt_state(tmp_path):
    b = SnapBuilder()
    s1 = b.segment(20 * MiB)
    old = b.alloc(s1, 0, 6 * MiB)            # allocated before the recording starts
    b.alloc(s1, 6 * MiB, 5 * MiB, requested=5 * MiB - 100)
    b.free(old)                              # in the trace: a free with no alloc
    s2 = b.segment(30 * MiB)
    b.alloc(s2, 0, 30 * MiB)
    b.alloc(s1, 0, 6 * MiB)                  # back into the space the early block left
    prepared = prepare(load(b.write(tmp_path / "trunc.pickle", drop_first=3)))
    assert prepared.reserved_start == 20 * MiB
    r = replay(prepared)
    assert r.initial_state == "recorded" and r.matches_recorded is True
    assert r.peak_reserved_bytes == 50 * MiB


def test_recorded_oom_sets_the_device_capacity(tmp_path):
    b = SnapBuilder()
    s1 = b.segment(40 * MiB)
    b.alloc(s1, 0, 40 * MiB)
    b.oom(60 * MiB, device_free=10 * MiB)     # cudaMemGetInfo said 10 MiB free: the device was full
    t = load(b.write(tmp_path / "oom.pickle"))
    prepared = prepare(t)
    cap = infer_capacity(t, prepared.device)
    assert (cap.limit_bytes, cap.kind) == (50 * MiB, "device")
    r = replay(prepared, capacity=cap)
    assert r.oom is not None and r.oom.event_index == prepared.device.num_events - 1
    assert r.oom.requested_bytes == 60 * MiB and r.matches_recorded is True
    ok = replay(prepared, capacity=Capacity(limit_bytes=200 * MiB, kind="device", source="test"))
    assert ok.oom is None and ok.matches_recorded is False  # the recorded OOM is not reproduced
    assert ok.validation.oom_matches is False


def test_cuda_malloc_async_backend_is_refused(tmp_path):
    prepared = prepare(load(build_deferred(tmp_path)))
    with pytest.raises(SimulationError, match="cudaMallocAsync"):
        replay(prepared, parse_config("backend:cudaMallocAsync"))
    with pytest.raises(SimulationError, match="total memory"):
        replay(prepared, parse_config("per_process_memory_fraction:0.5"))


@pytest.mark.parametrize("text, value", [("41519093862", 41519093862), ("38.67GiB", int(38.67 * (1 << 30))),
                                         ("40 GB", 40 * 10**9), ("512MiB", 512 * MiB), ("2g", 2 << 30)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "abc", "12 parsecs", "-5GiB", "0"])
def test_parse_bytes_rejects(text):
    with pytest.raises(UsageError):
        parse_bytes(text)


def test_fallback_rule_tells_fallbacks_from_empty_cache():
    """simulate/capacity.FallbackRule on the three kinds of evidence, on small traces built in code:
    ``rule(g0, g1)``: can the frees in events [g0, g1) be the fallback of the malloc at event g1?"""
    from types import SimpleNamespace

    import numpy as np

    from oomdoctor.simulate.capacity import FallbackRule
    from oomdoctor.trace.model import ALLOC, SEGMENT_ALLOC, SEGMENT_FREE
    G = 1 << 30

    def device(levels, requests):
        """Reserved bytes go through ``levels`` (GiB), then ``requests`` (GiB) are allocated."""
        acts, sizes, cur = [], [], 0
        for level in levels:
            acts.append(SEGMENT_ALLOC if level > cur else SEGMENT_FREE)
            sizes.append(abs(level - cur) * G)
            cur = level
        acts += [ALLOC] * len(requests)
        sizes += [r * G for r in requests]
        return SimpleNamespace(events={"action": np.array(acts, dtype=np.int8), "size": np.array(sizes, dtype=np.int64)},
                               num_events=len(acts), final_reserved_bytes=cur * G)

    def rule(dev, settings=None, **meta):
        trace = SimpleNamespace(allocator_settings=settings or {}, meta=meta,
                                stacks=SimpleNamespace(stacks=[], frames=[]))
        return FallbackRule(trace, dev)

    peak10 = device([10, 9, 7, 5], [2])  # reserved 10, 9, 7, 5 GiB; a 2 GiB request at event 4
    plain = rule(peak10)
    assert plain.peak == 10 * G and plain.segment_size(4) == 2 * G
    assert plain(2, 4)  # 9 + 2 > 10 (the peak): alloc_block may have failed
    assert not plain(3, 4)  # 7 + 2: room to the peak: an empty_cache()
    gc = rule(peak10, {"garbage_collection_threshold": 0.6})
    assert gc(3, 4) and not gc(4, 4)  # GC runs above 0.6 x cap >= 0.6 x peak: 7 > 6, 5 is not
    no_fraction = dict(memory_fraction=1.0, gpu_total_memory_bytes=80 * G)
    assert not rule(peak10, {"garbage_collection_threshold": 0.6}, **no_fraction)(2, 4)  # 11 GiB, far from 80
    high = device([75, 70], [2])  # reserved 75 then 70 GiB
    assert not rule(high, **no_fraction)(2, 2)  # 72 GiB: under 95% of the GPU
    assert rule(high, **no_fraction)(1, 2)  # 77 GiB > 95% of 80: the device's own limit may have been hit
    assert not rule(peak10, memory_stats={"num_alloc_retries": 0})(2, 4)  # release_cached_blocks never ran
    assert rule(peak10, {"max_split_size": 256 << 20}, memory_stats={"num_alloc_retries": 0})(2, 4)


def test_a_malloc_after_a_new_segment_counts_what_was_requested(tmp_path):
    # the alloc right after its segment_alloc is replayed as that run's op, the next one from the cache as a
    # plain malloc; both must count the bytes the program asked for, not the rounded block (issue 38: the
    # faster loop once passed the rounded size for the first kind)
    b = SnapBuilder()
    s1 = b.segment(20 * MiB)
    b.alloc(s1, 0, 12 * MiB, requested=12 * MiB - 100)        # right after its segment_alloc
    b.alloc(s1, 12 * MiB, 8 * MiB, requested=8 * MiB - 300)   # from the split's remainder
    r = replay(prepare(load(b.write(tmp_path / "requested.pickle"))))
    assert r.model.allocated == 20 * MiB
    assert r.model.requested == 20 * MiB - 400
