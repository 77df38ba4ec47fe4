"""The words of a verdict (:mod:`oomdoctor.render.words.verdict`), id by id: each reason of
:data:`oomdoctor.report.verdict.REASONS` and each action of :data:`~oomdoctor.report.verdict.ACTIONS` said from a
verdict built in code, filled from its evidence (strict templates: every field must be in the evidence, see
conftest). The rules that choose the ids are tested in test_verdict_rules / test_verdict_text_rules."""

from __future__ import annotations

import pytest

from oomdoctor.detectors.finding import Fix
from oomdoctor.frameworks import PIPELINE_KNOB, framework
from oomdoctor.render.format import format_bytes as B
from oomdoctor.render.words import verdict as words
from oomdoctor.render.words.findings import fix_text
from oomdoctor.report.verdict import ACTIONS, Action, Verdict
from oomdoctor.units import MiB

GiB = 1024 * MiB
HEALTHY_EV = {"peak_reserved_bytes": 900 * MiB, "peak_allocated_bytes": 768 * MiB, "room_bytes": 2 * GiB,
              "headroom_bytes": 2 * GiB - 900 * MiB, "phase": "forward", "window_peak_reserved_bytes": 800 * MiB,
              "window_peak_allocated_bytes": 700 * MiB, "peak_source": "sidecar", "kv_cache_bytes": 300 * MiB,
              "material_findings": 1}
OOM_EV = {"request_bytes": 256 * MiB, "allocated_bytes": GiB, "need_bytes": GiB + 256 * MiB, "shortfall_bytes": 64 * MiB,
          "room_bytes": GiB + 192 * MiB, "free_bytes": 192 * MiB, "largest_free_block_bytes": 128 * MiB,
          "phase": "backward", "in_flight": 3, "kv_cache_bytes": 300 * MiB, "largest_micro_batch": 4, "batch_scale": 0.5,
          "estimated_fit": 5, "estimate_assumptions": ["parameters-trained", "generate-settings-kept"], "no_fit_reason": "replay-failed",
          "fit_note_values": {"replay_error": "cudaMallocAsync is not modelled"},
          "kept_bytes": 512 * MiB, "excess_bytes": 640 * MiB, "pending_free_bytes": 96 * MiB,
          "graph_pool_bytes": 32 * MiB, "defragmented_config": "expandable_segments:True",
          "fix_outcome": "no-oom", "fix_peak_reserved_bytes": GiB, "fix_spare_bytes": 77 * MiB,
          "fix_margin_bytes": 20 * MiB, "fix_at_edge": False, "defragmented_outcome_template": "no-oom",
          "fix_continuation": {"outcome": "later-steps", "heaviest_step_peak_allocated_bytes": GiB,
                               "margin_bytes": None, "margin": {"reserved_step_spread_bytes": None,
                                                                "unrecorded_bytes": 0}},
          "kv_cache_growth_per_token_bytes": 2 * MiB, "kv_room_after_fix_bytes": MiB, "kv_cache_tokens_fit": 160,
          "kv_cache_tokens": 150, "kv_tokens_more": 10, "checkpointing_frees_bytes": 300 * MiB,
          "sharding_frees_bytes": GiB, "logits_bytes": 400 * MiB, "logits_sites": "loss.py:3 in cross_entropy"}


def said(kind: str, reasons: list[str], ev: dict | None = None) -> str:
    return words.summary(Verdict(kind=kind, bytes=0, ranks=[0], headroom_bytes=None, finding=None,
                                 evidence=dict(HEALTHY_EV if ev is None else ev), reasons=reasons))


def test_healthy_with_the_room_and_its_peaks():
    assert said("healthy", ["room-known"]) == (
        f"no OOM and nothing worth fixing; peak reserved {B(900 * MiB)} of the {B(2 * GiB)} the allocator could use "
        f"on this GPU ({B(2 * GiB - 900 * MiB)} headroom), peak allocated {B(768 * MiB)} in the forward phase.")
    assert said("healthy", ["room-unknown"]) == (
        f"no OOM and nothing worth fixing; peak reserved {B(900 * MiB)}, peak allocated {B(768 * MiB)} in the forward "
        "phase (the GPU's size is not recorded).")


