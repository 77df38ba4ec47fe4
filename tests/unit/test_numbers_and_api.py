"""Issue 28, items 6 and 7: the Python API equals the CLI; the numbers at a peak, in Perfetto, for state-only
and empty snapshots."""

from __future__ import annotations

import json
import pickle

import numpy as np
from builder import MiB, SnapBuilder

import oomdoctor
from oomdoctor.analysis.device import analyze
from oomdoctor.cli.main import main
from oomdoctor.render.perfetto import trace_events
from oomdoctor.views.tracks import extremes_per_us, rank_tracks


def _write(tmp_path, snap, name="rank0.pickle"):
    p = tmp_path / name
    p.write_bytes(pickle.dumps(snap))
    return p


def test_the_anatomy_at_the_peak_of_reserved_shows_the_new_segment_in_use(tmp_path):
    b = SnapBuilder()
    s1 = b.segment(4 * MiB)
    b.alloc(s1, 0, 4 * MiB)
    s2 = b.segment(8 * MiB)  # reserved peaks here: 12 MiB ...
    b.alloc(s2, 0, 6 * MiB)  # ... for this request
    a = analyze(oomdoctor.load(_write(tmp_path, b.snapshot())))
    pr, k = a.peak_reserved
    assert pr == 12 * MiB and k == 3  # the alloc after the segment_alloc (event 2)
    an = a.anatomy_at(k)
    assert an.free_segments_bytes == 0 and an.allocated_bytes == 10 * MiB
    assert an.free_in_used_segments_bytes == 2 * MiB
    rep = oomdoctor.diagnose(str(tmp_path / "rank0.pickle")).report
    assert rep.ranks[0].anatomy_at_peak.free_segments_bytes == 0


def test_the_demo_no_longer_shows_its_peak_segment_free(demo_trace):
    a = analyze(demo_trace)
    an = a.anatomy_at(a.peak_reserved[1])
    assert an.free_segments_bytes == 0
    assert an.reserved_bytes == an.allocated_bytes + an.pending_free_bytes + an.rounding_waste_bytes \
        + an.free_in_used_segments_bytes + an.free_segments_bytes == a.peak_reserved[0]


def test_perfetto_keeps_the_minimum_and_the_maximum_of_each_microsecond():
    t = np.array([10, 10, 10, 10, 11, 12, 12], dtype=np.int64)
    v = np.array([5, 9, 1, 4, 4, 7, 7], dtype=np.int64)
    c = extremes_per_us(t, v)
    # µs 10: max 9 (2nd), min 1 (3rd), last 4; µs 11: 4 (unchanged, dropped); µs 12: 7
    assert c.time_us.tolist() == [10.0, 10.25, 10.5, 12.0]
    assert c.bytes.tolist() == [9, 1, 4, 7]
    # the first sample of the µs is its max only when the max came first
    c = extremes_per_us(np.array([3, 3, 3]), np.array([2, 8, 2]))
    assert c.time_us.tolist() == [3.0, 3.25, 3.5] and c.bytes.tolist() == [2, 8, 2]


def test_a_peak_allocated_and_freed_within_one_microsecond_survives_the_export(tmp_path):
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    b.alloc(s, 0, 2 * MiB)  # stays allocated
    y = b.alloc(s, 2 * MiB, 48 * MiB)
    b.free(y)
    b.alloc(s, 2 * MiB, 4 * MiB)
    snap = b.snapshot()
    ev = snap["device_traces"][0]
    for e in ev[2:]:  # the 48 MiB block lives and dies within the µs of the next alloc
        e["time_us"] = ev[2]["time_us"]
    a = analyze(oomdoctor.load(_write(tmp_path, snap)))
    assert a.peak_allocated[0] == 50 * MiB
    doc = trace_events([rank_tracks(a)])
    alloc = [e for e in doc["traceEvents"] if e["name"] == "CUDA allocated bytes"]
    assert max(e["args"]["bytes"] for e in alloc) == 50 * MiB
    assert alloc[-1]["args"]["bytes"] == 6 * MiB  # the µs ends at its last value
    ts = [e["ts"] for e in alloc]
    assert ts == sorted(ts) and len(set(ts)) == len(ts)


