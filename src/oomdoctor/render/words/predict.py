"""The words of a prediction (:mod:`oomdoctor.report.predict`, a dict): its ``outcome`` id
(:data:`~oomdoctor.report.predict.OUTCOMES`) said with its numbers: the peak reserved, where the room is known the
spare room and the margin (at the edge when ``at_edge``), the request the rest of the step runs out at."""

from __future__ import annotations

from typing import Any

from ..format import fill

SPARE = " with {spare_bytes:bytes} to spare (margin {margin_bytes:bytes})"
SPARE_AT_EDGE = " with {spare_bytes:bytes} to spare, inside its margin of {margin_bytes:bytes} (at the edge: it may still run out)"


def outcome_template(p: dict[str, Any]) -> str:
    """How the replay of ``p`` ended, as a template over ``p``'s fields. Raises KeyError for an unknown outcome."""
    spare = "" if "at_edge" not in p else SPARE_AT_EDGE if p["at_edge"] else SPARE  # at_edge: the room is known
    o = p["outcome"]
    if o == "oom":
        return "out of memory at event {oom[event_index]}"
    if o == "no-oom":
        return "no OOM, peak reserved {peak_reserved_bytes:bytes}" + spare
    if o == "still-oom":
        return "still out of memory, at event {oom[event_index]} of the recording"
    if o == "past-recorded-oom":
        return ("gets past the recorded OOM" + spare
                + "; the rest of the step was not recorded (no complete step before it to replay)")
    if o == "step-completed":
        return ("gets past the recorded OOM with a peak reserved of {peak_reserved_bytes:bytes}, and the rest of the "
                "step, replayed as the previous step ran it, completes"
                + (", peaking at {extended_peak_reserved_bytes:bytes}"
                   if p["extended_peak_reserved_bytes"] > p["peak_reserved_bytes"] else "") + spare)
    if o == "step-ran-out":
        return ("gets past the recorded OOM, but the rest of the step, replayed as the previous step ran it, runs out "
                "of memory asking for {extended_oom_requested_bytes:bytes}")
    raise KeyError(o)


def outcome(p: dict[str, Any]) -> str:
    """How the replay of ``p`` ended, filled in."""
    return fill(outcome_template(p), p)
