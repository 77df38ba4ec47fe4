"""The real H200 snapshots of ``shared/snapshots``: peaks against ``stats.jsonl``, identities, findings."""

import json

import numpy as np
import pytest

from oomdoctor import load, load_ranks
from oomdoctor.analysis import analyze
from oomdoctor.detectors import Context, run_all

GiB = 1 << 30

# snapshot -> (stats.jsonl tag, rank). Each of these traces covers the window its stats measured:
# recording started at or before reset_peak_memory_stats() (see shared/lab/*.py).
COVERED = {
    "tp-allreduce/legacy-rank0.pickle": ("tp-legacy-b4096", 0),
    "tp-allreduce/legacy-rank1.pickle": ("tp-legacy-b4096", 1),
    "tp-allreduce/modern-rank0.pickle": ("tp-modern-b4096", 0),
    "tp-allreduce/noallreduce-rank0.pickle": ("tp-none-b4096", 0),
    "tp-allreduce/legacy-expandable-rank0.pickle": ("tp-legacy-expandable-b4096", 0),
    "pp-microbatch/return-outputs-rank0.pickle": ("pp-m8-ret1", 0),
    "pp-microbatch/return-outputs-rank1.pickle": ("pp-m8-ret1", 1),
    "pp-microbatch/no-return-outputs-rank0.pickle": ("pp-m8-ret0", 0),
    "pp-microbatch/no-return-outputs-rank1.pickle": ("pp-m8-ret0", 1),
    "fragmentation-oom/default-oom.pickle": ("frag-default", 0),
    "fragmentation-oom/expandable-end.pickle": ("frag-expandable", 0),
    "allgather/list-rank0.pickle": ("allgather-list", 0),
    "allgather/tensor-rank0.pickle": ("allgather-tensor", 0),
    "fsdp2-gpt2/rank0.pickle": ("gpt2-fsdp2", 0),
    "fsdp2-gpt2/rank1.pickle": ("gpt2-fsdp2", 1),
    "ddp-imbalance/rank0.pickle": ("ddp-imbalance", 0),
    "ddp-imbalance/rank1.pickle": ("ddp-imbalance", 1),
    "ddp-clean/rank0.pickle": ("ddp-none", 0),
    "ddp-clean/rank1.pickle": ("ddp-none", 1),
}