def test_a_state_only_snapshot_gets_a_verdict_from_its_findings(tmp_path):
    b = SnapBuilder()
    s = b.segment(1024 * MiB)
    x = b.alloc(s, 0, 512 * MiB)
    b.alloc(s, 512 * MiB, 256 * MiB)
    b.free(x, deferred=True)
    snap = b.snapshot()
    snap["device_traces"] = [[]]
    d = oomdoctor.diagnose(str(_write(tmp_path, snap)))
    assert [f.id for f in d.findings] == ["deferred-free"]
    assert d.findings[0].bytes == 512 * MiB
    assert d.verdict.kind == "deferred-free" and d.verdict.bytes == 512 * MiB
    assert "512.00 MiB at stake" in d.verdict.summary
    # the same final state with the block freed: nothing pending, healthy
    b.complete(x)
    snap = b.snapshot()
    snap["device_traces"] = [[]]
    assert oomdoctor.diagnose(str(_write(tmp_path, snap, "rank1.pickle"))).verdict.kind == "healthy"


def test_a_healthy_state_only_verdict_says_its_numbers(tmp_path):
    """The final state's numbers, each in its place (report/verdict.py state_verdict): allocated and reserved
    at the end, the bytes and the headroom against the device's room."""
    b = SnapBuilder()
    s = b.segment(1024 * MiB)
    b.alloc(s, 0, 256 * MiB)
    snap = b.snapshot()
    snap["device_traces"] = [[]]
    run = tmp_path / "run"
    run.mkdir()
    p = _write(run, snap, "rank3.pickle")
    (run / "rank3.meta.json").write_text(json.dumps({"rank": 3, "device_free_bytes": 3072 * MiB,
                                                     "memory_stats": {"reserved_bytes.all.current": 1024 * MiB}}))
    d = oomdoctor.diagnose(str(p))
    v = d.report.verdict
    assert v.kind == "healthy" and v.ranks == [3] and v.bytes == 1024 * MiB
    assert v.evidence["rank"] == 3
    assert v.evidence["allocated_bytes"] == 256 * MiB
    assert v.evidence["reserved_bytes"] == v.evidence["peak_reserved_bytes"] == 1024 * MiB
    assert v.evidence["room_bytes"] == 4096 * MiB and v.headroom_bytes == 3072 * MiB
    assert d.verdict.summary.startswith("final state only, without allocation history: 256.00 MiB allocated, "
                                        "1.00 GiB reserved, no OOM recorded")


def test_an_empty_snapshot_says_nothing_recorded(tmp_path, capsys):
    p = _write(tmp_path, {"segments": [], "device_traces": [[]]})
    d = oomdoctor.diagnose(str(p))
    assert d.verdict.kind == "empty" and d.verdict.summary.startswith("nothing recorded")
    assert main(["diagnose", str(p), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"]["kind"] == "empty"
    assert main(["diagnose", str(p), "--fail-on", "unhealthy"]) == 1


def test_the_api_skips_what_the_cli_skips_and_renders_its_texts(tmp_path, demo_trace, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.pickle").write_bytes(open(demo_trace.path, "rb").read())
    (run / "ground_truth.json").write_text('{"peak": 1}')
    d = oomdoctor.diagnose(str(run))
    assert [s.path.endswith("ground_truth.json") for s in d.skipped] == [True]
    assert main(["diagnose", str(run), "--format", "json"]) == 0
    out = capsys.readouterr()
    cli = json.loads(out.out)
    assert "ground_truth.json" in out.err  # the CLI names it on standard error
    assert d.verdict.summary == cli["verdict"]["summary"] and "{" not in d.verdict.summary
    assert not hasattr(d.report.verdict, "summary")  # the report keeps the facts (reasons, evidence)
    assert d.verdict.reasons == d.report.verdict.reasons == cli["verdict"]["reasons"]
    assert [f.title for f in d.findings] == [f["title"] for f in cli["findings"]]
    assert d.ranks[0].verdict.summary == cli["ranks"][0]["verdict"]["summary"]
    c = oomdoctor.diff(str(run), str(run))
    assert [s.path.endswith("ground_truth.json") for s in c.skipped] == [True, True]
