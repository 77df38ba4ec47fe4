"""What recording without free stacks changes for the analyses, and directories that hold other files
beside the snapshots (metrics, logs, checkpoints)."""

from __future__ import annotations

import collections
import gzip
import json
import pickle
import shutil
import zipfile

import pytest
from builder import USER, MiB, SnapBuilder, frames

from oomdoctor.analysis import analyze
from oomdoctor.cli.main import main
from oomdoctor.detectors import cache_flush
from oomdoctor.detectors.context import Context
from oomdoctor.report import build_report
from oomdoctor.report.build import NO_FREE_STACKS, NO_STACKS
from oomdoctor.trace import load, load_ranks
from oomdoctor.trace.reader import sniff

ALLOC_SITE = frames(("/w/train.py", 40, "make_buffer"), ("/w/train.py", 70, "main"))
EMPTY_CACHE = frames(("/venv/lib/python3.12/site-packages/torch/cuda/memory.py", 224, "empty_cache"),
                     ("/w/train.py", 71, "main"))


def churn(free_stacks: bool) -> SnapBuilder:
    """Three steps, each allocating 10 buffers then calling empty_cache(). With ``free_stacks`` the frees
    carry their own stacks (context='all'); without, the stack of the allocation, as PyTorch records
    them under context='alloc' (a segment free: the stack of the segment's allocation)."""
    b = SnapBuilder()
    for _ in range(3):
        s = b.segment(256 * MiB)
        xs = [b.alloc(s, i * 20 * MiB, 20 * MiB, fr=ALLOC_SITE) for i in range(10)]
        for x in xs:
            b.free(x, fr=USER if free_stacks else ALLOC_SITE)
        b.free_segment(s, fr=EMPTY_CACHE if free_stacks else USER)
    return b


def analysis(tmp_path, b: SnapBuilder, meta: dict | None = None, name: str = "rank0"):
    path = b.write(tmp_path / f"{name}.pickle")
    if meta is not None:
        (tmp_path / f"{name}.meta.json").write_text(json.dumps(meta))
    return analyze(load(path))


def test_free_stacks_inferred_from_the_trace_or_read_from_the_sidecar(tmp_path):
    assert analysis(tmp_path, churn(True)).free_stacks
    assert not analysis(tmp_path, churn(False), name="rank1").free_stacks  # 30 of 30 frees share the alloc stack
    # the sidecar's word wins over the inference
    assert not analysis(tmp_path, churn(True), {"rank": 2, "recording": {"context": "alloc"}}, "rank2").free_stacks
    assert analysis(tmp_path, churn(False), {"rank": 3, "recording": {"context": "all"}}, "rank3").free_stacks


def test_cache_flush_without_free_stacks(tmp_path):
    # with free stacks: three empty_cache() bursts, read off the frames
    (f,) = cache_flush.detect(Context([analysis(tmp_path, churn(True))]))
    assert f.evidence.empty_cache_bursts == 3 and f.evidence.bursts_classified_by == "free stacks"
    # without, an oomdoctor sidecar's num_alloc_retries = 0 says none of the bursts was a retry
    a = analysis(tmp_path, churn(False), {"rank": 1, "recording": {"context": "alloc"},
                                          "memory_stats": {"num_alloc_retries": 0}}, "rank1")
    (f,) = cache_flush.detect(Context([a]))
    assert f.evidence.empty_cache_bursts == 3 and f.evidence.allocator_retry_bursts == 0
    assert f.evidence.bursts_classified_by == "memory_stats" and f.variant == "empty-cache"
    # and num_alloc_retries = 3 that all three were
    a = analysis(tmp_path, churn(False), {"rank": 2, "recording": {"context": "alloc"},
                                          "memory_stats": {"num_alloc_retries": 3}}, "rank2")
    (f,) = cache_flush.detect(Context([a]))
    assert f.evidence.allocator_retry_bursts == 3 and f.variant == "retries"
    # with neither (a user's own _dump_snapshot with context='alloc'), the finding says it cannot tell, LOW
    (f,) = cache_flush.detect(Context([analysis(tmp_path, churn(False), name="rank3")]))
    assert f.evidence.bursts_classified_by == "unknown" and f.severity == "low"
    assert f.variant == "churn-unknown"


def test_report_says_free_stacks_are_missing(tmp_path, snapshots):
    assert NO_FREE_STACKS in build_report([load(churn(False).write(tmp_path / "rank0.pickle"))]).ranks[0].warnings
    real = build_report([load(snapshots / "ddp-clean" / "rank0.pickle")])  # recorded with context='all'
    assert NO_FREE_STACKS not in real.ranks[0].warnings
    path = churn(False).write(tmp_path / "rank1.pickle")
    (tmp_path / "rank1.meta.json").write_text(json.dumps({"rank": 1, "recording": {"stacks": "none", "context": None}}))
    assert build_report([load(path)]).ranks[0].warnings == [NO_STACKS]


def test_real_snapshot_stripped_of_free_stacks_keeps_its_findings(tmp_path, snapshots):
    """A shared snapshot rewritten as context='alloc' records it (each free takes its allocation's frames):
    the peaks are the same, and the deferred-free finding of seed 000 still holds."""
    snap = pickle.loads((snapshots / "tp-allreduce" / "legacy-rank0.pickle").read_bytes())
    alloc_frames = {}
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            alloc_frames[e["addr"]] = e["frames"]
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in alloc_frames:
            e["frames"] = alloc_frames[e["addr"]]
    (tmp_path / "rank0.pickle").write_bytes(pickle.dumps(snap))
    before = build_report([load(snapshots / "tp-allreduce" / "legacy-rank0.pickle")])
    after = build_report([load(tmp_path / "rank0.pickle")])
    assert NO_FREE_STACKS in after.ranks[0].warnings
    assert after.ranks[0].peak_reserved_bytes == before.ranks[0].peak_reserved_bytes
    assert {f.id for f in after.findings} == {f.id for f in before.findings} and "deferred-free" in {
        f.id for f in after.findings}


