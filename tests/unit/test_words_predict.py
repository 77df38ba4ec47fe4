"""The words of a prediction's outcome (:mod:`oomdoctor.render.words.predict`), id by id, from predictions built in
code; the rules that choose the id (report/predict.py) are tested on real replays in test_margin_rules,
test_verdict_rules and the corpus tests."""

from __future__ import annotations

import pytest

from oomdoctor.render.format import format_bytes as B
from oomdoctor.render.words.predict import outcome
from oomdoctor.report.predict import OUTCOMES
from oomdoctor.units import MiB

GiB = 1024 * MiB
ROOM = {"spare_bytes": 300 * MiB, "margin_bytes": 100 * MiB, "at_edge": False}
P = {"peak_reserved_bytes": 2 * GiB, "extended_peak_reserved_bytes": 2 * GiB, "oom": {"event_index": 41},
     "extended_oom_requested_bytes": 512 * MiB}
NOT_RECORDED = "; the rest of the step was not recorded (no complete step before it to replay)"
COMPLETES = (f"gets past the recorded OOM with a peak reserved of {B(2 * GiB)}, and the rest of the step, replayed as "
             "the previous step ran it, completes")


@pytest.mark.parametrize("id_, room, text", [
    ("oom", False, "out of memory at event 41"),
    ("no-oom", False, f"no OOM, peak reserved {B(2 * GiB)}"),
    ("no-oom", True, f"no OOM, peak reserved {B(2 * GiB)} with {B(300 * MiB)} to spare (margin {B(100 * MiB)})"),
    ("still-oom", False, "still out of memory, at event 41 of the recording"),
    ("past-recorded-oom", False, "gets past the recorded OOM" + NOT_RECORDED),
    ("past-recorded-oom", True, f"gets past the recorded OOM with {B(300 * MiB)} to spare (margin {B(100 * MiB)})"
                                + NOT_RECORDED),
    ("step-completed", False, COMPLETES),
    ("step-completed", True, COMPLETES + f" with {B(300 * MiB)} to spare (margin {B(100 * MiB)})"),
    ("step-ran-out", False, "gets past the recorded OOM, but the rest of the step, replayed as the previous step ran "
                            f"it, runs out of memory asking for {B(512 * MiB)}"),
], ids=lambda x: str(x)[:20])
def test_each_outcome(id_, room, text):
    assert outcome({**P, **(ROOM if room else {}), "outcome": id_}) == text


def test_at_the_edge_says_the_margin_it_is_inside():
    p = {**P, **ROOM, "at_edge": True, "outcome": "no-oom"}
    assert outcome(p) == (f"no OOM, peak reserved {B(2 * GiB)} with {B(300 * MiB)} to spare, inside its margin of "
                          f"{B(100 * MiB)} (at the edge: it may still run out)")


def test_a_completed_step_above_the_recorded_peak_says_its_own():
    p = {**P, "extended_peak_reserved_bytes": 3 * GiB, "outcome": "step-completed"}
    assert outcome(p) == COMPLETES + f", peaking at {B(3 * GiB)}"


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
    assert source("oom-message").startswith("the OOM message: this process's memory in use less what PyTorch reserved")
    with pytest.raises(KeyError):
        source("no-such-source")
