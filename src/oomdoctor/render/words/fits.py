"""The words of what fits (:class:`oomdoctor.report.fits.Fits`): its ``notes`` and ``assumptions`` are ids
(:data:`oomdoctor.ids.FITS_NOTES`, :data:`oomdoctor.ids.FITS_ASSUMPTIONS`), said here with the numbers and
messages in its ``note_values``. The JSON writes these words where the ids are (:func:`fits_dict`), as it always has."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ...ids import FITS_ASSUMPTIONS, FITS_NOTES, FitsAssumption, FitsNote
from ..format import format_bytes
from .capacity import room_source
from .table import Words, table, text

if TYPE_CHECKING:  # annotations only: report/fits imports the analyses, which `oomdoctor simulate` does not need
    from ...report.fits import Fits

NOTES = table("what-fits note", FITS_NOTES, {
    "no-history": Words(description="no allocation history: nothing to replay",
                        text="no allocation history: nothing to replay"),
    "room-unknown": Words(description=("the device's size is unknown (no OOM, no sidecar): what fits cannot "
                                       "be replayed"),
                          text=("the device's size is unknown (no OOM, no sidecar): what fits cannot be "
                                "replayed")),
    "nothing-grows": Words(description="no tensor of the trace grows with the micro-batch",
                           text=("no tensor of the trace grows with the micro-batch (no forward or backward "
                                 "pass seen)")),
    "cut-in-inference": Words(description=("the trace ends inside an inference loop: what fits is not "
                                           "replayed"),
                              text=("the trace ends inside an inference loop (generate() or evaluation): what"
                                    " it would still have made (the cache grows with every token to come) is "
                                    "not recorded, so what fits is not replayed; diagnose a run that "
                                    "finished, with --micro-batch")),
    "generate-estimate": Words(description=("generate() is not replayed: a lower bound from the job's peak "
                                            "reserved"),
                               text=("generate() is not replayed (where its concatenated KV cache fragments "
                                     "decides where a larger batch runs out): what fits is a lower bound from"
                                     " the job's peak reserved, scaled with the batch")),
    "generate-not-replayed": Words(description="generate() is not replayed, and no lower bound is said",
                                   text=("generate() grows its KV cache one token at a time by concatenation,"
                                         " and the caching allocator's fragmentation of those caches decides "
                                         "where a larger batch runs out; a replay of one batch's generation "
                                         "scaled to another does not reproduce it, so what fits is not "
                                         "replayed: lower the batch or max_new_tokens, or use a static cache")),
    "first-forward-estimate": Words(description=("the trace ends inside its first forward pass: a lower bound"
                                                 " from the recorded part"),
                                    text=("the trace ends inside its first forward pass: what fits is a lower"
                                          " bound from the recorded part and the assumptions listed, not a "
                                          "replay of the whole step")),
    "cut-in-first-forward": Words(description=("the trace ends inside its first forward pass: what fits "
                                               "cannot be replayed"),
                                  text=("the trace ends inside its first forward pass: the rest of that pass "
                                        "is not in it, so what fits cannot be replayed from it; record a run "
                                        "that fits and diagnose it with --micro-batch")),
    "pipeline-warm-up": Words(description=("a pipeline stage cut in its first warm-up forwards: how many "
                                           "micro-batches its schedule holds is not in the trace, so no lower"
                                           " bound is said"),
                              text=("a pipeline stage ran out in the warm-up forwards of its first step: its "
                                    "peak comes when every micro-batch its schedule holds in flight is there "
                                    "(1F1B's first stage: one per later stage), which the trace does not "
                                    "show, so no lower bound is said; record a step that finished and "
                                    "diagnose it with --micro-batch")),
    "optimizer-state-assumed": Words(description=("no optimizer step finished before the OOM: room kept for "
                                                  "Adam's state and for the gradients the rest of the "
                                                  "backward makes"),
                                     text=("no optimizer step finished before the OOM: the replay keeps room "
                                           "for optimizer state of twice the parameters (Adam's two moments) "
                                           "and for the gradients the rest of the backward makes")),
    "gradients-assumed": Words(description=("no optimizer step finished before the OOM: room kept for the "
                                            "gradients the rest of the backward makes"),
                               text=("no optimizer step finished before the OOM: the replay keeps room for "
                                     "the gradients the rest of the backward makes")),
    "replay-failed": Words(description="the replay refuses the trace (note_values replay_error)",
                           text="the trace cannot be replayed: {replay_error}"),
    "private-pools": Words(description=("CUDA graph private pools hold part of the memory: what fits is not "
                                        "replayed"),
                           text=("CUDA graph private pools (e.g. torch.compile mode='reduce-overhead') hold "
                                 "part of this run's memory and are replayed as recorded, not scaled with the"
                                 " micro-batch: what fits is not replayed")),
    "not-reproduced": Words(description=("the allocator model does not reproduce the recording: what fits is "
                                         "not replayed"),
                            text=("the allocator model does not reproduce this recording in the memory the "
                                  "allocator could use on this GPU: what fits is not replayed")),
    "peaks-before-window-unknown": Words(description=("the trace starts mid-job without PyTorch's counters: "
                                                      "the window's answer"),
                                         text=("peaks before the recorded window are not known (the trace "
                                               "starts mid-job, and no sidecar holds PyTorch's counters): "
                                               "what fits is the window's, and may be too much")),
    "held-to-job-peak": Words(description="the answer is held to the job's own peak (job_peak_scale_bound)",
                              text=("held to the job's own peak (PyTorch's counters), which the recorded "
                                    "window missed: the job's bytes above the window's fixed ones are taken "
                                    "to grow with the micro-batch")),
})
"""Each note of what fits (:data:`oomdoctor.ids.FITS_NOTES`): what it means, and its words, a ``str.format`` template
over ``note_values``."""

ASSUMPTIONS = table("what-fits assumption", FITS_ASSUMPTIONS, {
    "loss-copies": Words(description=("the failed request is the pass's output; the loss keeps loss_copies "
                                      "more of it"),
                         text=("the failed request is the pass's output, and the loss keeps {loss_copies} "
                               "more blocks of its size at its peak (the planner's loss region of a language "
                               "model)")),
    "parameters-trained": Words(description="every parameter is trained: its gradient has its size",
                                text="every parameter is trained: its gradient has its size"),
    "optimizer-state-seen": Words(description="the optimizer state is the one seen",
                                  text="the optimizer state seen"),
    "optimizer-state-adam": Words(description="the optimizer state to come is Adam's two moments",
                                  text="the optimizer state to come is Adam's: two moments per parameter"),
    "backward-mirrors-forward": Words(description="the backward mirrors the forward",
                                      text=("the backward mirrors the forward: it frees what the forward "
                                            "saved, last first, making a gradient of the same size for each; "
                                            "then the next step's forward runs as recorded, into the cache "
                                            "that backward left")),
    "unseen-fragmentation": Words(description=("the growing blocks take unseen_fragmentation_percent more "
                                               "room"),
                                  text=("the blocks that grow with the micro-batch take "
                                        "{unseen_fragmentation_percent}% more room than replayed: the "
                                        "fragmentation of the steps that were not recorded")),
    "generate-settings-kept": Words(description="the prompt length and max_new_tokens stay as recorded",
                                    text="the prompt length and max_new_tokens stay as recorded"),
    "generate-peak-grows": Words(description="the peak reserved above the fixed blocks grows with the batch",
                                 text=("every reserved byte of the peak above the blocks that do not grow "
                                       "with the batch grows in proportion to the batch: the KV cache, the "
                                       "logits, and the cache's cached earlier copies (its fragmentation)")),
})
"""Each assumption of an estimate of what fits (:data:`oomdoctor.ids.FITS_ASSUMPTIONS`): what it means, and its words,
a ``str.format`` template over ``note_values``."""


def note(note_id: FitsNote, values: dict[str, Any]) -> str:
    """The words of note ``note_id`` with ``values`` (a Fits's ``note_values``). Raises KeyError for an unknown id
    or a missing value."""
    return text(NOTES, note_id).format(**values)


def assumption(assumption_id: FitsAssumption, values: dict[str, Any]) -> str:
    """The words of assumption ``assumption_id`` with ``values``. Raises KeyError for an unknown id or a missing
    value."""
    return text(ASSUMPTIONS, assumption_id).format(**values)


def scale(batch_scale: float, at_limit: bool) -> str:
    """A scale of the micro-batch that fits: ``2.5x``, or ``at least 4.0x`` where the search stopped at its top
    (``Fits.batch_scale_at_limit``, ``Fits.expandable_at_limit``)."""
    return f"{'at least ' if at_limit else ''}{batch_scale}x"


def notes(f: Fits) -> list[str]:
    """``f``'s notes in words, in order."""
    return [note(n, f.note_values) for n in f.notes]


def assumptions(f: Fits) -> list[str]:
    """``f``'s assumptions in words, in order."""
    return [assumption(n, f.note_values) for n in f.assumptions]


@dataclass(frozen=True)
class Tail:
    """What fits in the words the terminal says it under a rank's breakdown, one attribute a part (each its own
    style or indent there)."""

    lead: str
    """Which answer it is: ``fits on this GPU (replayed): `` or ``what fits: ``."""
    answer: str
    """The answer after the lead: the scales replayed and the room they fit in; an estimate, its kind and where its
    assumptions are; or why none is said (its last note)."""
    notes: list[str]
    """A replayed answer's notes, in words (:func:`notes`)."""
    assumptions: list[str]
    """An estimate's assumptions, where the verdict did not list the same ones already (:func:`assumptions`)."""


def tail(f: Fits | None, listed: list[str] | None = None) -> Tail | None:
    """What fits ``f`` says under a rank's breakdown: a replayed answer; else an estimate or why there is none; None
    where it says nothing (no Fits, or one with no answer and no note). ``listed``: the assumptions the verdict
    already lists (an estimate resting on the same refers to them instead of listing them again)."""
    if f is not None and (f.batch_scale is not None or f.expandable_batch_scale is not None):
        bits = []
        if f.batch_scale is not None:
            bits.append(f"{scale(f.batch_scale, f.batch_scale_at_limit)} the micro-batch with the recorded settings"
                        + (f" (micro-batch {f.largest_micro_batch})" if f.largest_micro_batch is not None else ""))
        if f.expandable_batch_scale is not None:
            bits.append(f"{scale(f.expandable_batch_scale, f.expandable_at_limit)} with expandable_segments"
                        + (f" ({f.expandable_largest_micro_batch})" if f.expandable_largest_micro_batch is not None
                           else ""))
        answer = ("; ".join(bits) + f", in {format_bytes(f.room_bytes or 0)} of room less "
                  f"{format_bytes(f.margin_bytes)} kept free")
        return Tail(lead="fits on this GPU (replayed): ", answer=answer, notes=notes(f), assumptions=[])
    if f is None or (f.estimated_batch_scale is None and not f.notes):
        return None
    if f.estimated_batch_scale is None:
        return Tail(lead="what fits: ", answer="not said: " + note(f.notes[-1], f.note_values), notes=[],
                    assumptions=[])
    own = assumptions(f)
    n = f.estimated_largest_micro_batch
    what = f"micro-batch {n}" if n else f"{f.estimated_batch_scale}x the micro-batch"
    source = ("from the job's peak reserved, scaled with the batch" if "generate-estimate" in f.notes
              else "from the first forward pass")
    answer = ((f"at least {what}, a lower bound {source}" if f.bound == "lower" else
               f"about {what}, an estimate {source}") + ", not a replay"
              + (", on the assumptions listed under the verdict" if own and own == listed else
                 ", assuming:" if own else ""))
    return Tail(lead="what fits: ", answer=answer, notes=[], assumptions=own if own and own != listed else [])


def said_fields(f: Fits) -> dict[str, Any]:
    """The fields of ``f`` that hold ids, in words: ``notes``, ``assumptions`` and ``room_source`` (what the JSON and
    the notebook put where the ids are)."""
    return {"notes": notes(f), "assumptions": assumptions(f),
            "room_source": room_source(f.room_source, f.room_source_values)}


def fits_dict(f: Fits | None) -> dict[str, Any] | None:
    """``f`` as the JSON has it: its fields, with those holding ids in words (:func:`said_fields`)."""
    if f is None:
        return None
    return asdict(f) | said_fields(f)


def verdict_evidence(ev: dict[str, Any]) -> dict[str, Any]:
    """A verdict's evidence with what fits in words: ``room_source`` (a room id said with ``room_source_values``,
    which is dropped), ``no_fit_reason`` (a note id) and ``estimate_assumptions``
    (assumption ids) said with ``fit_note_values``, which is dropped (:func:`oomdoctor.report.verdict._fit_reason`)."""
    if "room_source" not in ev and "no_fit_reason" not in ev and "estimate_assumptions" not in ev:
        return ev
    out = dict(ev)
    if "room_source" in out:  # the room's id (oomdoctor.report.fits.ROOM_SOURCES) in words
        out["room_source"] = room_source(out["room_source"], out.pop("room_source_values", {}))
    if "no_fit_reason" not in ev and "estimate_assumptions" not in ev:
        return out
    values = out.pop("fit_note_values", {})
    if "no_fit_reason" in out:
        out["no_fit_reason"] = note(out["no_fit_reason"], values)
    if "estimate_assumptions" in out:
        out["estimate_assumptions"] = "; ".join(assumption(x, values) for x in out["estimate_assumptions"])
    return out
