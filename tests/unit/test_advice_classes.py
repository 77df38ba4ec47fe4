"""Advice that fits the job (issue 49, item 5), rule by rule, on traces built in code (``builder.SnapBuilder``): ids
and bytes, not words.

- a caught OOM whose exception keeps the failed attempt's tensors while the same code runs again is a
  ``kept-exception`` finding and, where those tensors cover the shortfall, the verdict (its fix: leave the except
  block); a job that leaves the block before retrying has none;
- pipeline knobs only where the job runs a pipeline (sidecar stage, a pipeline framework, point-to-point transfers,
  several micro-batches' losses in one forward run), never for two passes alive alone;
- an OOM inside ``optimizer.step()`` is told about the optimizer's memory, never a smaller micro-batch or
  checkpointing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from builder import MiB, SnapBuilder, frames
from test_accounting import BACKWARD, OPT_STATE, OPT_TMP, SETUP, TORCH, model

from oomdoctor import load
from oomdoctor.analysis import analyze
from oomdoctor.analysis.schedule import schedule_evidence
from oomdoctor.detectors import kept_exception
from oomdoctor.detectors.context import Context
from oomdoctor.report.pipeline import report_of
from oomdoctor.report.verdict import Action, Verdict, _actions

SIDE = {"format": "oomdoctor.sidecar/1", "rank": 0, "world_size": 1, "gpu_total_memory_bytes": 3 << 30}
LOSS = frames((f"{TORCH}/nn/functional.py", 3104, "cross_entropy"), ("/w/train.py", 32, "main"))


def analysed(tmp_path, b: SnapBuilder, meta: dict | None = None):
    path = b.write(tmp_path / "rank0.pickle")
    (tmp_path / "rank0.meta.json").write_text(json.dumps({**SIDE, **(meta or {})}))
    return analyze(load(path))


def two_steps(b: SnapBuilder, seg: int) -> None:
    """Parameters (2 x 64 MiB at 0), then two training steps: three 128 MiB activations at 512 MiB, two 64 MiB
    gradients at 896 MiB, Adam's four 64 MiB moments at 128 MiB (made at step 0), an 8 MiB temporary at 384 MiB."""
    for i in range(2):
        b.alloc(seg, i * 64 * MiB, 64 * MiB, fr=SETUP)
    for step in range(2):
        acts = [b.alloc(seg, (512 + 128 * i) * MiB, 128 * MiB, fr=model(20 + i)) for i in range(3)]
        grads = [b.alloc(seg, (896 + 64 * i) * MiB, 64 * MiB, fr=BACKWARD) for i in range(2)]
        for x in acts:
            b.free(x)
        if step == 0:
            for i in range(4):
                b.alloc(seg, (128 + 64 * i) * MiB, 64 * MiB, fr=OPT_STATE)
        b.free(b.alloc(seg, 384 * MiB, 8 * MiB, fr=OPT_TMP))
        for g in grads:
            b.free(g)


def retry_after_oom(inside: bool) -> SnapBuilder:
    """Two steps, then a third at a larger batch: three 256 MiB activations at 512 MiB, and an OOM asking for 800 MiB
    (caught). The retry at the old batch runs the same layers again (two 128 MiB activations) and runs out asking
    for 700 MiB. ``inside``: the retry is written inside the ``except`` block (the failed attempt's activations are
    still allocated); else it leaves the block first (they are freed before it)."""
    b = SnapBuilder()
    seg = b.segment(2048 * MiB)
    two_steps(b, seg)
    failed = [b.alloc(seg, (512 + 256 * i) * MiB, 256 * MiB, fr=model(20 + i)) for i in range(3)]
    b.oom(800 * MiB, device_free=0)
    if not inside:
        for x in failed:
            b.free(x)
    base = 1280 if inside else 512
    for i in range(2):
        b.alloc(seg, (base + 128 * i) * MiB, 128 * MiB, fr=model(20 + i))
    b.oom(700 * MiB if inside else 1400 * MiB, device_free=0)
    return b


# --------------------------------------------------------------------------- kept exception


def test_a_retry_inside_the_except_block_holds_the_failed_attempt(tmp_path):
    a = analysed(tmp_path, retry_after_oom(inside=True))
    (f,) = kept_exception.detect(Context([a]))
    first_oom, last_oom = a.oom_events.tolist()
    assert (f.id, f.severity, f.bytes) == ("kept-exception", "high", 3 * 256 * MiB)
    assert f.evidence.oom_event == first_oom and f.evidence.retry_event == first_oom + 1
    assert f.evidence.held_blocks == 3 and f.evidence.held_at_last_oom_bytes == 3 * 256 * MiB
    assert f.evidence.caught_ooms == 1 and [x.id for x in f.fixes] == ["release-exception"]
    # the verdict at the last OOM: the live tensors (1408 MiB) and the request (700 MiB) are 60 MiB above the 2 GiB
    # room; the 768 MiB the exception holds cover it: kept-exception, its fix first, no capacity advice
    v = report_of([a]).verdict
    assert (v.kind, v.bytes, v.finding) == ("kept-exception", 3 * 256 * MiB, "kept-exception")
    assert v.evidence["shortfall_bytes"] == 60 * MiB and v.evidence["kept_oom_event"] == first_oom
    assert [(x.id, x.fix.id) for x in v.to_do] == [("finding-fix", "release-exception")]
    assert last_oom == a.num_events - 1