def test_healthy_window_missed_its_peaks():
    got = said("healthy", ["room-unknown", "reserved-window-missed", "allocated-window-missed"])
    assert (f"peak reserved {B(900 * MiB)} (the job's, PyTorch's counters, from the sidecar; the recorded window's "
            f"peak was {B(800 * MiB)}: the window missed it)") in got
    assert f"peak allocated {B(768 * MiB)} (the job's; the recorded window's peak was {B(700 * MiB)}: " in got
    got = said("healthy", ["room-unknown", "reserved-window-missed"], {**HEALTHY_EV, "peak_source": "memory-stats"})
    assert "PyTorch's counters, from the memory_stats file;" in got
    # issue 52: a job's peak above the window's by less than the materiality rule's bytes is said beside it, not as
    # a miss
    got = said("healthy", ["room-unknown", "reserved-job-peak", "allocated-job-peak"])
    assert (f"peak reserved {B(900 * MiB)} (the job's, PyTorch's counters, from the sidecar; {B(800 * MiB)} in the "
            "recorded window)") in got
    assert f"peak allocated {B(768 * MiB)} (the job's; {B(700 * MiB)} in the recorded window) in the forward phase" in got
    assert "missed" not in got
    assert said("healthy", ["room-unknown", "peaks-before-window-unknown"]).endswith(
        " Peaks before the recorded window are not known (the trace starts after the job's first allocation and no "
        "sidecar holds PyTorch's counters): these are the window's, and the job's may be higher.")


def test_healthy_at_the_edge_with_its_kv_cache_and_material_findings():
    got = said("healthy", ["room-known", "at-edge", "kv-cache-named"])
    assert got.startswith("at the edge: no OOM and nothing worth fixing; ")
    assert got.endswith(f" The KV cache holds {B(300 * MiB)}: it grows with the batch and with every generated token.")
    got = said("healthy", ["room-known", "at-edge", "material-findings"])
    assert got.startswith("at the edge: no OOM; peak reserved")
    assert got.endswith(" The finding below is worth fixing, but it decides no other verdict.")
    got = said("healthy", ["room-known", "material-findings"], {**HEALTHY_EV, "material_findings": 2})
    assert got.endswith(" The findings below are worth fixing, but none decides another verdict.")


def test_without_history():
    ev = {"allocated_bytes": 256 * MiB, "reserved_bytes": 512 * MiB}
    assert said("healthy", ["final-state-only"], ev) == (
        f"final state only, without allocation history: {B(256 * MiB)} allocated, {B(512 * MiB)} reserved, no OOM "
        "recorded; record with torch.cuda.memory._record_memory_history(max_entries=100000) to see what happened.")
    assert said("healthy", ["final-state-only", "material-findings"], {**ev, "material_findings": 1}).endswith(
        "recorded; record with torch.cuda.memory._record_memory_history(max_entries=100000) to see what happened. "
        "The finding below is worth fixing, but it decides no other verdict.")
    assert said("empty", ["nothing-recorded"], {}) == (
        "nothing recorded: the snapshot holds no segment and no event (taken before any CUDA allocation, or on a "
        "device the job did not use).")


def test_a_finding_decides():
    ev = {"title": "Deferred frees", "finding_bytes": 150 * MiB, "peak_reserved_bytes": GiB}
    assert said("deferred-free", ["finding-decides"], ev) == (
        f"Deferred frees: {B(150 * MiB)} at stake (no OOM in this trace; peak reserved {B(GiB)}).")


def test_oom_kinds():
    assert said("growth", ["kept-across-micro-batches"], OOM_EV) == (
        f"out of memory after {B(512 * MiB)} were kept across micro-batches (outputs gathered or cached, backward "
        "phase): the job accumulates; a larger GPU only delays it.")
    assert said("imbalance", ["rank-excess"], OOM_EV) == (
        f"out of memory on this rank, which holds {B(640 * MiB)} more than the others: without the excess it would fit.")
    assert said("deferred-free", ["pending-frees"], OOM_EV) == (
        f"{B(96 * MiB)} freed by Python were still held for other streams (record_stream) at the OOM; without them "
        "the request fits.")
    assert said("capacity", ["room-unknown"], OOM_EV) == (
        f"out of memory asking for {B(256 * MiB)} with {B(GiB)} allocated; the GPU's room is unknown, so capacity "
        "cannot be told from fragmentation.")


