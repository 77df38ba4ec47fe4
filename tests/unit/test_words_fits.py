"""Issue 37 item 1: what fits is data (:class:`oomdoctor.report.fits.Fits`: ``notes`` and ``assumptions`` are ids,
their numbers in ``note_values``); :mod:`oomdoctor.render.words.fits` says them. Every id's words, as the JSON has
always written them (the sentences report/fits.py appended before the ids), and the JSON's ``fits`` object and a
verdict's evidence in words where the ids are."""

from __future__ import annotations

import json

import pytest
from test_words_verdict import OOM_EV

from oomdoctor.render.words import fits as words
from oomdoctor.report import fits as fits_module
from oomdoctor.report.fits import ASSUMPTIONS, NOTES, Fits

NOTE_WORDS = {
    "no-history": "no allocation history: nothing to replay",
    "room-unknown": "the device's size is unknown (no OOM, no sidecar): what fits cannot be replayed",
    "nothing-grows": "no tensor of the trace grows with the micro-batch (no forward or backward pass seen)",
    "cut-in-inference": "the trace ends inside an inference loop (generate() or evaluation): what it would still have "
                        "made (the cache grows with every token to come) is not recorded, so what fits is not "
                        "replayed; diagnose a run that finished, with --micro-batch",
    "generate-estimate": "generate() is not replayed (where its concatenated KV cache fragments decides where a larger "
                         "batch runs out): what fits is a lower bound from the job's peak reserved, scaled with the "
                         "batch",
    "generate-not-replayed": "generate() grows its KV cache one token at a time by concatenation, and the caching "
                             "allocator's fragmentation of those caches decides where a larger batch runs out; a "
                             "replay of one batch's generation scaled to another does not reproduce it, so what fits "
                             "is not replayed: lower the batch or max_new_tokens, or use a static cache",
    "first-forward-estimate": "the trace ends inside its first forward pass: what fits is a lower bound from the "
                              "recorded part and the assumptions listed, not a replay of the whole step",
    "cut-in-first-forward": "the trace ends inside its first forward pass: the rest of that pass is not in it, so what "
                            "fits cannot be replayed from it; record a run that fits and diagnose it with "
                            "--micro-batch",
    "pipeline-warm-up": "a pipeline stage ran out in the warm-up forwards of its first step: its peak comes when every "
                        "micro-batch its schedule holds in flight is there (1F1B's first stage: one per later stage), "
                        "which the trace does not show, so no lower bound is said; record a step that finished and "
                        "diagnose it with --micro-batch",
    "optimizer-state-assumed": "no optimizer step finished before the OOM: the replay keeps room for optimizer state "
                               "of twice the parameters (Adam's two moments) and for the gradients the rest of the "
                               "backward makes",
    "gradients-assumed": "no optimizer step finished before the OOM: the replay keeps room for the gradients the rest "
                         "of the backward makes",
    "replay-failed": "the trace cannot be replayed: cudaMallocAsync {is} not modelled",
    "private-pools": "CUDA graph private pools (e.g. torch.compile mode='reduce-overhead') hold part of this run's "
                     "memory and are replayed as recorded, not scaled with the micro-batch: what fits is not replayed",
    "not-reproduced": "the allocator model does not reproduce this recording in the memory the allocator could use on "
                      "this GPU: what fits is not replayed",
    "peaks-before-window-unknown": "peaks before the recorded window are not known (the trace starts mid-job, and no "
                                   "sidecar holds PyTorch's counters): what fits is the window's, and may be too much",
    "held-to-job-peak": "held to the job's own peak (PyTorch's counters), which the recorded window missed: the job's "
                        "bytes above the window's fixed ones are taken to grow with the micro-batch",
}