def test_a_retry_after_leaving_the_except_block_holds_nothing(tmp_path):
    a = analysed(tmp_path, retry_after_oom(inside=False))
    assert kept_exception.detect(Context([a])) == []
    assert report_of([a]).verdict.kind != "kept-exception"


def test_an_oom_the_job_did_not_catch_is_no_kept_exception(tmp_path):
    b = SnapBuilder()
    seg = b.segment(2048 * MiB)
    two_steps(b, seg)
    for i in range(3):
        b.alloc(seg, (512 + 256 * i) * MiB, 256 * MiB, fr=model(20 + i))
    b.oom(800 * MiB, device_free=0)
    assert kept_exception.detect(Context([analysed(tmp_path, b)])) == []


# --------------------------------------------------------------------------- pipeline advice needs a pipeline


def forwards(losses: bool) -> SnapBuilder:
    """Parameters, then two micro-batches' forwards (three 128 MiB activations each), each ending in a 64 MiB loss
    when ``losses`` (a GPipe schedule on one GPU), and an OOM asking for 1500 MiB: capacity."""
    b = SnapBuilder()
    seg = b.segment(2048 * MiB)
    for i in range(2):
        b.alloc(seg, i * 64 * MiB, 64 * MiB, fr=SETUP)
    off = 128
    for _mb in range(2):
        for i in range(3):
            b.alloc(seg, off * MiB, 128 * MiB, fr=model(20 + i))
            off += 128
        if losses:
            b.alloc(seg, off * MiB, 64 * MiB, fr=LOSS)
            off += 64
    b.oom(1500 * MiB, device_free=0)
    return b


@pytest.mark.parametrize("losses, meta, evidence", [
    (False, {}, None),
    (False, {"pp_rank": 0}, "sidecar-stage"),
    (True, {}, "losses-in-one-forward"),
    (True, {"pipeline_stage": 1}, "sidecar-stage"),
])
def test_the_schedule_evidence(tmp_path, losses, meta, evidence):
    from oomdoctor.analysis.schedule import in_flight_parts

    a = analysed(tmp_path, forwards(losses), meta)
    k = int(a.oom_events[-1])
    _passes, recurrences = in_flight_parts(a.trace.stacks, a.lifetimes, a.accounting, a.phases, k)
    assert recurrences == (2 if losses else 0)
    assert schedule_evidence(a, recurrences) == evidence
    v = report_of([a]).verdict
    assert v.kind == "capacity"
    assert ("pipeline-schedule" in [x.id for x in v.to_do]) is (losses and v.evidence["in_flight"] >= 2)
    assert v.evidence.get("schedule_evidence") == evidence


def test_point_to_point_transfers_are_a_pipeline(tmp_path):
    b = forwards(False)
    b.annotate("nccl:send 0->1", "START")
    b.annotate("nccl:send 0->1", "END")
    a = analysed(tmp_path, b)
    assert schedule_evidence(a, 0) == "point-to-point"


@pytest.mark.parametrize("evidence, pipeline", [(None, False), ("sidecar-stage", True), ("point-to-point", True)])
def test_two_passes_alive_advise_a_schedule_only_with_a_pipeline(tmp_path, evidence, pipeline):
    # two passes with activations alive and no pipeline: a kept graph or a caught OOM's exception, never "hold
    # fewer micro-batches in flight" (issue 49: a single-GPU variable-length job got it)
    a = analysed(tmp_path, forwards(False))
    ev = {"in_flight": 2, **({"schedule_evidence": evidence} if evidence else {})}
    v = Verdict(kind="capacity", bytes=1, ranks=[0], headroom_bytes=None, finding=None, evidence=ev)
    assert ("pipeline-schedule" in [x.id for x in _actions(v, a, [], None)]) is pipeline


# --------------------------------------------------------------------------- an OOM inside optimizer.step()


def oom_in_step() -> SnapBuilder:
    """Parameters (2 x 256 MiB), a forward (three 128 MiB activations), the backward (two 256 MiB gradients, the
    activations freed), then the first optimizer step makes Adam's moments (256 MiB each) and runs out asking for
    a 512 MiB temporary of its update (a foreach op's): the step's own memory does not fit beside parameters,
    gradients and state (need 2048 MiB, room 1792 MiB)."""
    b = SnapBuilder()
    seg = b.segment(1792 * MiB)
    for i in range(2):
        b.alloc(seg, i * 256 * MiB, 256 * MiB, fr=SETUP)
    acts = [b.alloc(seg, (512 + 128 * i) * MiB, 128 * MiB, fr=model(20 + i)) for i in range(3)]
    for i in range(2):
        b.alloc(seg, (1024 + 256 * i) * MiB, 256 * MiB, fr=BACKWARD)
    for x in acts:
        b.free(x)
    for i in range(2):
        b.alloc(seg, (512 + 256 * i) * MiB, 256 * MiB, fr=OPT_STATE)
    b.oom(512 * MiB, device_free=0)
    return b


