"""Steps recorded without stacks (``--stack-steps K/N``) get their sites from a stacked step: traces built in
code, once with stacks at every step (today's default) and once with stacks only in the planned steps, the
same allocations otherwise; the report must name the same sites with the same bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from builder import MiB, SnapBuilder, frames

from oomdoctor.analysis.sites import NO_STACK
from oomdoctor.capture.recorder import stacked_step
from oomdoctor.render.json import render_json
from oomdoctor.report import build_report
from oomdoctor.trace.load import from_snapshot
from oomdoctor.trace.model import ACTION_CODES
from oomdoctor.trace.stackmatch import match_stackless_steps, matched_from, unmatched_allocations

SETUP = frames(("/work/model.py", 5, "__init__"), ("/work/train.py", 3, "<module>"))
OPTIM = frames(("/work/train.py", 40, "make_state"), ("/work/train.py", 3, "<module>"))
LEAK = frames(("/work/train.py", 30, "step"), ("/work/train.py", 3, "<module>"))


def act(layer: int) -> list[dict]:
    return frames(("/work/model.py", 20 + layer, "forward"), ("/work/train.py", 3, "<module>"))


def job(plan: tuple[int, int] | None, steps: int = 10, odd_step: int | None = None,
        drop_first: int = 0) -> tuple[dict, dict]:
    """A training job: 4 parameters of 8 MiB (set-up), per step 3 activations of 16 MiB freed after the
    step's leak of 1 MiB (kept: the peak grows to the last step), optimizer state 2 x 8 MiB in step 0.
    ``plan``: stacks only in :func:`stacked_step` steps (None: every step). ``odd_step``: that step's second
    activation is 12 MiB instead of 16. Returns the snapshot and its sidecar."""
    b = SnapBuilder()
    seg = b.segment(1024 * MiB)
    t0 = b.t
    marks, stack_marks = [{"step": 0, "time_us": t0 - 5}], []
    if plan is not None:
        stack_marks.append({"step": 0, "stacks": True, "time_us": t0 - 5})
    leak_at = 512 * MiB
    for s in range(steps):
        on = stacked_step(plan, s)

        def fr(f: list[dict]) -> list[dict]:
            return f if on else []
        if s == 0:
            for i in range(4):
                b.alloc(seg, i * 8 * MiB, 8 * MiB, fr=fr(SETUP))
        acts = [b.alloc(seg, 64 * MiB + i * 16 * MiB, 12 * MiB if (s == odd_step and i == 1) else 16 * MiB,
                        fr=fr(act(i))) for i in range(3)]
        b.alloc(seg, leak_at, MiB, fr=fr(LEAK))
        leak_at += MiB
        for i, a in reversed(list(enumerate(acts))):
            b.free(a, fr=fr(act(i)))
        if s == 0:
            for i in range(2):
                b.alloc(seg, 32 * MiB + i * 8 * MiB, 8 * MiB, fr=fr(OPTIM))
        b.t += 3
        marks.append({"step": s + 1, "time_us": b.t})
        if plan is not None and stacked_step(plan, s + 1) != on:
            stack_marks.append({"step": s + 1, "stacks": stacked_step(plan, s + 1), "time_us": b.t + 1})
        b.t += 5
    meta = {"rank": 0, "device": 0, "step_markers": marks,
            "recording": {"context": "alloc", "stacks": "python", "stack_steps": list(plan) if plan else None}}
    if plan is not None:
        meta["stack_markers"] = stack_marks
    return b.snapshot(drop_first=drop_first), meta


def report_of(snap: dict, meta: dict) -> dict:
    return json.loads(render_json(build_report([from_snapshot(snap, "rank0.pickle", json.loads(json.dumps(meta)))])))


def holders(rep: dict) -> list[tuple[str, int]]:
    return [(h["label"], h["bytes"]) for h in rep["ranks"][0]["holders"]]


def test_matched_sites_equal_the_recorded_ones():
    full = report_of(*job(None))
    part = report_of(*job((2, 4)))
    assert holders(full) and holders(part) == holders(full)
    assert [(s["label"], s["bytes"]) for s in part["ranks"][0]["top_sites"]] == \
        [(s["label"], s["bytes"]) for s in full["ranks"][0]["top_sites"]]
    assert dict(holders(part))["/work/train.py:30 in step"] == 10 * MiB
    # the inference is said: per holder the bytes whose stack was matched, per rank the steps
    matched = {h["label"]: h["matched_bytes"] for h in part["ranks"][0]["holders"]}
    assert matched["/work/train.py:30 in step"] == 6 * MiB  # the leaks of steps 2, 3, 5, 6, 7, 9
    assert matched["/work/model.py:20 in forward"] == 16 * MiB  # the peak is in step 9, recorded without stacks
    assert matched["/work/model.py:5 in __init__"] == 0 and matched["/work/train.py:40 in make_state"] == 0
    assert all(h["matched_bytes"] == 0 for h in full["ranks"][0]["holders"])
    sm = part["ranks"][0]["stack_matches"]
    assert sm["matched"] == 24 and sm["unmatched"] == 0 and full["ranks"][0]["stack_matches"] is None
    assert [e["from_step"] for e in sm["steps"] if e["allocations"]] == [1, 1, 4, 4, 4, 8]
    assert any("--stack-steps" in w for w in part["ranks"][0]["warnings"])  # the leak of every step, 6 of them matched from stacked steps
    assert part["ranks"][0]["peak_allocated_bytes"] == full["ranks"][0]["peak_allocated_bytes"]


def test_what_was_matched_is_said_step_by_step():
    snap, meta = job((2, 4))
    t = from_snapshot(snap, "rank0.pickle", meta)
    res = t.meta["stack_matches"]
    # stacked: 0, 1, 4, 8; stack-less: 2, 3, 5, 6, 7, 9 (step 10 is empty: no allocation after the last marker)
    by_step = {e["step"]: e for e in res["steps"]}
    assert sorted(by_step) == [2, 3, 5, 6, 7, 9, 10]
    # the nearest earlier complete stacked step with the same sequence: step 1 for 2, 3; 4 for 5..7; 8 for 9
    assert {s: by_step[s]["from_step"] for s in (2, 3, 5, 6, 7, 9)} == {2: 1, 3: 1, 5: 4, 6: 4, 7: 4, 9: 8}
    for s in (2, 3, 5, 6, 7, 9):
        e = by_step[s]
        assert e["allocations"] == 4 and e["matched"] == 4 and e["unmatched"] == 0
        assert e["allocations"] == e["matched"] + e["matched_without_stack"] + e["unmatched"]
    assert by_step[10]["allocations"] == 0 and res["matched"] == 24 and res["unmatched"] == 0
    dt = t.primary
    src = matched_from(t, dt)
    stackless = (dt.events["stack"] >= 0) & (src >= 0)
    assert int((src >= 0).sum()) == 24 and stackless.sum() == 24
    # every allocation and free now carries a stack, as with stacks at every step
    full = from_snapshot(*job(None)[:1], "rank0.pickle", job(None)[1])
    for col in ("stack",):
        got = [t.stacks.stacks[i] if i >= 0 else None for i in dt.events[col]]
        want = [full.stacks.stacks[i] if i >= 0 else None for i in full.primary.events[col]]
        assert [tuple(t.stacks.frames[f] for f in s) if s else s for s in got] == \
            [tuple(full.stacks.frames[f] for f in s) if s else s for s in want]


def test_a_step_that_differs_is_matched_only_up_to_the_difference():
    snap, meta = job((2, 4), odd_step=6)  # step 6's second activation is 12 MiB: positions 1.. are not matched
    t = from_snapshot(snap, "rank0.pickle", meta)
    e = next(e for e in t.meta["stack_matches"]["steps"] if e["step"] == 6)
    assert e["from_step"] == 4 and e["matched"] == 1 and e["unmatched"] == 3
    dt = t.primary
    lo, hi = e["first_event"], e["end_event"]
    allocs = lo + np.flatnonzero(dt.events["action"][lo:hi] == ACTION_CODES["alloc"])
    assert dt.events["stack"][allocs[0]] >= 0 and (dt.events["stack"][allocs[1:]] == -1).all()
    # the report: the unmatched leak of step 6 stays without a site, never guessed, and is not read as the
    # autograd engine's (which an empty stack means where stacks are recorded)
    rep = report_of(snap, meta)
    assert ("<recorded without a stack (--stack-steps), matched to no stacked step>", MiB) in holders(rep)
    assert ("/work/train.py:30 in step", 9 * MiB) in holders(rep)
    assert not any("autograd" in label for label, _ in holders(rep))
    assert unmatched_allocations(t).sum() == 3 and NO_STACK == -1


def test_a_wrapped_ring_buffer_matches_against_a_later_stacked_step():
    snap, meta = job((2, 4), drop_first=50)  # steps 0..3 and part of 4 are gone
    t = from_snapshot(snap, "rank0.pickle", meta)
    by_step = {e["step"]: e for e in t.meta["stack_matches"]["steps"]}
    assert 2 not in by_step and 3 not in by_step  # entirely before the trace: nothing to match
    assert {s: by_step[s]["from_step"] for s in (5, 6, 7, 9)} == {5: 8, 6: 8, 7: 8, 9: 8}  # 4 is cut short
    assert all(by_step[s]["matched"] == 4 for s in (5, 6, 7, 9))
    # what is lost: the leaks of stack-less steps 2 and 3, alive but allocated before the trace, have no
    # stack in the final state either; with stacks everywhere the final state names them
    part, full = holders(report_of(snap, meta)), holders(report_of(*job(None, drop_first=50)))
    assert ("<allocated before recording started>", 2 * MiB) in part
    assert sum(n for label, n in part if label == "/work/train.py:30 in step") == 8 * MiB
    assert sum(n for label, n in full if label == "/work/train.py:30 in step") == 10 * MiB


def test_no_stack_markers_changes_nothing_and_malformed_ones_warn():
    snap, meta = job(None)
    t = from_snapshot(snap, "rank0.pickle", meta)
    assert "stack_matches" not in t.meta and match_stackless_steps(t) is None
    snap, meta = job((2, 4))
    meta["stack_markers"] = [{"step": "x"}]
    t = from_snapshot(snap, "rank0.pickle", meta)
    assert "stack_matches" not in t.meta and any("stack_markers" in w for w in t.warnings)
    assert (t.primary.events["stack"] == -1).sum() > 0


@pytest.mark.parametrize("plan", [(2, 0), (3, 2)])
def test_other_plans_give_the_same_holders(plan):
    assert holders(report_of(*job(plan))) == holders(report_of(*job(None)))
