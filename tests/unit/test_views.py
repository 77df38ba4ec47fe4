"""The HTML report's data, diff, slice and Perfetto export on small traces built in code."""

import json
import pickle
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from builder import MiB, SnapBuilder, frames

from oomdoctor.analysis import analyze
from oomdoctor.analysis.slicing import event_window, slice_snapshot
from oomdoctor.errors import UsageError
from oomdoctor.render.html import render_diff_html, render_html
from oomdoctor.render.perfetto import PID_BASE, trace_events
from oomdoctor.report.diff import diff_runs
from oomdoctor.report.pipeline import report_of
from oomdoctor.trace.load import from_snapshot
from oomdoctor.views.overlay import build_diff_visual
from oomdoctor.views.tracks import rank_tracks
from oomdoctor.views.visual import build_visual, segment_map, timeline_view

SCHEMA = json.loads((Path(__file__).parents[1] / "data" / "trace_event_format.schema.json").read_text())
A = frames(("/work/model.py", 5, "forward"))
B = frames(("/work/model.py", 9, "backward"))


def _trace(snap: dict, name: str = "rank0.pickle"):
    return from_snapshot(pickle.loads(pickle.dumps(snap)), name)


def _run(deferred: bool) -> SnapBuilder:
    """Two segments; in the deferred run the 'A' blocks are freed with record_stream and held."""
    b = SnapBuilder()
    s1 = b.segment(20 * MiB)
    for i in range(4):
        x = b.alloc(s1, i * 4 * MiB, 4 * MiB, fr=A)
        b.free(x, deferred=deferred)
    s2 = b.segment(20 * MiB)  # reserved peaks here, with the deferred frees still held
    y = b.alloc(s2, 0, 8 * MiB, fr=B)
    for i in range(4):
        if deferred:
            b.complete(s1 + i * 4 * MiB)
    b.free(y)
    return b


def _states(segments: list[dict]) -> list[tuple]:
    return [(s["address"], s["total_size"], s["stream"], s["is_expandable"],
             [(x["address"], x["size"], x["requested_size"], x["state"]) for x in s["blocks"]]) for s in segments]


def test_slice_state_equals_the_state_recorded_at_the_window_end():
    b = SnapBuilder()
    s1 = b.segment(20 * MiB)
    keep = b.alloc(s1, 0, 2 * MiB, fr=A)          # alive through the whole run
    tmp = b.alloc(s1, 2 * MiB, 6 * MiB, fr=B)
    b.free(tmp, deferred=True)                     # pending free inside the window
    s2 = b.segment(4 * MiB)
    z = b.alloc(s2, 0, 1 * MiB, fr=A)
    hi = len(b.events)
    expected = b.snapshot()["segments"]            # the allocator's state after event hi - 1
    b.complete(tmp)
    b.free(z)
    b.free_segment(s2)
    b.free(keep)
    full = _trace(b.snapshot())
    a = analyze(full)
    win = event_window(full, a.device, 2, hi, "event")
    snap = slice_snapshot(full, a.device, a.lifetimes, win)
    assert _states(snap["segments"]) == _states(expected)
    assert len(snap["device_traces"][0]) == hi - 2
    # reloads, and the state at its start equals the original's after event 1
    s = analyze(_trace(snap))
    start = s.anatomy_at(-1)
    start.check()
    assert start.unattributed_bytes == 0
    orig = a.anatomy_at(1)
    assert (start.reserved_bytes, start.allocated_bytes, start.pending_free_bytes) == \
        (orig.reserved_bytes, orig.allocated_bytes, orig.pending_free_bytes)
    assert s.peak_reserved[0] == int(a.timeline.reserved[2:hi].max())
    assert s.peak_allocated[0] == int(a.timeline.allocated[2:hi].max())