def test_an_oom_inside_the_optimizer_step_is_told_the_optimizers_memory(tmp_path):
    a = analysed(tmp_path, oom_in_step(), {"gpu_total_memory_bytes": 2 << 30})
    v = report_of([a], micro_batch=8).verdict
    assert v.kind == "capacity" and "oom-in-optimizer-step" in v.reasons
    assert v.evidence["in_optimizer_step"] is True
    assert (v.evidence["optimizer_state_bytes"], v.evidence["parameters_bytes"]) == (2 * 256 * MiB, 2 * 256 * MiB)
    ids = [x.id for x in v.to_do]
    assert ids[0] == "optimizer-memory"
    assert not {"micro-batch-at-most", "micro-batch-scale", "activation-checkpointing"} & set(ids)


def test_capacity_outside_the_step_keeps_its_usual_advice():
    v = Verdict(kind="capacity", bytes=1, ranks=[0], headroom_bytes=None, finding=None, evidence={})
    assert "optimizer-memory" not in [x.id for x in _actions(v, _Fake(), [], None)]
    v = Verdict(kind="capacity", bytes=1, ranks=[0], headroom_bytes=None, finding=None,
                evidence={"in_optimizer_step": True})
    assert [x.id for x in _actions(v, _Fake(), [], None)] == ["optimizer-memory"]
    assert Action(id="optimizer-memory").id in __import__("oomdoctor.report.verdict", fromlist=["ACTIONS"]).ACTIONS


class _Fake:
    """An analysis whose stacks run no framework."""

    class trace:  # noqa: N801 - stands in for DeviceAnalysis.trace
        class stacks:  # noqa: N801
            stacks: list = []
            frames: list = []


# --------------------------------------------------------------------------- what grows with the batch (item 4)


def moco(lazy: int = 0) -> SnapBuilder:
    """MoCo-style: two trained 64 MiB weights and a 512 MiB memory bank (a buffer no gradient matches) made at setup;
    three steps, each: three 64 MiB activations, ``queue.clone()`` (512 MiB), 128 MiB of logits against the bank,
    the backward (two 64 MiB gradients), Adam's four 64 MiB moments at step 0. ``lazy``: a buffer of that many bytes
    the first forward makes and keeps for good (state created lazily)."""
    b = SnapBuilder()
    seg = b.segment(4096 * MiB)
    for i in range(2):
        b.alloc(seg, i * 64 * MiB, 64 * MiB, fr=SETUP)
    b.alloc(seg, 128 * MiB, 512 * MiB, fr=SETUP)  # the memory bank
    for step in range(3):
        acts = [b.alloc(seg, (1024 + 64 * i) * MiB, 64 * MiB, fr=model(20 + i)) for i in range(3)]
        clone = b.alloc(seg, 1280 * MiB, 512 * MiB, fr=model(30))
        logits = b.alloc(seg, 1792 * MiB, 128 * MiB, fr=model(31))
        if step == 0 and lazy:
            b.alloc(seg, 3072 * MiB, lazy, fr=model(32))
        grads = [b.alloc(seg, (1920 + 64 * i) * MiB, 64 * MiB, fr=BACKWARD) for i in range(2)]
        for x in (*acts, clone, logits):
            b.free(x)
        if step == 0:
            for i in range(4):
                b.alloc(seg, (640 + 64 * i) * MiB, 64 * MiB, fr=OPT_STATE)
        b.free(b.alloc(seg, 900 * MiB, 8 * MiB, fr=OPT_TMP))
        for g in grads:
            b.free(g)
    return b


@pytest.mark.parametrize("lazy", [0, 256 * MiB])
def test_copies_of_a_memory_bank_and_state_made_once_do_not_grow_with_the_batch(tmp_path, lazy):
    from oomdoctor.report.fits import fits, grows_with_batch

    a = analysed(tmp_path, moco(lazy), {"device_free_bytes": 0,
                                       "memory_stats": {"reserved_bytes.all.current": 4096 * MiB}})
    lt, acc = a.lifetimes, a.accounting
    grows = grows_with_batch(a)
    scaled = set(lt.size[acc.batch_scaled & (lt.alloc >= 0)].tolist())
    assert 512 * MiB in scaled  # the accounting scaled the bank's clone (a temporary of every pass)
    assert set(lt.size[grows].tolist()) == {64 * MiB, 128 * MiB}  # the activations (a trained weight's size) and logits
    assert not np.any(grows & (lt.size == 512 * MiB)) and not np.any(grows & (lt.size == lazy))
    f = fits(a, device_room_of(a), 8)
    assert f.batch_scaled_bytes_at_peak == 3 * 64 * MiB + 128 * MiB


def device_room_of(a):
    from oomdoctor.report.fits import device_room

    return device_room(a)
