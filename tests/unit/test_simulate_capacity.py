"""``simulate/capacity.py`` rules 3 and 4 (``_from_oom``, ``_from_fallbacks``) on small traces built in code: every
field of the Capacity each returns, and the boundaries between its branches (issue 35 item 3)."""

import pytest
from builder import SnapBuilder
from test_simulate_gc_settle import gc_trace

import oomdoctor.simulate.capacity as capacity
from oomdoctor.simulate.capacity import Capacity, infer_capacity
from oomdoctor.trace.load import load

MiB = 1 << 20


def oom_trace(tmp_path, request, device_free, *, before=(), drop_first=0):
    """Segments of ``before`` MiB made (and kept), a 12 MiB one allocated, then an ``oom`` of ``request`` bytes
    with ``device_free`` (None: the entry has no ``device_free``, it sits in ``addr`` as in old snapshots)."""
    b = SnapBuilder()
    for m in before:
        b.segment(m * MiB)
    b.alloc(b.segment(12 * MiB), 0, 12 * MiB)
    if device_free is None:
        b.events.append({"action": "oom", "addr": 3 * MiB, "size": request, "stream": 0, "time_us": b.t,
                         "compile_context": "N/A", "user_metadata": "", "frames": []})
    else:
        b.oom(request, device_free)
    t = load(b.write(tmp_path / "oom.pickle", drop_first=drop_first))
    return t, t.primary.num_events - 1


def test_oom_the_device_could_not_hold_is_the_device_limit(tmp_path):
    t, o = oom_trace(tmp_path, 20 * MiB, 4 * MiB, before=(30,))
    assert infer_capacity(t, t.primary) == Capacity(limit_bytes=46 * MiB, kind="device", source="oom-device",
                                                    certainty="exact", lower_bytes=46 * MiB,
                                                    upper_bytes=46 * MiB, evidence="oom",
                                                    source_values={"event": o, "device_free_bytes": 4 * MiB, "reserved_bytes": 42 * MiB})


def test_oom_device_free_from_addr_when_the_entry_has_none(tmp_path):
    t, o = oom_trace(tmp_path, 20 * MiB, None)
    assert t.primary.events["device_free"][o] == -1
    c = infer_capacity(t, t.primary)
    assert (c.limit_bytes, c.kind, c.source_values) == (15 * MiB, "device", {
        "event": o, "device_free_bytes": 3 * MiB, "reserved_bytes": 12 * MiB})


def test_oom_the_device_could_hold_is_a_fraction_cap(tmp_path):
    # 20 MiB free on the device, the 20 MiB segment fitted: a fraction cap refused it; the cap lies in
    # [the peak before, reserved + the segment - 1]
    t, o = oom_trace(tmp_path, 20 * MiB, 20 * MiB, before=(30,))
    assert infer_capacity(t, t.primary) == Capacity(limit_bytes=42 * MiB, kind="fraction",
                                                    source="oom-fraction-cap", certainty="bounded",
                                                    lower_bytes=42 * MiB, upper_bytes=62 * MiB - 1,
                                                    evidence="oom",
                                                    source_values={"event": o, "device_free_bytes": 20 * MiB})
    # one byte less free: the device could not
    t, o = oom_trace(tmp_path, 20 * MiB, 20 * MiB - 1, before=(30,))
    assert infer_capacity(t, t.primary).source == "oom-device"


def test_oom_segment_size_is_the_allocation_size_of_the_request(tmp_path):
    # a 3 MiB request takes a 20 MiB segment (get_allocation_size): 19 MiB free is the device's limit
    t, _ = oom_trace(tmp_path, 3 * MiB, 19 * MiB)
    assert infer_capacity(t, t.primary).source == "oom-device"
    t, _ = oom_trace(tmp_path, 3 * MiB, 20 * MiB)
    c = infer_capacity(t, t.primary)
    assert (c.source, c.lower_bytes, c.upper_bytes) == ("oom-fraction-cap", 12 * MiB, 32 * MiB - 1)


def test_oom_first_in_the_trace_bounds_from_the_start(tmp_path):
    # the trace (ring buffer) starts at the oom: the reserved bytes at its start are the lower bound
    t, o = oom_trace(tmp_path, 20 * MiB, 40 * MiB, before=(30,), drop_first=3)
    assert o == 0
    c = infer_capacity(t, t.primary)
    assert (c.limit_bytes, c.lower_bytes, c.upper_bytes, c.source_values) == (
        42 * MiB, 42 * MiB, 62 * MiB - 1, {"event": 0, "device_free_bytes": 40 * MiB})


def test_oom_lower_bound_counts_the_reserved_bytes_at_the_start(tmp_path):
    # 30 MiB reserved at the start, freed first: the peak before the oom is the start's
    b = SnapBuilder()
    s0 = b.segment(30 * MiB, record=False)
    b.free_segment(s0)
    b.alloc(b.segment(12 * MiB), 0, 12 * MiB)
    b.oom(20 * MiB, 40 * MiB)
    t = load(b.write(tmp_path / "start.pickle"))
    c = infer_capacity(t, t.primary)
    assert (c.lower_bytes, c.upper_bytes) == (30 * MiB, 32 * MiB - 1)