ASSUMPTION_WORDS = {
    "loss-copies": "the failed request is the pass's output, and the loss keeps 5 more blocks of its size at its peak "
                   "(the planner's loss region of a language model)",
    "parameters-trained": "every parameter is trained: its gradient has its size",
    "optimizer-state-seen": "the optimizer state seen",
    "optimizer-state-adam": "the optimizer state to come is Adam's: two moments per parameter",
    "backward-mirrors-forward": "the backward mirrors the forward: it frees what the forward saved, last first, making "
                                "a gradient of the same size for each; then the next step's forward runs as recorded, "
                                "into the cache that backward left",
    "unseen-fragmentation": "the blocks that grow with the micro-batch take 11% more room than replayed: the "
                            "fragmentation of the steps that were not recorded",
    "generate-settings-kept": "the prompt length and max_new_tokens stay as recorded",
    "generate-peak-grows": "every reserved byte of the peak above the blocks that do not grow with the batch grows in "
                           "proportion to the batch: the KV cache, the logits, and the cache's cached earlier copies "
                           "(its fragmentation)",
}

# a replay error with braces: a value is put in as it is, never read as a template
VALUES = {"replay_error": "cudaMallocAsync {is} not modelled", "loss_copies": fits_module.LOSS_COPIES,
          "unseen_fragmentation_percent": round(100 * fits_module.UNSEEN_FRAGMENTATION)}


def test_every_id_has_its_words_and_no_other():
    assert set(words.NOTES) == set(NOTES) == set(NOTE_WORDS)
    assert set(words.ASSUMPTIONS) == set(ASSUMPTIONS) == set(ASSUMPTION_WORDS)
    # each id described once, in its words table (the core holds the ids only)
    assert all(w.description and w.text for w in (*words.NOTES.values(), *words.ASSUMPTIONS.values()))


@pytest.mark.parametrize("note_id", sorted(NOTE_WORDS))
def test_the_words_of_each_note(note_id):
    assert words.note(note_id, VALUES) == NOTE_WORDS[note_id]


@pytest.mark.parametrize("assumption_id", sorted(ASSUMPTION_WORDS))
def test_the_words_of_each_assumption(assumption_id):
    assert words.assumption(assumption_id, VALUES) == ASSUMPTION_WORDS[assumption_id]


def test_an_unknown_id_or_a_missing_value_raises():
    with pytest.raises(KeyError):
        words.note("no-such-note", VALUES)
    with pytest.raises(KeyError):
        words.note("replay-failed", {})
    with pytest.raises(KeyError):
        words.assumption("unseen-fragmentation", {})


def test_the_json_object_has_the_words_where_the_ids_are_in_the_fields_order():
    f = Fits(1024, "gpu-total", notes=["optimizer-state-assumed", "replay-failed"],
             assumptions=["parameters-trained", "generate-settings-kept"], note_values={"replay_error": "boom"},
             room_source_values={"given": True, "nccl": False})
    d = words.fits_dict(f)
    assert d["room_source"] == "the GPU's total memory (given with --gpu-memory) less the CUDA context (planner constants)"
    assert d["room_source_values"] == {"given": True, "nccl": False} and f.room_source == "gpu-total"
    assert list(d) == list(json.loads(json.dumps(d)))  # the dataclass's field order, nothing moved
    assert d["notes"] == [NOTE_WORDS["optimizer-state-assumed"], "the trace cannot be replayed: boom"]
    assert d["assumptions"] == [ASSUMPTION_WORDS["parameters-trained"], ASSUMPTION_WORDS["generate-settings-kept"]]
    assert d["note_values"] == {"replay_error": "boom"} and d["room_bytes"] == 1024
    assert f.notes == ["optimizer-state-assumed", "replay-failed"]  # the data is left as it was
    assert words.fits_dict(None) is None


def test_a_verdicts_evidence_says_what_fits_and_drops_the_values():
    ev = {"a": 1, "no_fit_reason": "replay-failed", "fit_note_values": {"replay_error": "boom"}, "b": 2}
    assert words.verdict_evidence(ev) == {"a": 1, "no_fit_reason": "the trace cannot be replayed: boom", "b": 2}
    ev = {"estimated_fit": 5, "estimate_assumptions": ["loss-copies", "optimizer-state-seen"],
          "fit_note_values": {"loss_copies": 5}}
    assert words.verdict_evidence(ev) == {"estimated_fit": 5, "estimate_assumptions":
                                          ASSUMPTION_WORDS["loss-copies"] + "; the optimizer state seen"}
    plain = {"largest_micro_batch": 4}
    assert words.verdict_evidence(plain) is plain
    ev = {"room_bytes": 5, "room_source": "oom-device", "room_source_values": {}}
    assert words.verdict_evidence(ev) == {
        "room_bytes": 5, "room_source": "the OOM: reserved bytes then plus the device's free bytes (cudaMemGetInfo)"}