@pytest.fixture(scope="module")
def stats(snapshots):
    out = {}
    for f in snapshots.glob("*/stats.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            out[(r["tag"], r["rank"])] = r
    return out


def findings(*paths):
    return run_all(Context([analyze(t) for t in load_ranks(paths)]))


def ids(*paths):
    return {f.id for f in findings(*paths)}


@pytest.mark.parametrize("name", sorted(COVERED))
def test_peaks_match_memory_stats(snapshots, stats, name):
    truth = stats[COVERED[name]]
    a = analyze(load(snapshots / name))
    assert a.peak_reserved[0] == truth["max_reserved"]
    assert a.peak_allocated[0] == pytest.approx(truth["max_allocated"], rel=0.01)
    # the timeline ends where the final segments are
    assert a.timeline.reserved[-1] == a.device.final_reserved_bytes
    assert a.timeline.allocated[-1] == sum(b.size for _, b in a.device.blocks if b.is_allocated)
    assert a.timeline.active[-1] == sum(b.size for _, b in a.device.blocks if b.is_active)


@pytest.mark.parametrize("name", sorted(COVERED) + ["tp-allreduce/legacy-cppstacks-rank0.pickle"])
def test_anatomy_identities(snapshots, name):
    a = analyze(load(snapshots / name))
    for k in {a.peak_reserved[1], a.peak_allocated[1], a.end_index, -1}:
        an = a.anatomy_at(k)
        an.check()
        assert an.unattributed_bytes == 0
        assert an.reserved_bytes == a.timeline.at(k)["reserved"]
        assert an.allocated_bytes == a.timeline.at(k)["allocated"]
        assert an.allocated_bytes + an.pending_free_bytes == a.timeline.at(k)["active"]
    # at the end, the reconstruction agrees with the final segments read directly
    end = a.anatomy_at(a.end_index)
    free = sum(b.size for _, b in a.device.blocks if not b.is_active)
    assert end.free_in_used_segments_bytes + end.free_segments_bytes == free
    whole = sum(s.total_size for s in a.device.segments if not any(b.is_active for b in s.blocks))
    assert end.free_segments_bytes == whole


def test_tp_legacy_deferred_free(snapshots):
    (f,) = [f for f in findings(snapshots / "tp-allreduce/legacy-rank0.pickle") if f.id == "deferred-free"]
    assert f.evidence.owner == "collective"
    assert f.ranks == [0]
    assert 1.5 * GiB <= f.evidence.held_at_peak_bytes <= 1.7 * GiB  # ≈ 1.6 GiB held at the peak
    assert f.evidence.peak_reserved_bytes == 3053453312
    assert "all_reduce" in f.evidence.collectives


def test_tp_both_ranks_and_variants(snapshots):
    d = snapshots / "tp-allreduce"
    fs = findings(d / "legacy-rank0.pickle", d / "legacy-rank1.pickle")
    (f,) = [x for x in fs if x.id == "deferred-free"]
    assert f.ranks == [0, 1]
    assert "deferred-free" in ids(d / "legacy-cppstacks-rank0.pickle")
    assert "deferred-free" in ids(d / "legacy-expandable-rank0.pickle")
    for clean in ("modern-rank0.pickle", "noallreduce-rank0.pickle"):
        assert ids(d / clean) == set()


def test_fragmentation_oom(snapshots):
    (f,) = [f for f in findings(snapshots / "fragmentation-oom/default-oom.pickle") if f.id == "fragmentation"]
    e = f.evidence
    assert f.severity == "critical"
    assert e.requested_bytes == 4063232000
    assert round(e.cuda_malloc_bytes / GiB, 2) == 3.79  # "Tried to allocate 3.79 GiB"
    assert round(e.reserved_unallocated_bytes / GiB, 2) == 7.67  # "7.67 GiB is reserved by PyTorch but unallocated"
    assert round(e.allocated_bytes / GiB, 2) == 30.45  # "30.45 GiB is allocated by PyTorch"
    assert e.largest_free_block_bytes < e.requested_bytes <= e.reserved_unallocated_bytes
    # independently of the tool: the OOM is the last event, so the dump's segments are the state at the OOM; the
    # largest inactive block of the OOM's stream and pool, read straight from the pickle (plain data, our own file)
    import pickle

    with open(snapshots / "fragmentation-oom/default-oom.pickle", "rb") as fh:
        raw = pickle.load(fh)
    oom = raw["device_traces"][0][-1]
    assert oom["action"] == "oom"
    free = [blk["size"] for seg in raw["segments"] if seg["stream"] == oom["stream"] and seg["segment_type"] == "large"
            for blk in seg["blocks"] if blk["state"] == "inactive"]
    assert e.largest_free_block_bytes == max(free)
    assert "fragmentation" not in ids(snapshots / "fragmentation-oom/expandable-end.pickle")


def test_pipeline_output_cache(snapshots):
    d = snapshots / "pp-microbatch"
    (f,) = [f for f in findings(d / "return-outputs-rank1.pickle") if f.id == "pipeline-output-cache"]
    assert f.evidence.outputs_kept == 8  # the 8 micro-batches of the recorded step
    assert f.evidence.output_bytes == 2048 * 128256 * 2  # one micro-batch's bf16 logits
    assert f.sites[0].label.endswith("pp_microbatch.py:36 in forward")
    for other in ("no-return-outputs-rank0.pickle", "no-return-outputs-rank1.pickle", "return-outputs-rank0.pickle"):
        assert "pipeline-output-cache" not in ids(d / other)
        assert "deferred-free" not in ids(d / other)  # a few small point-to-point deferrals
    assert "deferred-free" not in ids(d / "return-outputs-rank1.pickle")
    # stages differ by design: the last one holds the LM head; that is not a rank imbalance
    both = ids(d / "return-outputs-rank0.pickle", d / "return-outputs-rank1.pickle")
    assert both == {"pipeline-output-cache"}
    assert ids(d / "no-return-outputs-rank0.pickle", d / "no-return-outputs-rank1.pickle") == set()


def test_allgather(snapshots):
    assert "allgather-list" in ids(snapshots / "allgather/list-rank0.pickle")
    assert "allgather-list" not in ids(snapshots / "allgather/tensor-rank0.pickle")


def test_ddp_imbalance_names_the_kept_logits(snapshots):
    fs = findings(snapshots / "ddp-imbalance")
    (f,) = [x for x in fs if x.id == "rank-imbalance"]
    assert f.ranks == [0]
    assert f.evidence.top_site == "transformers/models/gpt2/modeling_gpt2.py:697 in forward"
    assert f.evidence.top_site_blocks == 4  # logits kept at steps 0, 3, 6, 9
    assert f.evidence.top_site_extra_bytes == pytest.approx(4 * 4 * 1024 * 50257 * 2, rel=0.01)
    assert round(f.evidence.end_allocated_bytes / GiB, 2) == 2.82
    assert round(f.evidence.others_median_end_allocated_bytes / GiB, 2) == 1.29
    assert "rank-imbalance" not in {x.id for x in findings(snapshots / "ddp-clean")}


def test_clean_runs_are_clean(snapshots):
    assert ids(snapshots / "ddp-clean") == set()
    assert "deferred-free" not in ids(snapshots / "fsdp2-gpt2")
    assert ids(snapshots / "fsdp2-gpt2") == set()


@pytest.mark.slow
def test_large_trace(snapshots):
    t = load(snapshots / "large/fsdp2-gpt2-60steps-rank0.pickle.xz")
    assert t.primary.num_events == 271109
    a = analyze(t)
    assert a.steps is not None and len(a.steps) == 60
    assert run_all(Context([a])) == []
    a.anatomy_at(a.peak_reserved[1]).check()


def test_frames_with_cpp_stacks_find_the_user_site(snapshots):
    a = analyze(load(snapshots / "tp-allreduce/legacy-cppstacks-rank0.pickle"))
    sites = a.sites_at(a.peak_allocated[1])
    labels = [a.trace.stacks.frames[s.frame] for s in sites if s.frame >= 0]
    assert ("/workspace/lab/tp_legacy.py", 32, "forward") in labels
    assert np.all(a.lifetimes.size > 0)