CAPACITY = (f"the live tensors ({B(GiB)}) plus the failed request ({B(256 * MiB)}) need {B(GiB + 256 * MiB)}, "
            f"{B(64 * MiB)} more than the {B(GiB + 192 * MiB)} the allocator could use on this GPU: no allocator "
            "setting helps.")


ASSUMED = "every parameter is trained: its gradient has its size; the prompt length and max_new_tokens stay as recorded"


@pytest.mark.parametrize("reasons, tail", [
    ([], ""),
    (["pipeline-in-flight"], " 3 micro-batches were in flight, their activations awaiting their backward: the "
                             "pipeline schedule holds them at once."),
    (["kv-cache-named"], f" The KV cache holds {B(300 * MiB)}, and grows with the batch and every generated token."),
    (["fit-micro-batch"], " The largest micro-batch that fits: 4."),
    (["fit-batch-scale"], " What fits: 0.5x the current micro-batch."),
    # the answer and its kind; the assumptions are listed apart (words.assumptions), not chained in (issue 52)
    (["fit-lower-bound"], " At least 5 fits: a lower bound from the first forward pass, not a replay, on the "
                          "assumptions listed below."),
    (["fit-estimate"], " About 5 would fit: an estimate from the first forward pass, not a replay, on the assumptions "
                       "listed below; the fragmentation of the steps that were not recorded is not in it, so take less."),
    (["fit-not-said"], " What fits is not said: the trace cannot be replayed: cudaMallocAsync is not modelled."),
], ids=["alone", "in-flight", "kv", "micro-batch", "scale", "lower-bound", "estimate", "not-said"])
def test_capacity(reasons, tail):
    assert said("capacity", ["live-tensors-exceed-room", *reasons], OOM_EV) == CAPACITY + tail


def test_an_estimates_assumptions_are_listed_one_each():
    v = Verdict(kind="capacity", bytes=0, ranks=[0], reasons=["live-tensors-exceed-room", "fit-lower-bound"],
                evidence=dict(OOM_EV))
    assert words.assumptions(v) == ASSUMED.split("; ")
    ev = {**OOM_EV, "estimate_assumptions": ["generate-settings-kept", "generate-peak-grows"]}
    v = Verdict(kind="capacity", bytes=0, ranks=[0], reasons=["live-tensors-exceed-room", "fit-lower-bound"],
                evidence=ev)
    assert "a lower bound from the job's peak reserved, scaled with the batch" in words.summary(v)
    assert words.assumptions(Verdict(kind="capacity", bytes=0, ranks=[0], evidence={})) == []


FRAGMENTATION = (f"{B(192 * MiB)} were free (cached or on the device) for a request of {B(256 * MiB)}, but not in one "
                 f"piece (largest free block {B(128 * MiB)}).")
SIMULATED = (f" Simulated with expandable_segments:True, it no OOM, peak reserved {B(GiB)} with {B(77 * MiB)} to spare "
             f"(margin {B(20 * MiB)}); later steps: for steps whose tensors peak at up to {B(GiB)}, the heaviest "
             "recorded")