# ---- directories that hold other files --------------------------------------------------------------

def mixed_dir(tmp_path, snapshots, with_snapshots: bool = True):
    d = tmp_path / "run"
    (d / "checkpoint-10").mkdir(parents=True)
    if with_snapshots:
        for r in (0, 1):
            shutil.copy(snapshots / "ddp-clean" / f"rank{r}.pickle", d / f"rank{r}.pickle")
    (d / "metrics.json").write_text('{"train_loss": 1.5, "epoch": 3}')
    (d / "train.log").write_text("step 1 loss 2.0\n")
    (d / "optimizer.pkl").write_bytes(pickle.dumps(collections.OrderedDict(step=1)))
    (d / "state.pkl.gz").write_bytes(gzip.compress(pickle.dumps(collections.Counter(a=1))))
    with zipfile.ZipFile(d / "model.pt.json", "w") as z:  # a torch.save archive under a misleading name
        z.writestr("archive/data.pkl", "x")
    (d / "rank5.pickle").write_bytes((snapshots / "ddp-clean" / "rank0.pickle").read_bytes()[:4096])  # cut off
    return d


def test_sniff_names_checkpoints_without_reading_them_whole(tmp_path, snapshots):
    d = mixed_dir(tmp_path, snapshots)
    assert "zip archive" in sniff(str(d / "model.pt.json"))
    assert "STACK_GLOBAL" in sniff(str(d / "optimizer.pkl"))
    assert "pickle of Python objects" in sniff(str(d / "state.pkl.gz"))  # through gzip
    assert sniff(str(d / "rank0.pickle")) is None
    assert sniff(str(d / "metrics.json")) == "is not a memory snapshot: no 'segments' key (keys: epoch, train_loss)"
    assert sniff(str(snapshots / "large" / "fsdp2-gpt2-60steps-rank0.pickle.xz")) is None  # xz: the first MiB
    assert sniff(str(d / "optimizer.pkl"), walk=False) is None  # small files: the full load refuses them
    assert "zip archive" in sniff(str(d / "model.pt.json"), walk=False)


def test_directory_with_other_files_loads_its_snapshots_and_lists_the_rest(tmp_path, snapshots):
    d = mixed_dir(tmp_path, snapshots)
    skipped = []
    traces = load_ranks([d], skipped=skipped)
    assert [t.rank for t in traces] == [0, 1]
    reasons = {s.path.rsplit("/", 1)[1]: s.reason for s in skipped}
    assert set(reasons) == {"checkpoint-10", "metrics.json", "train.log", "optimizer.pkl", "state.pkl.gz",
                            "model.pt.json", "rank5.pickle"}
    assert "no 'segments' key" in reasons["metrics.json"] and "truncated" in reasons["rank5.pickle"]
    # the cut-off rank5.pickle is a rank lost, not a file beside the snapshots (issue 52)
    assert {s.path.rsplit("/", 1)[1]: s.rank for s in skipped if s.rank is not None} == {"rank5.pickle": 5}
    with pytest.raises(Exception, match="truncated"):  # a file named on the command line must load
        load_ranks([d / "rank5.pickle"])


def test_cli_diagnoses_a_mixed_directory_and_names_what_it_skipped(tmp_path, snapshots, capsys):
    d = mixed_dir(tmp_path, snapshots)
    assert main(["diagnose", "--format", "json", str(d)]) == 0
    out, err = capsys.readouterr()
    assert [r["rank"] for r in json.loads(out)["ranks"]] == [0, 1]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    # the files beside the snapshots on one line; the cut-off rank 5 on its own, and in the JSON (issue 52)
    assert len(lines) == 2 and lines[0].startswith("oomdoctor: skipped 6 files") and "metrics.json" in lines[0]
    assert lines[1].startswith("oomdoctor: rank 5 could not be read") and "rank5.pickle (rank 5)" in lines[1]
    assert [u["rank"] for u in json.loads(out)["unread"]] == [5]


def test_a_json_file_beside_one_snapshot_takes_no_rank_from_it(tmp_path, snapshots, capsys):
    # a job's own ground_truth.json sorted before snapshot.pickle made the snapshot "rank 1" (path order)
    d = tmp_path / "job"
    d.mkdir()
    shutil.copy(snapshots / "ddp-clean" / "rank0.pickle", d / "snapshot.pickle")
    (d / "ground_truth.json").write_text('{"parameters_bytes": 1, "oom": null}')
    assert main(["diagnose", "--format", "json", str(d)]) == 0
    out, err = capsys.readouterr()
    assert [r["rank"] for r in json.loads(out)["ranks"]] == [0]
    assert "ground_truth.json (is not a memory snapshot: no 'segments' key (keys: oom, parameters_bytes))" in err
    assert [t.rank for t in load_ranks([d], skipped=[])] == [0]


def test_cli_fails_only_when_no_snapshot_is_found(tmp_path, snapshots, capsys):
    d = mixed_dir(tmp_path, snapshots, with_snapshots=False)
    assert main(["diagnose", str(d)]) == 2
    err = capsys.readouterr().err
    assert "none of the 7 files in this directory is a snapshot that loads" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    empty = tmp_path / "only-logs"
    empty.mkdir()
    (empty / "train.log").write_text("x")
    assert main(["diagnose", str(empty)]) == 2
    assert "holds no snapshot files" in capsys.readouterr().err