def test_window_units_and_errors():
    b = _run(deferred=False)
    t = _trace(b.snapshot())
    dt = t.primary
    n = dt.num_events
    assert event_window(t, dt, None, None, "event").num_events == n
    t0 = int(dt.events["time_us"][0])
    w = event_window(t, dt, 20, 50, "time")  # events are 10 µs apart
    assert (w.start_event, w.end_event) == (2, 5)
    assert int(dt.events["time_us"][w.start_event]) - t0 == 20
    with pytest.raises(UsageError, match="outside the trace's 0:"):
        event_window(t, dt, 0, n + 1, "event")
    with pytest.raises(UsageError, match="holds no event"):
        event_window(t, dt, 5, 5, "event")
    with pytest.raises(UsageError, match="no steps found"):
        event_window(t, dt, 0, 1, "step")


def test_slice_by_step_uses_the_annotations():
    b = SnapBuilder()
    s = b.segment(20 * MiB)
    starts = []
    for step in range(3):
        b.annotate(f"ProfilerStep#{step}", "START")
        starts.append(len(b.events))
        x = b.alloc(s, 0, (step + 1) * 4 * MiB, fr=A)
        b.free(x)
    t = _trace(b.snapshot())
    a = analyze(t)
    w = event_window(t, a.device, 1, 2, "step")
    assert (w.start_event, w.end_event) == (starts[1], starts[2])
    sl = analyze(_trace(slice_snapshot(t, a.device, a.lifetimes, w)))
    assert sl.peak_allocated[0] == 8 * MiB
    with pytest.raises(UsageError, match="outside the 3 steps"):
        event_window(t, a.device, 2, 4, "step")