def test_the_first_oom_decides(tmp_path):
    b = SnapBuilder()
    b.alloc(b.segment(12 * MiB), 0, 12 * MiB)
    b.oom(20 * MiB, 4 * MiB)
    b.oom(20 * MiB, 40 * MiB)
    t = load(b.write(tmp_path / "two.pickle"))
    c = infer_capacity(t, t.primary)
    assert (c.source, c.source_values["event"]) == ("oom-device", 2)  # events: segment, alloc, the two ooms


# ---- rule 4 ---------------------------------------------------------------------------------------------------

def fallback_trace(tmp_path, **meta):
    """``garbage_collection_threshold:0.5``: 44 and 12 MiB cached, the 44 freed before a new 50 MiB segment, a
    fallback: the cap lies in [62, 112] MiB (test_simulate_gc_settle.gc_trace)."""
    t = load(gc_trace(tmp_path))
    t.meta.update(meta)
    return t


def test_fallbacks_bound_a_fraction_cap(tmp_path):
    t = fallback_trace(tmp_path)
    assert infer_capacity(t, t.primary) == Capacity(limit_bytes=62 * MiB, kind="fraction", source="fallbacks",
                                                    certainty="bounded", lower_bytes=62 * MiB,
                                                    upper_bytes=112 * MiB, evidence="fallbacks",
                                                    source_values={"runs": 1})


@pytest.mark.parametrize(("total", "kind"), [
    (123_621_591, "device"),    # 0.95 x total <= 112 MiB, the upper bound: the GPU's own memory
    (123_621_592, "fraction"),  # one byte more and the bound lies below 95% of the GPU
    (200 * MiB, "fraction"),
    (float(100 * MiB), "fraction"),  # not a byte count: no GPU size to compare with
])
def test_fallbacks_near_the_gpus_memory_are_the_device_limit(tmp_path, total, kind):
    t = fallback_trace(tmp_path, gpu_total_memory_bytes=total)
    c = infer_capacity(t, t.primary)
    assert (c.kind, c.limit_bytes, c.upper_bytes, c.source) == (kind, 62 * MiB, 112 * MiB, "fallbacks")


@pytest.mark.parametrize(("stats", "values"), [
    ({"num_alloc_retries": 3}, {"runs": 1, "alloc_retries": 3}),
    ({"num_alloc_retries": 0}, {"runs": 1}),  # GC can free without a retry: still a fallback, nothing to quote
    ({"num_alloc_retries": 2.0}, {"runs": 1}),
    ({}, {"runs": 1}),
    (None, {"runs": 1}),
])
def test_fallbacks_quote_the_sidecars_alloc_retries(tmp_path, stats, values):
    t = fallback_trace(tmp_path, memory_stats=stats)
    assert infer_capacity(t, t.primary).source_values == values


def test_no_release_is_no_evidence(tmp_path):
    b = SnapBuilder()
    b.free(b.alloc(b.segment(12 * MiB), 0, 12 * MiB))
    t = load(b.write(tmp_path / "none.pickle"))
    t.meta["memory_stats"] = {"num_alloc_retries": 5}
    assert infer_capacity(t, t.primary) == Capacity(limit_bytes=None, kind="none", source="no-evidence")


def test_fallbacks_below_the_peak_disagree(tmp_path, monkeypatch):
    t = fallback_trace(tmp_path)
    monkeypatch.setattr(capacity, "fallback_bounds", lambda trace, device: (50 * MiB, 62 * MiB, 2))
    assert infer_capacity(t, t.primary) == Capacity(limit_bytes=None, kind="none", source="fallbacks-disagree", source_values={
        "runs": 2, "upper_bytes": 50 * MiB, "peak_reserved_bytes": 62 * MiB})
    # equal bounds agree: the cap is that one value
    monkeypatch.setattr(capacity, "fallback_bounds", lambda trace, device: (62 * MiB, 62 * MiB, 1))
    assert infer_capacity(t, t.primary) == Capacity(limit_bytes=62 * MiB, kind="fraction", source="fallbacks",
                                                    certainty="bounded", lower_bytes=62 * MiB,
                                                    upper_bytes=62 * MiB, evidence="fallbacks",
                                                    source_values={"runs": 1})


# ---- rules 1 and 2: the sidecar ---------------------------------------------------------------------------------

def test_the_sidecars_cap_comes_first(tmp_path):
    t, _ = oom_trace(tmp_path, 20 * MiB, 4 * MiB)  # an OOM too: the sidecar's cap wins
    t.meta.update(memory_cap_bytes=30 * MiB)
    assert infer_capacity(t, t.primary) == Capacity(limit_bytes=30 * MiB, kind="fraction",
                                                    source="sidecar-memory-cap", certainty="exact",
                                                    lower_bytes=30 * MiB, upper_bytes=30 * MiB,
                                                    evidence="sidecar", source_values={})
    t.meta.update(memory_cap_bytes=0, memory_fraction=0.5, gpu_total_memory_bytes=80 * MiB + 1)
    assert infer_capacity(t, t.primary) == Capacity(limit_bytes=40 * MiB, kind="fraction",
                                                    source="sidecar-memory-fraction", certainty="exact",
                                                    lower_bytes=40 * MiB, upper_bytes=40 * MiB,
                                                    evidence="sidecar",
                                                    source_values={"fraction": 0.5, "gpu_total_memory_bytes": 80 * MiB + 1})
    t.meta.update(memory_fraction=1.0)  # no fraction set: the OOM decides
    assert infer_capacity(t, t.primary).source == "oom-device"
