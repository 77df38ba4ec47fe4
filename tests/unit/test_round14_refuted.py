"""Rules that issue 49's round-14 device runs refuted, fixed as classes, each on a small trace built in code (each
test fails on the code before its fix; docs/diagnose.md "Round 14: the new kinds before and after"):

- a memory-fraction cap set during the run holds only from the last event the recording's reserved bytes were above
  it (a variable-length fine-tune sized its cap after two uncapped steps; the replay capped from the start freed a
  segment the job kept, measured a model error of 2.93 GiB and called its fragmentation OOM capacity);
- an OOM is inside ``optimizer.step()`` only inside torch.optim's own ``Optimizer.step#`` scope where the trace has
  them (a GNN's next forward, recorded without stacks, read as the last update's and told the optimizer's advice);
- a trace cut by its OOM before any step finished keeps room, in what fits, for the gradients the rest of its
  backward makes (GPipe at 32 said 31 where 31 ran out).
"""

from __future__ import annotations

from builder import MiB, SnapBuilder, frames
from test_accounting import OPT_STATE, OPT_TMP, SETUP, TORCH, model
from test_advice_classes import analysed, oom_in_step

from oomdoctor.analysis.accounting import GRADIENTS
from oomdoctor.report.fits import Room, _margin, fits, job_margin, room_capacity
from oomdoctor.report.pipeline import report_of
from oomdoctor.report.predict import Predictor
from oomdoctor.report.verdict import in_optimizer_step
from oomdoctor.simulate.capacity import infer_capacity, limit_from_event
from oomdoctor.simulate.replay import prepare, replay

EMPTY_CACHE = frames((f"{TORCH}/cuda/memory.py", 222, "empty_cache"), ("/w/train.py", 12, "main"))
CAP = 120 * MiB


# --------------------------------------------------------------------------- a cap set during the run


def capped_later() -> tuple[SnapBuilder, int]:
    """Two uncapped steps' worth of memory (100 + 60 MiB segments, 160 MiB reserved: above the 120 MiB cap the job
    sets afterwards), ``empty_cache()``, then the capped part: a 100 MiB block, freed, and a 20 MiB one. Returns the
    builder and the index of the first event after the last one above the cap (the first ``segment_free``)."""
    b = SnapBuilder()
    s1 = b.segment(100 * MiB)
    a1 = b.alloc(s1, 0, 100 * MiB, fr=model(20))
    s2 = b.segment(60 * MiB)
    a2 = b.alloc(s2, 0, 60 * MiB, fr=model(21))
    b.free(a1)
    b.free(a2)
    start = len(b.events)
    b.free_segment(s2, fr=EMPTY_CACHE)  # release_cached_blocks frees the smaller first (the model's order)
    b.free_segment(s1, fr=EMPTY_CACHE)
    s3 = b.segment(100 * MiB)
    b.free(b.alloc(s3, 0, 100 * MiB, fr=model(20)))
    b.alloc(s3, 0, 20 * MiB, fr=model(21))
    return b, start


def test_a_cap_the_recording_was_above_holds_from_the_event_after_it(tmp_path):
    b, start = capped_later()
    a = analysed(tmp_path, b, {"memory_cap_bytes": CAP})
    assert limit_from_event(a.device, CAP) == start
    assert limit_from_event(a.device, 160 * MiB) == 0  # never above: the whole trace
    cap = infer_capacity(a.trace, a.device)
    assert (cap.limit_bytes, cap.kind, cap.from_event) == (CAP, "fraction", start)
    # the replay reproduces the recording: before the cap's first event nothing is held to it
    r = replay(prepare(a.trace, a.device, a.lifetimes), capacity=cap)
    assert r.oom is None and r.validation.segment_events_differing == 0
    assert r.validation.max_reserved_difference_bytes == 0
    # its peaks are the capped part's: what a claim compares with the cap
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes) == (100 * MiB, 100 * MiB)
    # capped from the first event (the rule before), the second segment does not fit under the cap
    early = replay(prepare(a.trace, a.device, a.lifetimes), capacity=cap.__class__(limit_bytes=CAP, kind="fraction", source="given"))
    assert early.oom is not None and early.oom.event_index < start


def test_the_prediction_and_what_fits_replay_the_cap_from_its_first_event(tmp_path):
    b, start = capped_later()
    a = analysed(tmp_path, b, {"memory_cap_bytes": CAP})
    p = Predictor(a)
    assert p.margin.model_error_bytes == 0 and p.reproduces
    room = Room(bytes=CAP, kind="fraction", source="sidecar-cap")
    assert room_capacity(room, a).from_event == start
    assert room_capacity(room).from_event == 0  # no trace: nothing says when it was set
    assert room_capacity(Room(bytes=CAP, kind="device", source="oom-device"), a).from_event == 0  # a device's room holds throughout
    f = fits(a, room, 4)
    assert f.margin["model_error_bytes"] == 0 and "not-reproduced" not in f.notes


# --------------------------------------------------------------------------- inside optimizer.step(): its scopes


