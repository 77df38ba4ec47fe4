"""The words of a prediction's outcome (:mod:`oomdoctor.render.words.predict`), id by id, from predictions built in
code; the rules that choose the id (report/predict.py) are tested on real replays in test_margin_rules,
test_verdict_rules and the corpus tests. A prediction says the recorded steps first, with their margin, then what
they do not cover: the condition (the heaviest recorded step's peak allocated) and, where measured, its own margin
(issue 49)."""

from __future__ import annotations

import pytest

from oomdoctor.render.format import format_bytes as B
from oomdoctor.render.words.predict import outcome
from oomdoctor.report.predict import OUTCOMES
from oomdoctor.units import MiB

GiB = 1024 * MiB
ROOM = {"spare_bytes": 300 * MiB, "margin_bytes": 100 * MiB, "at_edge": False}
CONT = {"outcome": "later-steps", "heaviest_step_peak_allocated_bytes": GiB, "margin_bytes": None,
        "margin": {"reserved_step_spread_bytes": None, "unrecorded_bytes": 0}}
P = {"peak_reserved_bytes": 2 * GiB, "extended_peak_reserved_bytes": 2 * GiB, "oom": {"event_index": 41},
     "extended_oom_requested_bytes": 512 * MiB, "continuation": CONT}
THROUGH = f"gets past the recorded OOM and through the recorded steps (peak reserved {B(2 * GiB)})"
SPARE = f" with {B(300 * MiB)} to spare (margin {B(100 * MiB)})"
CONDITION = f"for steps whose tensors peak at up to {B(GiB)}, the heaviest recorded"
NOT_RECORDED = "; the rest of the step was not recorded (no complete step before it to replay): it holds " + CONDITION
COMPLETES = THROUGH + "; the rest of the step, replayed as the previous step ran it, completes"


@pytest.mark.parametrize("id_, room, text", [
    ("oom", False, "out of memory at event 41"),
    ("no-oom", False, f"no OOM, peak reserved {B(2 * GiB)}; later steps: " + CONDITION),
    ("no-oom", True, f"no OOM, peak reserved {B(2 * GiB)}" + SPARE + "; later steps: " + CONDITION),
    ("still-oom", False, "still out of memory, at event 41 of the recording"),
    ("past-recorded-oom", False, THROUGH + NOT_RECORDED),
    ("past-recorded-oom", True, THROUGH + SPARE + NOT_RECORDED),
    ("step-completed", False, COMPLETES + ", " + CONDITION),
    ("step-completed", True, THROUGH + SPARE + "; the rest of the step, replayed as the previous step ran it, "
                             "completes, " + CONDITION),
    ("step-ran-out", False, THROUGH + ", but the rest of the step, replayed as the previous step ran it, runs out of "
                            f"memory asking for {B(512 * MiB)}"),
], ids=lambda x: str(x)[:20])
def test_each_outcome(id_, room, text):
    assert outcome({**P, **(ROOM if room else {}), "outcome": id_}) == text


def test_at_the_edge_says_the_margin_it_is_inside():
    p = {**P, **ROOM, "at_edge": True, "outcome": "no-oom"}
    assert outcome(p) == (f"no OOM, peak reserved {B(2 * GiB)} with {B(300 * MiB)} to spare, inside its margin of "
                          f"{B(100 * MiB)} (at the edge: it may still run out); later steps: " + CONDITION)


def test_a_completed_step_above_the_recorded_peak_says_its_own():
    p = {**P, "extended_peak_reserved_bytes": 3 * GiB, "outcome": "step-completed"}
    assert outcome(p) == COMPLETES + f", peaking at {B(3 * GiB)}, " + CONDITION


@pytest.mark.parametrize("margin_bytes, edge, said", [
    (None, None, f" ({B(200 * MiB)} to spare; no step-to-step spread measured: fewer than two complete steps)"),
    (300 * MiB, True, f" ({B(200 * MiB)} to spare, inside the {B(300 * MiB)} its steps' reserved peaks spread by: "
                      "later steps may still run out)"),
    (100 * MiB, False, f" ({B(200 * MiB)} to spare, more than the {B(100 * MiB)} its steps' reserved peaks spread by)"),
])
def test_the_continuation_says_its_own_margin_where_one_was_measured(margin_bytes, edge, said):
    cont = {**CONT, "outcome": "step-completed", "margin_bytes": margin_bytes, "spare_bytes": 200 * MiB,
            "at_edge": edge}
    p = {**P, **ROOM, "outcome": "step-completed", "continuation": cont}
    assert outcome(p) == (THROUGH + SPARE + "; the rest of the step, replayed as the previous step ran it, completes"
                          + said + ", " + CONDITION)


def test_every_outcome_has_its_words():
    got = {outcome({**P, "outcome": o}) for o in OUTCOMES}
    assert len(got) == len(OUTCOMES)
    with pytest.raises(KeyError):
        outcome({**P, "outcome": "no-such-outcome"})


def test_every_margin_source_has_its_words():
    from oomdoctor.render.words.margin import source
    from oomdoctor.report.margin import SOURCES

    said = [source(x) for x in SOURCES]
    assert len(set(said)) == len(SOURCES) and all(said)
    assert source("outside-growth").startswith("what the memory outside the allocator grew by after the room was read")
    with pytest.raises(KeyError):
        source("no-such-source")


def test_no_margin_and_nothing_to_spare_are_said_plainly():
    """A new user read "with 0 B to spare (margin 0 B)" as a fit at the edge: a replay of recorded steps needs no
    margin (it is exact), and a peak equal to the room is said as the whole room."""
    exact = {**P, **ROOM, "margin_bytes": 0, "outcome": "no-oom"}
    assert outcome(exact) == (f"no OOM, peak reserved {B(2 * GiB)} with {B(300 * MiB)} to spare (a replay of the "
                              "recorded steps: no margin needed); later steps: " + CONDITION)
    full = {**P, **ROOM, "spare_bytes": 0, "margin_bytes": 0, "outcome": "past-recorded-oom"}
    assert outcome(full) == THROUGH + ", its peak reserved the whole room, with nothing to spare" + NOT_RECORDED
    assert "margin 0 B" not in outcome(exact) + outcome(full)
