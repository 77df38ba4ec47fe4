"""Each detector fires on a small trace built to show its pattern, and stays quiet on its fixed twin."""

import pickle

from builder import MiB, SnapBuilder, frames

from oomdoctor import load
from oomdoctor.analysis import analyze
from oomdoctor.detectors import (
    Context,
    allgather_list,
    cache_flush,
    deferred_free,
    fragmentation,
    memory_growth,
    pipeline_output_cache,
    rank_imbalance,
    run_all,
    small_long_lived,
)

GiB = 1 << 30


def ctx_of(tmp_path, *builders):
    analyses = []
    for i, b in enumerate(builders):
        analyses.append(analyze(load(b.write(tmp_path / f"rank{i}.pickle"))))
    return Context(analyses)


def tp_like(deferred: bool, layers: int = 12) -> SnapBuilder:
    b = SnapBuilder()
    segs = [b.segment(64 * MiB) for _ in range(layers + 2)]
    live = b.alloc(segs[0], 0, 64 * MiB)
    pending = []
    for i in range(1, layers + 1):
        b.annotate("nccl:all_reduce", "START")
        nxt = b.alloc(segs[i], 0, 64 * MiB)
        b.free(live, deferred=deferred)
        if deferred:
            pending.append(live)
        live = nxt
    for p in pending:
        b.complete(p)
    return b


def test_deferred_free_collective(tmp_path):
    ctx = ctx_of(tmp_path, tp_like(True))
    (f,) = deferred_free.detect(ctx)
    assert f.evidence.owner == "collective"
    assert f.evidence.held_at_peak_bytes == 12 * 64 * MiB
    assert f.bytes == 12 * 64 * MiB
    assert any("TORCH_NCCL_AVOID_RECORD_STREAMS=1" in (x.setting or "") for x in f.fixes)
    assert deferred_free.detect(ctx_of(tmp_path, tp_like(False))) == []


def test_small_short_deferrals_are_not_a_finding(tmp_path):
    b = SnapBuilder()
    s = b.segment(2 * GiB)
    big = b.alloc(s, 0, GiB)
    small = b.alloc(s, GiB, 4 * MiB)
    b.free(small, deferred=True)
    b.complete(small)
    b.free(big)
    assert deferred_free.detect(ctx_of(tmp_path, b)) == []


def frag_oom() -> SnapBuilder:
    b = SnapBuilder()
    segs = [b.segment(100 * MiB) for _ in range(4)]
    for s in segs:  # a live 20 MiB block in the middle of each segment leaves two 40 MiB holes
        b.alloc(s, 40 * MiB, 20 * MiB)
    b.oom(60 * MiB, device_free=0)
    return b


def test_fragmentation_at_oom(tmp_path):
    (f,) = fragmentation.detect(ctx_of(tmp_path, frag_oom()))
    assert f.severity == "critical"
    assert f.evidence.requested_bytes == 60 * MiB
    assert f.evidence.largest_free_block_bytes == 40 * MiB
    assert f.evidence.reserved_unallocated_bytes == 320 * MiB
    assert f.bytes == 320 * MiB
    assert f.fixes[0].setting.endswith("expandable_segments:True")


def test_oom_without_enough_free_memory_is_not_fragmentation(tmp_path):
    b = SnapBuilder()
    s = b.segment(100 * MiB)
    b.alloc(s, 0, 90 * MiB)
    b.oom(60 * MiB, device_free=0)
    assert fragmentation.detect(ctx_of(tmp_path, b)) == []


PP_FRAMES = frames(("/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py", 134, "forward"),
                   ("/w/model.py", 36, "forward"),
                   ("/venv/lib/python3.12/site-packages/torch/distributed/pipelining/stage.py", 699,
                    "forward_one_chunk"),
                   ("/w/train.py", 80, "main"))


def pipeline(cache_outputs: bool, micro: int = 8) -> SnapBuilder:
    b = SnapBuilder()
    s = b.segment(micro * 512 * MiB + 512 * MiB)
    outs = []
    for m in range(micro):
        o = b.alloc(s, m * 512 * MiB, 500 * MiB, fr=PP_FRAMES)
        for _ in range(10):  # the rest of the micro-batch's forward and backward
            act = b.alloc(s, micro * 512 * MiB, 100 * MiB)
            b.free(act)
        if cache_outputs:
            outs.append(o)
        else:
            b.free(o)
    for o in outs:  # _merge_outputs / clear at the end of step()
        b.free(o)
    return b


def test_pipeline_output_cache(tmp_path):
    (f,) = pipeline_output_cache.detect(ctx_of(tmp_path, pipeline(True)))
    assert f.evidence.outputs_kept == 8
    assert f.bytes == 8 * 500 * MiB
    assert f.sites[0].label == "/w/model.py:36 in forward"
    assert "return_outputs=False" in f.fixes[0].setting
    assert pipeline_output_cache.detect(ctx_of(tmp_path, pipeline(False))) == []


AG_FRAMES = frames(("/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", 4079, "all_gather"),
                   ("/w/train.py", 26, "main"))


def test_allgather_list(tmp_path):
    b = SnapBuilder()
    s = b.segment(512 * MiB)
    for _ in range(3):
        flat = b.alloc(s, 0, 64 * MiB, fr=AG_FRAMES)
        b.free(flat)
    (f,) = allgather_list.detect(ctx_of(tmp_path, b))
    assert f.evidence.calls == 3 and f.bytes == 64 * MiB
    b2 = SnapBuilder()
    s2 = b2.segment(512 * MiB)
    out = b2.alloc(s2, 0, 64 * MiB)
    b2.free(out)
    assert allgather_list.detect(ctx_of(tmp_path, b2)) == []