def test_the_notebook_gives_what_fits_and_the_verdict_in_words():
    from oomdoctor.notebook import _filled_verdict, _said_fits
    from oomdoctor.report.verdict import Verdict

    f = Fits(1024, "none", notes=["replay-failed"], assumptions=["parameters-trained"],
             note_values={"replay_error": "boom"})
    said = _said_fits(f)
    assert said.room_source == "unknown: no OOM and no sidecar with the GPU's memory"
    assert said.notes == ["the trace cannot be replayed: boom"]
    assert said.assumptions == [ASSUMPTION_WORDS["parameters-trained"]]
    assert f.notes == ["replay-failed"] and _said_fits(None) is None  # a copy: the data is left as it was
    ev = {**OOM_EV, "no_fit_reason": "replay-failed", "fit_note_values": {"replay_error": "boom"}}
    said = _filled_verdict(Verdict(kind="capacity", bytes=0, ranks=[0], headroom_bytes=None, finding=None,
                                   evidence=ev, reasons=["live-tensors-exceed-room", "fit-not-said"]))
    assert said.summary.endswith(" What fits is not said: the trace cannot be replayed: boom.")
    assert said.evidence["no_fit_reason"] == "the trace cannot be replayed: boom"
    assert "fit_note_values" not in said.evidence and "fit_note_values" in ev


def test_the_json_of_a_notebook_diagnosis_is_the_json_of_its_report(snapshots):
    """``render_json`` given what ``oomdoctor.diagnose`` returns (whose verdicts and fits are already in words)
    writes its report's JSON, as ``Diagnosis.to_json()`` does, instead of saying the words again."""
    from oomdoctor import diagnose
    from oomdoctor.render.json import render_json

    d = diagnose(snapshots / "ddp-imbalance")
    assert render_json(d) == render_json(d.report) == d.to_json()


def test_the_tail_says_a_replayed_answer_an_estimate_or_why_none():
    """What fits under a rank's breakdown (:func:`words.tail`): the replayed scales and their notes; an estimate that
    refers to the verdict's list of assumptions when it is the same and lists its own otherwise; the last note where
    nothing is said; nothing at all for a Fits with no answer and no note."""
    replayed = words.tail(Fits(room_bytes=8 << 30, room_source="oom-device", batch_scale=4.0,
                               batch_scale_at_limit=True, largest_micro_batch=16, expandable_batch_scale=1.5,
                               margin_bytes=1 << 20, notes=["held-to-job-peak"]))
    assert replayed == words.Tail(
        lead="fits on this GPU (replayed): ",
        answer=("at least 4.0x the micro-batch with the recorded settings (micro-batch 16); 1.5x with "
                "expandable_segments, in 8.00 GiB of room less 1.00 MiB kept free"),
        notes=[words.note("held-to-job-peak", {})], assumptions=[])
    estimate = Fits(room_bytes=None, room_source="none", estimated_batch_scale=2.0, estimated_largest_micro_batch=6,
                    bound="lower", notes=["first-forward-estimate"], assumptions=["parameters-trained"])
    own = words.tail(estimate)
    assert own is not None and own.lead == "what fits: " and own.assumptions == words.assumptions(estimate)
    assert own.answer == "at least micro-batch 6, a lower bound from the first forward pass, not a replay, assuming:"
    listed = words.tail(estimate, words.assumptions(estimate))
    assert listed is not None and listed.assumptions == []
    assert listed.answer.endswith(", not a replay, on the assumptions listed under the verdict")
    none = words.tail(Fits(room_bytes=None, room_source="none", notes=["nothing-grows", "room-unknown"]))
    assert none == words.Tail(lead="what fits: ", answer="not said: " + NOTE_WORDS["room-unknown"], notes=[],
                              assumptions=[])
    assert words.tail(Fits(room_bytes=None, room_source="none")) is None and words.tail(None) is None