def test_timeline_view_keeps_peaks_exact_when_downsampled():
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    for i in range(500):
        x = b.alloc(s, 0, (1 + (i * 7919) % 60) * MiB, fr=A)
        b.free(x)
    a = analyze(_trace(b.snapshot()))
    v = timeline_view(a, points=64)
    assert v.events_per_bucket == -(-a.num_events // 64)
    assert len(v.event) == len(v.reserved) <= 64
    assert max(v.allocated) == a.peak_allocated[0] == 60 * MiB
    assert max(v.reserved) == a.peak_reserved[0] == 64 * MiB
    assert v.time_us[0] == 0 and v.time_us == sorted(v.time_us)


def test_segment_map_blocks_cover_segments_and_carry_states():
    b = _run(deferred=True)
    a = analyze(_trace(b.snapshot()))
    k = 10  # after the 4 deferred frees and the 8 MiB alloc: 16 MiB pending in s1, 8 MiB allocated in s2
    segs, left = segment_map(a, k)
    assert left == 0 and len(segs) == 2
    assert [b_[2] for b_ in segs[0].blocks] == ["pending_free"] * 4 + ["free"]
    assert sum(b_[1] for b_ in segs[0].blocks if b_[2] == "pending_free") == 16 * MiB
    assert segs[1].blocks == [[0, 8 * MiB, "allocated"], [8 * MiB, 12 * MiB, "free"]]
    segs, left = segment_map(a, k, max_blocks=3)  # the budget keeps the larger segments first
    assert left == 1 and len(segs) == 1


def test_diff_resolves_the_deferred_free_and_counts_the_saving():
    before = [analyze(_trace(_run(True).snapshot()))]
    after = [analyze(_trace(_run(False).snapshot()))]
    rb, ra = report_of(before), report_of(after)
    d = diff_runs(before, after, rb, ra)
    assert d.ranks[0].before_peak_reserved_bytes == d.ranks[0].after_peak_reserved_bytes == 40 * MiB
    site = {s.label: s for s in d.ranks[0].sites}
    held = site["/work/model.py:5 in forward"]
    assert (held.before_bytes, held.after_bytes) == (16 * MiB, 0)  # the pending frees at peak reserved
    assert d.ranks[0].before_anatomy.pending_free_bytes == 16 * MiB
    assert d.ranks[0].after_anatomy.pending_free_bytes == 0
    # the same run on both sides: nothing resolved, nothing new
    same = diff_runs(before, before, rb, rb)
    assert all(f.status == "unchanged" for f in same.findings)
    assert all(not r.sites for r in same.ranks)
    page = render_diff_html(d, build_diff_visual(d, before, after))
    assert "model.py:5 in forward" in page and "-16.00 MiB" in page


def test_perfetto_export_validates_and_matches_the_timeline():
    b = _run(deferred=True)
    b.oom(64 * MiB, device_free=3 * MiB)
    a = analyze(_trace(b.snapshot(), "rank3.pickle"))
    tr = rank_tracks(a)
    doc = trace_events([tr])
    jsonschema.validate(doc, SCHEMA)
    ev = doc["traceEvents"]
    assert {e["pid"] for e in ev} == {PID_BASE + 3}
    res = [e["args"]["bytes"] for e in ev if e["name"] == "CUDA reserved bytes"]
    act = [e["args"]["bytes"] for e in ev if e["name"] == "CUDA active bytes"]
    assert max(res) == a.peak_reserved[0] and max(act) == int(a.timeline.active.max())
    ts = [e["ts"] for e in ev if e["name"] == "CUDA reserved bytes"]
    assert ts == sorted(ts) and len(set(ts)) == len(ts)  # one sample per timestamp
    oom = [e for e in ev if e["ph"] == "i" and e["name"] == "OOM"]
    assert oom[0]["args"]["requested_bytes"] == 64 * MiB and oom[0]["args"]["device_free_bytes"] == 3 * MiB
    # a broken document fails the schema (the check can fail)
    ev[-1]["ph"] = "C"
    ev[-1]["args"] = {"bytes": "many"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA)


def test_html_escapes_snapshot_text_and_inlines_everything():
    b = SnapBuilder()
    s = b.segment(4 * MiB)
    evil = frames(("/work/<script>alert(1)</script>.py", 1, "</script><img src=x onerror=alert(2)>"))
    b.alloc(s, 0, 2 * MiB, fr=evil)
    a = [analyze(_trace(b.snapshot()))]
    page = render_html(report_of(a), build_visual(a))
    assert "<script>alert(1)" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page.replace(
        "https://github.com/leeoniya/uPlot", "")
    assert page.count("<script") == 3  # data, uPlot, report.js
    assert "default-src 'none'" in page
    data = page.split('<script id="oomdoctor-data" type="application/json">', 1)[1].split("</script>", 1)[0]
    views = json.loads(data)["views"]
    assert views["r0"]["timeline"]["allocated"][-1] == 2 * MiB
    # the flame graph's frame labels travel as data (drawn with fillText / textContent), never as markup
    assert "/work/<script>alert(1)</script>.py:1 </script><img src=x onerror=alert(2)>" in views["r0"]["flame"]["frames"]
    assert np.all(np.diff(views["r0"]["timeline"]["event"]) > 0)


def test_vendored_chart_library_is_the_pinned_one():
    import hashlib
    import re
    from importlib import resources

    assets = resources.files("oomdoctor.render").joinpath("assets")
    table = assets.joinpath("VENDORED.md").read_text()
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}`"))
        want = re.findall(r"`([0-9a-f]{64})`", row)[-1]
        assert hashlib.sha256(assets.joinpath(name).read_bytes()).hexdigest() == want
    assert assets.joinpath("uPlot.iife.min.js").read_text().startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32)")


def test_sparkline_clamps_values_outside_its_scale():
    """A scaled copy of the large trace (benchmarks/bench_cli.py --scale 4) drove allocated bytes below
    zero, and the negative index fell off the character table (IndexError in diagnose)."""
    from oomdoctor.render.format import sparkline
    assert sparkline([-5, 0, 50, 100, 130], 100) == "▁▁▅██"
    assert sparkline([], 10) == "" and sparkline([1], 0) == ""