def test_an_oom_inside_the_steps_scope_is_inside_the_step(tmp_path):
    b = oom_in_step()
    # the same trace with torch.optim's scope around the state and the failed request
    b2 = SnapBuilder()
    seg = b2.segment(1792 * MiB)
    for i in range(2):
        b2.alloc(seg, i * 256 * MiB, 256 * MiB, fr=SETUP)
    acts = [b2.alloc(seg, (512 + 128 * i) * MiB, 128 * MiB, fr=model(20 + i)) for i in range(3)]
    for i in range(2):
        b2.alloc(seg, (1024 + 256 * i) * MiB, 256 * MiB, fr=[])
    for x in acts:
        b2.free(x)
    b2.annotate("Optimizer.step#Adam.step", "START")
    for i in range(2):
        b2.alloc(seg, (512 + 256 * i) * MiB, 256 * MiB, fr=OPT_STATE)
    b2.oom(512 * MiB, device_free=0)
    b2.annotate("Optimizer.step#Adam.step", "END")
    for builder, d in ((b, "plain"), (b2, "scoped")):
        (tmp_path / d).mkdir()
        a = analysed(tmp_path / d, builder, {"gpu_total_memory_bytes": 2 << 30})
        assert in_optimizer_step(a, int(a.oom_events[-1])), d
        v = report_of([a], micro_batch=8).verdict
        assert v.to_do[0].id == "optimizer-memory", d


def test_an_oom_after_the_steps_scope_closed_is_not_inside_the_step(tmp_path):
    """A step inside its scope, then, after the scope closed, a temporary made by torch.optim's code (an averaged
    model's update after the step) and an OOM: the frames say optimizer, the step's own scope says it had ended."""
    b = SnapBuilder()
    seg = b.segment(1792 * MiB)
    for i in range(2):
        b.alloc(seg, i * 256 * MiB, 256 * MiB, fr=SETUP)
    acts = [b.alloc(seg, (512 + 128 * i) * MiB, 128 * MiB, fr=model(20 + i)) for i in range(3)]
    grads = [b.alloc(seg, (1024 + 256 * i) * MiB, 256 * MiB, fr=[]) for i in range(2)]
    for x in acts:
        b.free(x)
    b.annotate("Optimizer.step#Adam.step", "START")
    for i in range(2):
        b.alloc(seg, (512 + 256 * i) * MiB, 256 * MiB, fr=OPT_STATE)
    b.annotate("Optimizer.step#Adam.step", "END")
    for g in grads:
        b.free(g)
    b.alloc(seg, 1024 * MiB, 256 * MiB, fr=OPT_TMP)
    b.oom(700 * MiB, device_free=0)
    a = analysed(tmp_path, b, {"gpu_total_memory_bytes": 2 << 30})
    k = int(a.oom_events[-1])
    assert a.phases.phase_name(k) == "optimizer"  # what the phases infer
    assert not in_optimizer_step(a, k)
    v = report_of([a], micro_batch=8).verdict
    assert v.kind == "capacity" and "in_optimizer_step" not in v.evidence
    assert "oom-in-optimizer-step" not in v.reasons and "optimizer-memory" not in [x.id for x in v.to_do]


# --------------------------------------------------------------------------- what fits: the gradients still to come

PARAM = 64 * MiB


def cut_in_first_backward(grads_made: int) -> SnapBuilder:
    """Two 64 MiB parameters, a forward (two 128 MiB activations), ``grads_made`` of the two gradients, then an OOM
    in the backward: no step finished."""
    b = SnapBuilder()
    seg = b.segment(1024 * MiB)
    for i in range(2):
        b.alloc(seg, i * PARAM, PARAM, fr=SETUP)
    for i in range(2):
        b.alloc(seg, (256 + 128 * i) * MiB, 128 * MiB, fr=model(20 + i))
    for i in range(grads_made):
        b.alloc(seg, (512 + 64 * i) * MiB, PARAM, fr=[])
    b.oom(300 * MiB, device_free=0)
    return b


def test_no_finished_step_keeps_room_for_the_gradients_still_to_come(tmp_path):
    # the gradient made before the cut is not known as one (no step or zero_grad has shown it: a temporary to the
    # accounting), so the rest of the backward is taken to make every parameter's; and Adam's two moments
    a = analysed(tmp_path, cut_in_first_backward(1))
    assert a.phases.has_backward and (a.phases.steps is None or not a.phases.steps.updates)
    assert not (a.accounting.category == GRADIENTS).any()
    base, _ = job_margin(a)
    assert _margin(a, 1024 * MiB) == (base + 2 * PARAM + 2 * (2 * PARAM), "optimizer-state-assumed")


def test_with_the_state_seen_only_the_gradients_still_to_come_are_kept(tmp_path):
    b = cut_in_first_backward(1)
    # the optimizer's state made before the step (a preallocated state): seen, so not assumed
    b.events = [e for e in b.events if e["action"] != "oom"]
    seg = next(iter(b.segments))
    for i in range(4):
        b.alloc(seg, (640 + 64 * i) * MiB, PARAM, fr=OPT_STATE)
    b.oom(300 * MiB, device_free=0)
    a = analysed(tmp_path, b)
    # beside the optimizer's state the block the backward made is known for a gradient: one of two is still to come
    assert int(a.lifetimes.size[a.accounting.category == GRADIENTS].sum()) == PARAM
    base, _ = job_margin(a)
    assert _margin(a, 2048 * MiB) == (base + PARAM, "gradients-assumed")