def training(leak_every: int | None, steps: int = 9) -> SnapBuilder:
    b = SnapBuilder()
    s = b.segment(4 * GiB)
    kept = 0
    for step in range(steps):
        b.annotate("Optimizer.step#AdamW.step", "START")
        acts = [b.alloc(s, i * 64 * MiB, 64 * MiB, fr=frames(("/w/model.py", 50 + i, "forward"))) for i in range(4)]
        logits = b.alloc(s, 256 * MiB + kept * 128 * MiB, 128 * MiB, fr=frames(("/w/model.py", 90, "forward")))
        for a in acts:
            b.free(a)
        if leak_every and step % leak_every == 0:
            kept += 1
        else:
            b.free(logits)
        b.annotate("Optimizer.step#AdamW.step", "END")
    return b


def test_memory_growth(tmp_path):
    (f,) = memory_growth.detect(ctx_of(tmp_path, training(leak_every=2)))
    assert f.evidence.steps == 9 and f.evidence.step_source == "annotations"
    assert f.evidence.leaking_steps == [2, 4, 6]
    assert f.bytes == 3 * 128 * MiB
    assert f.sites[0].label == "/w/model.py:90 in forward"
    assert memory_growth.detect(ctx_of(tmp_path, training(leak_every=None))) == []


def test_rank_imbalance(tmp_path):
    ctx = ctx_of(tmp_path, training(leak_every=3), training(None), training(None))
    findings = rank_imbalance.detect(ctx)
    assert [f.ranks for f in findings] == [[0]]
    f = findings[0]
    assert f.evidence.excess_bytes == 3 * 128 * MiB
    assert f.evidence.top_site == "/w/model.py:90 in forward"
    assert rank_imbalance.detect(ctx_of(tmp_path, training(None), training(None))) == []


def test_one_rank_alone_makes_no_profile(tmp_path, monkeypatch):
    # a group needs two ranks: one rank alone is compared with nobody, and its profile (its sites at its peak and
    # end) is made once, by the pipeline for the job's merge, not a second time here
    made = []
    monkeypatch.setattr(rank_imbalance, "profile", lambda a: made.append(a.rank))
    assert rank_imbalance.detect(ctx_of(tmp_path, training(leak_every=3))) == []
    assert made == []


def test_pipeline_stages_are_not_compared_without_their_stage(tmp_path):
    heavy, light = pipeline(False, micro=8), pipeline(False, micro=2)
    assert rank_imbalance.detect(ctx_of(tmp_path, heavy, light)) == []


def test_small_long_lived(tmp_path):
    b = SnapBuilder()
    segs = [b.segment(20 * MiB) for _ in range(40)]
    for s in segs:
        for j in range(8):  # 8 small blocks pinned every 2 MiB, 4 MiB gaps between them
            b.alloc(s, j * 2 * MiB + MiB, 512 * 1024)
    s_big = b.segment(64 * MiB)
    for _ in range(300):  # a long training loop after the small blocks were created
        x = b.alloc(s_big, 0, 64 * MiB)
        b.free(x)
    (f,) = small_long_lived.detect(ctx_of(tmp_path, b))
    assert f.evidence.blocks == 320 and f.evidence.segments_pinned == 40
    assert f.bytes == 40 * (20 * MiB - 8 * 512 * 1024)


EMPTY_CACHE = frames(("/venv/lib/python3.12/site-packages/torch/cuda/memory.py", 224, "empty_cache"),
                     ("/w/train.py", 70, "main"))


def test_cache_flush_churn_and_retries(tmp_path):
    b = SnapBuilder()
    for _ in range(3):
        s = b.segment(256 * MiB)
        x = b.alloc(s, 0, 200 * MiB)
        b.free(x)
        b.free_segment(s, fr=EMPTY_CACHE)
    (f,) = cache_flush.detect(ctx_of(tmp_path, b))
    assert f.evidence.empty_cache_bursts == 3 and f.evidence.freed_bytes == 3 * 256 * MiB
    assert f.variant == "empty-cache"
    b2 = SnapBuilder()
    s = b2.segment(256 * MiB)
    x = b2.alloc(s, 0, 200 * MiB)
    b2.free(x)
    b2.free_segment(s)  # no empty_cache frame: the allocator flushed to retry cudaMalloc
    s = b2.segment(512 * MiB)
    b2.alloc(s, 0, 500 * MiB)
    (f2,) = cache_flush.detect(ctx_of(tmp_path, b2))
    assert f2.evidence.allocator_retry_bursts == 1
    assert cache_flush.detect(ctx_of(tmp_path, training(None))) == []


def test_registry_merges_ranks(tmp_path):
    findings = run_all(ctx_of(tmp_path, tp_like(True), tp_like(True)))
    (f,) = [x for x in findings if x.id == "deferred-free"]
    assert f.ranks == [0, 1] and set(f.per_rank_bytes) == {0, 1}


def test_saved_trace_is_lossless(tmp_path):
    from oomdoctor.trace import load_trace, save_trace

    b = tp_like(True)
    t = load(b.write(tmp_path / "rank0.pickle"))
    save_trace(t, tmp_path / "t.npz")
    u = load_trace(tmp_path / "t.npz")
    for col, arr in t.primary.events.items():
        assert arr.dtype == u.primary.events[col].dtype and (arr == u.primary.events[col]).all()
    assert u.primary.segments == t.primary.segments
    assert u.primary.annotations == t.primary.annotations
    assert u.stacks.frames == t.stacks.frames and u.stacks.stacks == t.stacks.stacks
    assert u.meta == t.meta and u.allocator_settings == t.allocator_settings
    assert pickle.dumps(run_all(Context([analyze(u)]))) == pickle.dumps(run_all(Context([analyze(t)])))
