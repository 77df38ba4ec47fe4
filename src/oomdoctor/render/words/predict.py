"""The words of a prediction (:mod:`oomdoctor.report.predict`, a dict): its ``outcome`` id
(:data:`~oomdoctor.report.predict.OUTCOMES`) said with its numbers: first what the replay says of the recorded steps
(the peak reserved; where the room is known, the spare room and the margin, at the edge when ``at_edge``), then what
the recorded steps do not cover (``continuation``): the rest of the step, replayed, or later steps, said as the
condition they hold under and, where the job measured it, with their own margin (issue 49). :func:`prediction`
says a fix's prediction whole, as the text report shows it under the fix."""

from __future__ import annotations

from typing import Any

from ..format import fill, format_bytes

SPARE = " with {spare_bytes:bytes} to spare (margin {margin_bytes:bytes})"
#: no margin: a replay of the recorded steps, which is exact (docs/diagnose.md, "Margins")
SPARE_EXACT = " with {spare_bytes:bytes} to spare (a replay of the recorded steps: no margin needed)"
#: nothing to spare: the peak reserved is the room itself (a room known from below, a lower end, still fits)
SPARE_NONE = ", its peak reserved the whole room, with nothing to spare"
SPARE_AT_EDGE = " with {spare_bytes:bytes} to spare, inside its margin of {margin_bytes:bytes} (at the edge: it may still run out)"
CONDITION = "for steps whose tensors peak at up to {continuation[heaviest_step_peak_allocated_bytes]:bytes}, the heaviest recorded"


def _continuation(p: dict[str, Any]) -> str:
    """The second statement: what the recorded steps do not cover, with its margin where one was measured."""
    c = p.get("continuation") or {}
    if "spare_bytes" not in c:
        return ""
    if c.get("margin_bytes") is None:
        return (" ({continuation[spare_bytes]:bytes} to spare; no step-to-step spread measured: fewer than two "
                "complete steps)")
    if c.get("at_edge"):
        return (" ({continuation[spare_bytes]:bytes} to spare, inside the {continuation[margin_bytes]:bytes} its "
                "steps' reserved peaks spread by: later steps may still run out)")
    return (" ({continuation[spare_bytes]:bytes} to spare, more than the {continuation[margin_bytes]:bytes} its "
            "steps' reserved peaks spread by)")


def _spare(p: dict[str, Any]) -> str:
    """The spare room of a replay whose room is known: at the edge, none, exact (no margin), or with its margin."""
    if p["at_edge"]:
        return SPARE_AT_EDGE
    if p.get("spare_bytes") == 0:
        return SPARE_NONE
    return SPARE_EXACT if p.get("margin_bytes") == 0 else SPARE


def outcome_template(p: dict[str, Any]) -> str:
    """How the replay of ``p`` ended, as a template over ``p``'s fields. Raises KeyError for an unknown outcome."""
    spare = "" if "at_edge" not in p else _spare(p)  # at_edge: the room is known
    o = p["outcome"]
    if o == "oom":
        return "out of memory at event {oom[event_index]}"
    if o == "no-oom":
        return ("no OOM, peak reserved {peak_reserved_bytes:bytes}" + spare + "; later steps: " + CONDITION
                + _continuation(p))
    if o == "still-oom":
        return "still out of memory, at event {oom[event_index]} of the recording"
    if o == "past-recorded-oom":
        return ("gets past the recorded OOM and through the recorded steps (peak reserved {peak_reserved_bytes:bytes})"
                + spare + "; the rest of the step was not recorded (no complete step before it to replay): it holds "
                + CONDITION)
    if o == "step-completed":
        ext = p.get("extended_peak_reserved_bytes", 0) > p["peak_reserved_bytes"]
        return ("gets past the recorded OOM and through the recorded steps (peak reserved {peak_reserved_bytes:bytes})"
                + spare + "; the rest of the step, replayed as the previous step ran it, completes"
                + (", peaking at {extended_peak_reserved_bytes:bytes}" if ext else "") + _continuation(p)
                + ", " + CONDITION)
    if o == "step-ran-out":
        return ("gets past the recorded OOM and through the recorded steps (peak reserved {peak_reserved_bytes:bytes})"
                + spare + ", but the rest of the step, replayed as the previous step ran it, runs out of memory asking "
                "for {extended_oom_requested_bytes:bytes}")
    raise KeyError(o)


def outcome(p: dict[str, Any]) -> str:
    """How the replay of ``p`` ended, filled in."""
    return fill(outcome_template(p), p)


def prediction(p: dict[str, Any]) -> str:
    """A fix's prediction (``Fix.prediction``) in one sentence: what this recording was replayed with, on which rank,
    how it ended (:func:`outcome`), and what was recorded."""
    what = []
    if p["config"]:
        what.append(p["config"])
    if p["deferred_frees"] == "immediate":
        what.append("frees not deferred")
    # this recording's own events (a fix's words may cite other runs, measured: issue 52)
    held = (", its deferred frees held as long as they were"
            if p["deferred_frees"] == "recorded" and p.get("recorded_deferred_frees") else "")
    text = (f"this recording replayed with {' + '.join(what) or 'the recorded settings'} on rank {p['rank']}{held}: "
            f"{outcome(p)}. Recorded: peak reserved {format_bytes(p['recorded_peak_reserved_bytes'])}")
    if p["recorded_oom_event_index"] is not None:
        text += f", OOM at event {p['recorded_oom_event_index']}"
    text += "."
    if not p["self_replay_exact"]:
        text += " Approximate: the replay of the recorded run was not exact."
    return text
