"""The words of what fits (:class:`oomdoctor.report.fits.Fits`): its ``notes`` and ``assumptions`` are ids
(:data:`~oomdoctor.report.fits.NOTES`, :data:`~oomdoctor.report.fits.ASSUMPTIONS`), said here with the numbers and
messages in its ``note_values``. The JSON writes these words where the ids are (:func:`fits_dict`), as it always has."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .capacity import room_source

if TYPE_CHECKING:  # annotations only: report/fits imports the analyses, which `oomdoctor simulate` does not need
    from ...report.fits import Fits

NOTES = {
    "no-history": "no allocation history: nothing to replay",
    "room-unknown": "the device's size is unknown (no OOM, no sidecar): what fits cannot be replayed",
    "nothing-grows": "no tensor of the trace grows with the micro-batch (no forward or backward pass seen)",
    "cut-in-inference": ("the trace ends inside an inference loop (generate() or evaluation): what it would still have "
                         "made (the cache grows with every token to come) is not recorded, so what fits is not "
                         "replayed; diagnose a run that finished, with --micro-batch"),
    "generate-estimate": ("generate() is not replayed (where its concatenated KV cache fragments decides where a larger "
                          "batch runs out): what fits is a lower bound from the job's peak reserved, scaled with the "
                          "batch"),
    "generate-not-replayed": ("generate() grows its KV cache one token at a time by concatenation, and the caching "
                              "allocator's fragmentation of those caches decides where a larger batch runs out; a "
                              "replay of one batch's generation scaled to another does not reproduce it, so what fits "
                              "is not replayed: lower the batch or max_new_tokens, or use a static cache"),
    "first-forward-estimate": ("the trace ends inside its first forward pass: what fits is a lower bound from the "
                               "recorded part and the assumptions listed, not a replay of the whole step"),
    "cut-in-first-forward": ("the trace ends inside its first forward pass: the rest of that pass is not in it, so "
                             "what fits cannot be replayed from it; record a run that fits and diagnose it with "
                             "--micro-batch"),
    "pipeline-warm-up": ("a pipeline stage ran out in the warm-up forwards of its first step: its peak comes when "
                         "every micro-batch its schedule holds in flight is there (1F1B's first stage: one per later "
                         "stage), which the trace does not show, so no lower bound is said; record a step that "
                         "finished and diagnose it with --micro-batch"),
    "optimizer-state-assumed": ("no optimizer step finished before the OOM: the replay keeps room for optimizer "
                                "state of twice the parameters (Adam's two moments) and for the gradients the rest "
                                "of the backward makes"),
    "gradients-assumed": ("no optimizer step finished before the OOM: the replay keeps room for the gradients the "
                          "rest of the backward makes"),
    "replay-failed": "the trace cannot be replayed: {replay_error}",
    "private-pools": ("CUDA graph private pools (e.g. torch.compile mode='reduce-overhead') hold part of this "
                      "run's memory and are replayed as recorded, not scaled with the micro-batch: what fits is "
                      "not replayed"),
    "not-reproduced": ("the allocator model does not reproduce this recording in the memory the allocator could "
                       "use on this GPU: what fits is not replayed"),
    "peaks-before-window-unknown": ("peaks before the recorded window are not known (the trace starts mid-job, and no "
                                    "sidecar holds PyTorch's counters): what fits is the window's, and may be too "
                                    "much"),
    "held-to-job-peak": ("held to the job's own peak (PyTorch's counters), which the recorded window missed: the "
                         "job's bytes above the window's fixed ones are taken to grow with the micro-batch"),
}
"""Each note id's words, a ``str.format`` template over ``note_values``."""

ASSUMPTIONS = {
    "loss-copies": ("the failed request is the pass's output, and the loss keeps {loss_copies} more blocks of its "
                    "size at its peak (the planner's loss region of a language model)"),
    "parameters-trained": "every parameter is trained: its gradient has its size",
    "optimizer-state-seen": "the optimizer state seen",
    "optimizer-state-adam": "the optimizer state to come is Adam's: two moments per parameter",
    "backward-mirrors-forward": ("the backward mirrors the forward: it frees what the forward saved, last first, "
                                 "making a gradient of the same size for each; then the next step's forward runs as "
                                 "recorded, into the cache that backward left"),
    "unseen-fragmentation": ("the blocks that grow with the micro-batch take {unseen_fragmentation_percent}% more "
                             "room than replayed: the fragmentation of the steps that were not recorded"),
    "generate-settings-kept": "the prompt length and max_new_tokens stay as recorded",
    "generate-peak-grows": ("every reserved byte of the peak above the blocks that do not grow with the batch grows "
                            "in proportion to the batch: the KV cache, the logits, and the cache's cached earlier "
                            "copies (its fragmentation)"),
}
"""Each assumption id's words, a ``str.format`` template over ``note_values``."""


def note(note_id: str, values: dict[str, Any]) -> str:
    """The words of note ``note_id`` with ``values`` (a Fits's ``note_values``). Raises KeyError for an unknown id
    or a missing value."""
    return NOTES[note_id].format(**values)


def assumption(assumption_id: str, values: dict[str, Any]) -> str:
    """The words of assumption ``assumption_id`` with ``values``. Raises KeyError for an unknown id or a missing
    value."""
    return ASSUMPTIONS[assumption_id].format(**values)


def notes(f: Fits) -> list[str]:
    """``f``'s notes in words, in order."""
    return [note(n, f.note_values) for n in f.notes]


def assumptions(f: Fits) -> list[str]:
    """``f``'s assumptions in words, in order."""
    return [assumption(n, f.note_values) for n in f.assumptions]


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