@pytest.mark.parametrize("kind, reasons, tail", [
    ("fragmentation", [], ""),
    ("fragmentation", ["graph-pools"], f" {B(32 * MiB)} were reserved by CUDA graph private pools (torch.compile "
                                       "mode='reduce-overhead'): their free space serves only their graphs, and the "
                                       "allocator cannot release cached segments while a graph is being captured."),
    ("fragmentation", ["fix-simulated"], SIMULATED + "."),
    ("fragmentation", ["fix-simulated", "kv-fits-with-fix", "fit-micro-batch"],
     SIMULATED + ". With it the KV cache fits 160 tokens per sequence at this batch (10 more than the 150 it holds)."
     " With the recorded settings the largest micro-batch that fits is 4."),
    ("fragmentation", ["fit-batch-scale"], " With the recorded settings 0.5x the current micro-batch fits."),
    ("capacity", ["fix-simulated", "fragmentation-hit-first", "runs-out-without-it"],
     SIMULATED + ": fragmentation hit first, but the job runs out even without it."),
    ("capacity", ["fix-simulated", "fragmentation-hit-first", "at-edge-without-it", "fit-batch-scale"],
     SIMULATED + ": fragmentation hit first, but the job is at the edge of the GPU even without it. What fits: 0.5x "
                 "the current micro-batch."),
    ("capacity", ["fix-simulated", "fragmentation-hit-first", "kv-generation-at-capacity"],
     SIMULATED + f": fragmentation hit first, but the KV cache grows {B(2 * MiB)} per generated token and the fix "
                 f"leaves {B(MiB)} beyond the request and the margin: the generation is at capacity. The cache fits "
                 "160 tokens per sequence at this batch (it holds 150 now)."),
], ids=["alone", "graph-pools", "fix", "fix-kv-fit", "scale", "runs-out", "at-edge", "kv-capacity"])
def test_fragmentation(kind, reasons, tail):
    assert said(kind, ["not-in-one-piece", *reasons], OOM_EV) == FRAGMENTATION + tail


def test_a_fix_through_the_recorded_steps_whose_step_then_runs_out_is_fragmentation_said_so():
    # issue 49: the cause is the recorded OOM's; the rest of the step running out is the second statement
    ev = {**OOM_EV, "fix_outcome": "step-ran-out", "fix_extended_oom_requested_bytes": 512 * MiB,
          "fix_extended_peak_reserved_bytes": GiB}
    assert said("fragmentation", ["not-in-one-piece", "fix-simulated", "continuation-runs-out"], ev) == (
        FRAGMENTATION + " Simulated with expandable_segments:True, it gets past the recorded OOM and through the "
        f"recorded steps (peak reserved {B(GiB)}) with {B(77 * MiB)} to spare (margin {B(20 * MiB)}), but the rest of "
        f"the step, replayed as the previous step ran it, runs out of memory asking for {B(512 * MiB)}.")


def test_under_a_memory_fraction_cap():
    assert said("fragmentation", ["not-in-one-piece", "fraction-cap"], OOM_EV).startswith(
        f"{B(192 * MiB)} were free under the memory-fraction cap of {B(GiB + 192 * MiB)}, cached or not yet reserved, "
        f"for a request of {B(256 * MiB)}, but not in one piece")


def test_a_cap_read_off_the_oom_is_said_as_a_lower_bound():
    """The cap simulate gives as a range (its lower end the room) is 'at least' that, never stated as the cap."""
    assert said("fragmentation", ["not-in-one-piece", "fraction-cap", "cap-lower-end"], OOM_EV).startswith(
        f"{B(192 * MiB)} were free under a memory-fraction cap of at least {B(GiB + 192 * MiB)}, cached or not yet "
        f"reserved, for a request of {B(256 * MiB)}, but not in one piece")


def test_every_reason_is_said():
    # each id changes the words of some verdict: none is dead (the others: the tests above, kind by kind)
    base = {"healthy": ["room-known"], "capacity": ["live-tensors-exceed-room"]}
    for r in ("at-edge", "material-findings", "reserved-window-missed", "allocated-window-missed",
              "reserved-job-peak", "allocated-job-peak", "peaks-before-window-unknown"):
        assert said("healthy", [*base["healthy"], r]) != said("healthy", base["healthy"]), r
    for r in ("pipeline-in-flight", "kv-cache-named", "fit-micro-batch", "fit-batch-scale", "fit-lower-bound",
              "fit-estimate", "fit-not-said"):
        assert said("capacity", [*base["capacity"], r], OOM_EV) != said("capacity", base["capacity"], OOM_EV), r


