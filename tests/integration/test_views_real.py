"""diff, slice, export and report on the real H200 snapshots of ``shared/snapshots``."""

import json
import pickle
from pathlib import Path

import jsonschema
import pytest

from oomdoctor import load
from oomdoctor.analysis import analyze
from oomdoctor.cli.main import main

SCHEMA = json.loads((Path(__file__).parents[1] / "data" / "trace_event_format.schema.json").read_text())
MiB = 1 << 20


def _stats(snapshots: Path, folder: str, tag: str, rank: int) -> dict:
    for line in (snapshots / folder / "stats.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("tag") == tag and row.get("rank") == rank:
            return row
    raise KeyError(tag)


def test_diff_tp_legacy_vs_modern_resolves_deferred_free(snapshots, capsys):
    tp = snapshots / "tp-allreduce"
    assert main(["diff", str(tp / "legacy-rank0.pickle"), str(tp / "modern-rank0.pickle"), "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    legacy = _stats(snapshots, "tp-allreduce", "tp-legacy-b4096", 0)["max_reserved"]
    modern = _stats(snapshots, "tp-allreduce", "tp-modern-b4096", 0)["max_reserved"]
    r = d["ranks"][0]
    assert (r["before_peak_reserved_bytes"], r["after_peak_reserved_bytes"]) == (legacy, modern)
    assert r["peak_reserved_saved_bytes"] == legacy - modern == 1_744_830_464  # 1.62 GiB
    assert r["peak_allocated_saved_bytes"] == 0
    f = {x["id"]: x for x in d["findings"]}
    assert f["deferred-free"]["status"] == "resolved"
    assert f["deferred-free"]["peak_reserved_saved_bytes"] == legacy - modern
    assert not [x for x in d["findings"] if x["status"] == "new"]
    # pending free at peak reserved goes; the all-reduce'd activations' site shrinks most
    assert r["before_anatomy"]["pending_free_bytes"] > 1600 * MiB and r["after_anatomy"]["pending_free_bytes"] == 0
    top = r["sites"][0]
    assert top["label"].endswith("tp_legacy.py:32 in forward") and top["delta_bytes"] < -1600 * MiB
    # the text form says the same in words
    assert main(["diff", str(tp / "legacy-rank0.pickle"), str(tp / "modern-rank0.pickle"), "-o",
                 str(snapshots.parent / "nonexistent-dir" / "x.txt")]) == 2
    capsys.readouterr()


def test_diff_text_names_the_resolved_finding(snapshots, tmp_path):
    tp = snapshots / "tp-allreduce"
    out = tmp_path / "diff.txt"
    assert main(["diff", str(tp / "legacy-rank0.pickle"), str(tp / "modern-rank0.pickle"), "-o", str(out)]) == 0
    text = out.read_text()
    assert "resolved [deferred-free]" in text and "+1.62 GiB" in text


def test_diff_directories_pair_ranks(snapshots, tmp_path, capsys):
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir(), after.mkdir()
    for r in (0, 1):
        (before / f"rank{r}.pickle").symlink_to(snapshots / "ddp-imbalance" / f"rank{r}.pickle")
        (after / f"rank{r}.pickle").symlink_to(snapshots / "ddp-clean" / f"rank{r}.pickle")
    assert main(["diff", str(before), str(after), "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in d["ranks"]] == [0, 1]
    f = {x["id"]: x for x in d["findings"]}
    assert f["rank-imbalance"]["status"] == "resolved"
    r0 = d["ranks"][0]
    # these traces start after reset_peak_memory_stats, so peaks come from the traces, not stats.jsonl
    imb, clean = analyze(load(before / "rank0.pickle")), analyze(load(after / "rank0.pickle"))
    assert r0["peak_allocated_saved_bytes"] == imb.peak_allocated[0] - clean.peak_allocated[0] == 1_647_591_424
    assert d["ranks"][1]["peak_allocated_saved_bytes"] == 0


def test_slice_by_step_reloads_with_the_window_peaks(snapshots, tmp_path):
    src = snapshots / "fragmentation-oom" / "default-oom.pickle"
    out = tmp_path / "steps2-3.pickle"
    assert main(["slice", str(src), "--by", "step", "--start", "2", "--end", "4", "-o", str(out)]) == 0
    meta = json.loads((tmp_path / "steps2-3.meta.json").read_text())["sliced_from"]
    lo, hi = meta["start_event"], meta["end_event"]
    a = analyze(load(src))
    s = analyze(load(out))
    assert s.num_events == hi - lo and 0 < lo < hi < a.num_events
    assert s.peak_reserved[0] == int(a.timeline.reserved[lo:hi].max())
    assert s.peak_allocated[0] == int(a.timeline.allocated[lo:hi].max())
    assert int(s.timeline.active.max()) == int(a.timeline.active[lo:hi].max())
    start, orig = s.anatomy_at(-1), a.anatomy_at(lo - 1)
    start.check()
    assert start.unattributed_bytes == 0
    assert (start.reserved_bytes, start.allocated_bytes) == (orig.reserved_bytes, orig.allocated_bytes)
    assert out.stat().st_size < src.stat().st_size
    # PyTorch's own reader of the format walks it too
    mv = pytest.importorskip("torch.cuda._memory_viz")
    snap = pickle.loads(out.read_bytes())
    assert mv.trace(snap).count("\n") > hi - lo
    assert "Summary of segments" in mv.segsum(snap)


def test_slice_by_time_and_the_oom_window(snapshots, tmp_path):
    src = snapshots / "fragmentation-oom" / "default-oom.pickle"
    a = analyze(load(src))
    out = tmp_path / "tail.pickle"
    assert main(["slice", str(src), "--by", "event", "--start", str(a.num_events - 500), "-o", str(out)]) == 0
    s = analyze(load(out))
    assert s.oom_events.tolist() == [499]
    assert s.peak_reserved[0] == int(a.timeline.reserved[-500:].max())
    t = tmp_path / "first-second.pickle"
    assert main(["slice", str(src), "--by", "time", "--start", "0", "--end", "1s", "-o", str(t)]) == 0
    s = analyze(load(t))
    assert 0 < s.num_events < a.num_events
    assert int(s.device.events["time_us"][-1] - a.device.events["time_us"][0]) < 1_000_000


def test_export_perfetto_two_ranks_validates(snapshots, tmp_path):
    tp = snapshots / "tp-allreduce"
    out = tmp_path / "trace.json"
    assert main(["export", str(tp / "legacy-rank0.pickle"), str(tp / "legacy-rank1.pickle"), "--format",
                 "perfetto", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SCHEMA)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {"oomdoctor rank 0 (cuda:0)", "oomdoctor rank 1 (cuda:1)"}
    for r in (0, 1):
        res = [e["args"]["bytes"] for e in doc["traceEvents"]
               if e["pid"] == 1_000_000 + r and e["name"] == "CUDA reserved bytes"]
        assert max(res) == _stats(snapshots, "tp-allreduce", "tp-legacy-b4096", r)["max_reserved"]


def test_export_marks_the_oom(snapshots, tmp_path):
    out = tmp_path / "oom.json"
    assert main(["export", str(snapshots / "fragmentation-oom" / "default-oom.pickle"), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SCHEMA)
    oom = [e for e in doc["traceEvents"] if e["ph"] == "i" and e["name"] == "OOM"]
    assert len(oom) == 1 and oom[0]["args"]["requested_bytes"] == 4_063_232_000


def test_diagnose_html_of_a_real_snapshot(snapshots, tmp_path):
    out = tmp_path / "r.html"
    assert main(["diagnose", str(snapshots / "fragmentation-oom" / "default-oom.pickle"), "--format", "html",
                 "-o", str(out)]) == 0
    page = out.read_text()
    assert "Out of memory with enough free memory" in page and "7.67 GiB" in page
    assert "default-src 'none'" in page


@pytest.mark.parametrize("args, message", [
    (["slice", "{src}", "--start", "5", "--end", "5", "-o", "{tmp}/x.pickle"], "holds no event"),
    (["slice", "{src}", "--by", "step", "--start", "0", "--end", "99", "-o", "{tmp}/x.pickle"], "outside the 8 steps"),
    (["slice", "{src}", "--by", "time", "--start", "soon", "-o", "{tmp}/x.pickle"], "bad time 'soon'"),
    (["slice", "{src}", "-o", "{src}"], "would overwrite the input"),
    (["slice", "{tmp}/missing.pickle", "-o", "{tmp}/x.pickle"], "missing.pickle"),
    (["diff", "{tmp}/garbage.pickle", "{src}"], "garbage.pickle"),
    (["export", "{tmp}/garbage.pickle"], "garbage.pickle"),
    (["report", "{tmp}/garbage.pickle", "-o", "{tmp}/r.html"], "garbage.pickle"),
])
def test_bad_input_is_one_line_and_exit_2(snapshots, tmp_path, capsys, args, message):
    (tmp_path / "garbage.pickle").write_bytes(b"\x80\x04not a pickle at all")
    src = snapshots / "fragmentation-oom" / "default-oom.pickle"
    argv = [a.format(src=src, tmp=tmp_path) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("oomdoctor: error:") and message in err[0], err
