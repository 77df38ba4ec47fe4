"""Issue 41 on the corpus's wrapped runs (``docs/corpus/wrapped-*``: ``oomdoctor run``'s 100,000-entry ring buffer
wrapped, the trace starts mid-job). Four ways to hold the same snapshots:

- as recorded: the sidecars have ``memory_stats`` (the whole dict, read at the dump): the job's peaks are exact;
- a sidecar of the new format: ``device_counters`` built from the job's own numbers (``ground_truth.json``'s
  ``max_memory_allocated`` / ``max_memory_reserved`` for rank 0), ``memory_stats`` dropped;
- an old sidecar without any counter: peaks before the window are not known;
- no sidecar at all (a plain ``_dump_snapshot``): the same.

In each, the text and the JSON give the job's peak (exact) or say it is not known; the verdict's headroom and
what fits use it; the retry counts are the sidecar's ``num_alloc_retries``."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from oomdoctor.render.json import render_json
from oomdoctor.render.text import render_text_plain
from oomdoctor.render.words import verdict as verdict_words
from oomdoctor.report import build_report
from oomdoctor.trace import load_ranks

CORPUS = Path(__file__).resolve().parents[2] / "docs" / "corpus"
WRAPPED = sorted(p.name[: -len(".tar.xz")] for p in CORPUS.glob("wrapped-*.tar.xz"))


def unpack(tmp_path: Path, name: str) -> Path:
    with tarfile.open(CORPUS / f"{name}.tar.xz") as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / name


def _sidecars(run: Path) -> dict[int, Path]:
    return {int(p.name[4:p.name.index(".")]): p for p in run.glob("rank*.meta.json")}


def analyses(run):
    from oomdoctor.analysis import analyze

    return [analyze(t) for t in load_ranks([run], skipped=[])]


def _rewrite(run: Path, how: str, truth: dict) -> None:
    for rank, p in _sidecars(run).items():
        meta = json.loads(p.read_text())
        stats = meta.pop("memory_stats")
        if how == "none":
            p.unlink()
            continue
        if how == "new":
            own = {"allocated_bytes.all.peak": truth["max_memory_allocated"],
                   "reserved_bytes.all.peak": truth["max_memory_reserved"],
                   "device_free_bytes": truth["device_free_at_end_bytes"]} if rank == 0 else {
                "device_free_bytes": meta["device_free_bytes"]}
            rec = {"device": meta["device"], "time_us": meta["written_time_us"],
                   **{k: stats[k] for k in ("allocated_bytes.all.peak", "reserved_bytes.all.peak",
                                            "active_bytes.all.peak", "allocated_bytes.all.current",
                                            "reserved_bytes.all.current", "num_alloc_retries", "num_ooms",
                                            "num_device_alloc", "num_device_free")},
                   "device_total_bytes": truth["gpu_total_memory_bytes"],
                   "gpu_total_memory_bytes": truth["gpu_total_memory_bytes"], **own}
            meta["device_counters"] = [rec]
        p.write_text(json.dumps(meta))


@pytest.mark.parametrize("name", WRAPPED)
@pytest.mark.parametrize("how", ["recorded", "new", "old", "none"])
def test_the_jobs_peak_exact_with_a_sidecar_and_unknown_without(tmp_path, name, how):
    run = unpack(tmp_path, name)
    truth = json.loads((run / "ground_truth.json").read_text())  # rank 0's own torch.cuda numbers at its end
    recorded = {r: json.loads(p.read_text())["memory_stats"] for r, p in _sidecars(run).items()}
    if how != "recorded":
        _rewrite(run, how, truth)
    report = build_report(load_ranks([run], skipped=[]), micro_batch=truth["batch"])
    text = render_text_plain(report, width=200)
    js = json.loads(render_json(report))
    assert len(report.ranks) == truth["world_size"] == 2
    for r, jr in zip(report.ranks, js["ranks"]):
        assert r.truncated  # the ring buffer wrapped: the trace starts mid-job
        stats = recorded[r.rank]
        if how in ("recorded", "new"):
            want_a, want_r = ((truth["max_memory_allocated"], truth["max_memory_reserved"]) if r.rank == 0 else
                              (stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]))
            assert (r.job_peak_allocated_bytes, r.job_peak_reserved_bytes, r.peak_source) == (want_a, want_r,
                                                                                              "sidecar")
            assert (jr["job_peak_allocated_bytes"], jr["job_peak_reserved_bytes"], jr["peak_source"]) == (
                want_a, want_r, "sidecar")
            # the retries are the allocator's own count
            assert r.alloc_retries == jr["alloc_retries"] == stats["num_alloc_retries"]
            assert r.alloc_ooms == stats["num_ooms"] and r.alloc_retries_source == "sidecar"
            # the job's peak allocated is above the window's on every rank (by 20.5 to 660.5 MiB), the reserved one
            # nowhere; the window missed it only where that is more than the trace can undercount (issue 49: 1 MiB
            # per large block sized from its request, the most alive at once; analysis/jobpeak.py): rank 0 of the
            # accelerate job (660.5 MiB), not the others (20.5 and 23.2 MiB, within it)
            assert r.peak_allocated_bytes < want_a
            from oomdoctor.analysis.jobpeak import allocated_undercount_bound
            a = [x for x in analyses(run) if x.rank == r.rank][0]
            missed = want_a - r.peak_allocated_bytes > allocated_undercount_bound(a.lifetimes, a.num_events)
            assert missed is (name == "wrapped-accelerate-ddp-llama-b16" and r.rank == 0)
            assert r.allocated_peak_missed is missed and not r.reserved_peak_missed
            # the verdict's headroom is the room less the job's peak reserved
            v = r.verdict
            assert v.kind == "healthy" and v.evidence["peak_reserved_bytes"] == want_r
            assert v.headroom_bytes == r.fits.room_bytes - want_r
            assert v.evidence["window_peak_allocated_bytes"] == r.peak_allocated_bytes
            # said as a miss only where it is one and the gap is material (issue 52: 29.70 vs 29.72 GiB is not)
            material = missed and want_a - r.peak_allocated_bytes >= max(0.01 * want_a, 64 * 2**20)
            assert r.allocated_peak_missed_material is material
            assert ("the window missed it" in jr["verdict"]["summary"]) is material
            if missed and not material:
                assert f"(the job's; {_gib(r.peak_allocated_bytes)} in the recorded window)" in jr["verdict"]["summary"]
            # what fits is held to the job's peak where the window missed it
            assert r.fits.job_peak_reserved_bytes == want_r and r.fits.peak_source == "sidecar"
            assert (r.fits.job_peak_scale_bound is not None) is missed
            if r.fits.batch_scale is not None and missed:
                assert r.fits.batch_scale <= r.fits.job_peak_scale_bound
            if missed:
                assert f"the job's peak {_gib(want_a)}" in text
        else:
            assert (r.job_peak_allocated_bytes, r.job_peak_reserved_bytes, r.peak_source) == (
                None, None, "unknown-before-window")
            assert (jr["job_peak_allocated_bytes"], jr["peak_source"]) == (None, "unknown-before-window")
            assert r.alloc_retries is None and r.alloc_retries_source == "unknown"
            assert not r.allocated_peak_missed and not r.reserved_peak_missed
            assert "peaks-before-window-unknown" in r.verdict.reasons
            assert "Peaks before the recorded window are not known" in verdict_words.summary(r.verdict)
            if how == "old":  # the room is the sidecar's; without one, the GPU's size is not known
                assert r.verdict.headroom_bytes == r.fits.room_bytes - r.peak_reserved_bytes
                if r.fits.batch_scale is not None:
                    assert "peaks-before-window-unknown" in r.fits.notes
            else:
                assert r.verdict.headroom_bytes is None and r.fits.room_bytes is None
    if how in ("old", "none"):
        assert text.count("peaks before the recorded window are not known: the trace starts after the job's first "
                          "allocation") == 2  # on each rank's peak lines


def _gib(b: int) -> str:
    return f"{b / 2**30:.2f} GiB"


# The new run of issue 41 (recorded on an H200 this round, docs/diagnose.md "The job's own peak"): an inference job
# whose prefill peak falls out of a 20,000-entry ring buffer before a 255-token decode.
def test_a_prefill_peak_outside_the_window_is_the_jobs_own_with_the_sidecar(tmp_path):
    run = unpack(tmp_path, "prefill-window-oomdoctor")
    truth = json.loads((run / "ground_truth.json").read_text())
    report = build_report(load_ranks([run], skipped=[]))
    r0 = report.ranks[0]
    assert r0.peak_source == "sidecar"
    assert r0.job_peak_allocated_bytes == truth["prefill_max_memory_allocated"] == 5_222_468_608
    assert r0.job_peak_reserved_bytes == truth["max_memory_reserved"]
    assert r0.allocated_peak_missed and r0.peak_allocated_bytes < 0.2 * r0.job_peak_allocated_bytes
    assert r0.alloc_retries == truth["memory_stats"]["num_alloc_retries"] == 0
    data = json.loads(render_json(report))
    assert data["ranks"][0]["job_peak_allocated_bytes"] == 5_222_468_608
    text = render_text_plain(report)
    assert "4.86 GiB" in text and "the window missed" in text


def test_the_same_job_without_a_sidecar_says_the_peaks_before_the_window_are_not_known(tmp_path):
    run = unpack(tmp_path, "prefill-window-plain")
    report = build_report(load_ranks([run], skipped=[]))
    r0 = report.ranks[0]
    assert r0.peak_source == "unknown-before-window"
    assert r0.job_peak_allocated_bytes is None and r0.job_peak_reserved_bytes is None
    assert json.loads(render_json(report))["ranks"][0]["peak_source"] == "unknown-before-window"
    assert "not known" in render_text_plain(report)