def act(a: Action, ev: dict | None = None) -> str:
    v = Verdict(kind="capacity", bytes=0, ranks=[0], evidence=dict(OOM_EV if ev is None else ev), to_do=[a])
    return words.actions(v)[0]


ALLOC = "Set PYTORCH_ALLOC_CONF=expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF before PyTorch 2.9)"


@pytest.mark.parametrize("action, text", [
    (Action(id="pipeline-schedule"), PIPELINE_KNOB[:1].upper() + PIPELINE_KNOB[1:] + "."),
    (Action(id="kv-cache-smaller", framework="generate"),
     "Make the KV cache smaller or steadier: " + framework("generate").knobs["kv-cache"] + "."),
    (Action(id="micro-batch-at-most"), "Use a per-device micro-batch of at most 4 and more gradient accumulation steps "
                                    "to keep the global batch."),
    (Action(id="micro-batch-scale"), "Cut the per-device micro-batch to 0.5x the current one (give --micro-batch N to get "
                                  "the number) and accumulate gradients to keep the global batch."),
    (Action(id="activation-checkpointing"), f"Activation checkpointing frees at most {B(300 * MiB)} (the activations "
                                         "saved for backward at the peak; recomputation adds back one layer's)."),
    (Action(id="shard-optimizer"), f"Sharding the optimizer state over the data-parallel ranks (ZeRO-1 / FSDP) frees "
                                f"{B(GiB)}."),
    (Action(id="alloc-conf-not-simulated"), ALLOC + " so that free memory is not stranded between segments (not "
                                                 "simulated: the allocator model cannot replay this recording)."),
    (Action(id="alloc-conf-simulated"), ALLOC + f": simulated, it no OOM, peak reserved {B(GiB)} with {B(77 * MiB)} to "
                                             f"spare (margin {B(20 * MiB)}); later steps: for steps whose tensors "
                                             f"peak at up to {B(GiB)}, the heaviest recorded."),
    (Action(id="alloc-conf-not-enough"), ALLOC + " to stop stranding free memory; simulated, it is not enough here: "
                                              "lower the micro-batch too."),
    (Action(id="finding-fix", fix=Fix("sharded-checkpoint", "all", "s")), fix_text(Fix("sharded-checkpoint", "all", "s"))),
    (Action(id="logits"), f"The loss's logits hold {B(400 * MiB)} (loss.py:3 in cross_entropy): compute the loss in "
                       "chunks or fuse the LM head with the cross-entropy."),
], ids=lambda x: x.id if isinstance(x, Action) else "")
def test_each_action(action, text):
    assert act(action) == text


def test_framework_knobs_are_said_as_the_framework_writes_them():
    fw = next(f for f in ("deepspeed", "megatron", "lightning", "transformers") if _has(f, "activations"))
    assert act(Action(id="framework-activations", framework=fw)) == f"{framework(fw).name}: {framework(fw).knobs['activations']}."
    fw = next(f for f in ("transformers", "lightning", "liger", "accelerate", "megatron") if _has(f, "logits"))
    assert act(Action(id="logits", framework=fw)) == (
        f"The loss's logits hold {B(400 * MiB)} (loss.py:3 in cross_entropy): {framework(fw).knobs['logits']}.")


def test_the_setting_named_is_the_replayed_one():
    ev = {**OOM_EV, "defragmented_config": "max_split_size_mb:512"}
    assert act(Action(id="alloc-conf-not-enough"), ev).startswith("Set PYTORCH_ALLOC_CONF=max_split_size_mb:512 ")


def test_every_action_is_said():
    # every id has its own words, all different
    fw = {"kv-cache-smaller": "generate", "framework-activations": "deepspeed"}
    got = {act(Action(id=x, framework=fw.get(x), fix=Fix("sharded-checkpoint", "all", "s"))) for x in ACTIONS}
    assert len(got) == len(ACTIONS) and all(got)
    with pytest.raises(KeyError):
        act(Action(id="no-such-action"))


def _has(fid: str, knob: str) -> bool:
    try:
        return knob in framework(fid).knobs
    except KeyError:
        return False
