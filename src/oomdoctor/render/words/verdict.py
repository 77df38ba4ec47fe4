"""The words of a verdict (:class:`oomdoctor.report.verdict.Verdict`): its summary from its ``kind``, ``reasons``
and ``evidence``, its actions from its ``to_do``; both are templates over the evidence (``{key:bytes}``), filled by
:func:`oomdoctor.render.format.fill` (:func:`summary` and :func:`actions` fill them). The decisions are made in
``report/verdict.py``; every sentence is here (issue 37)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ...frameworks import PIPELINE_KNOB, framework
from ...ids import VERDICT_ACTIONS, VERDICT_KINDS, VERDICT_REASONS, VerdictReason
from ..format import fill
from . import fits as fits_words
from . import predict as predict_words
from .findings import fix_text, verdict_evidence
from .table import Words, table

if TYPE_CHECKING:
    from ...report.verdict import Action, Verdict

REASONS = table("verdict reason", VERDICT_REASONS, {
    # healthy, with history
    "room-known": Words(description="the room the allocator could use is known: the headroom is stated"),
    "room-unknown": Words(description=("the GPU's size is not recorded (healthy), or at an OOM capacity "
                                       "cannot be told from fragmentation")),
    "reserved-window-missed": Words(description=("the job's peak reserved (PyTorch's counters) is above the "
                                                 "recorded window's by a material gap (analysis/jobpeak.py "
                                                 "MISS_SAID_BYTES)")),
    "allocated-window-missed": Words(description=("the job's peak allocated is above the recorded window's by"
                                                  " a material gap")),
    "reserved-job-peak": Words(description=("the job's peak reserved is above the recorded window's by less: "
                                            "said beside it, no miss")),
    "allocated-job-peak": Words(description=("the job's peak allocated is above the recorded window's by "
                                             "less: said beside it")),
    "peaks-before-window-unknown": Words(description=("the trace starts after the job's first allocation and "
                                                      "nothing says the peaks before")),
    "at-edge": Words(description="healthy with less than EDGE_FRACTION of the room left"),
    "kv-cache-named": Words(description=("the KV cache holds at least KV_CACHE_FRACTION of the allocated "
                                         "bytes")),
    "material-findings": Words(description=("healthy, with material findings that decide no verdict (evidence"
                                            " material_findings)")),
    # healthy or empty, without history
    "final-state-only": Words(description="a snapshot without allocation history: the final state is judged"),
    "nothing-recorded": Words(description="a snapshot without segments or events"),
    # without an OOM, a finding decides
    "finding-decides": Words(description=("a material finding decides the verdict of a rank without OOM "
                                          "(evidence finding, title)")),
    # at an OOM
    "kept-across-micro-batches": Words(description=("growth: memory kept across micro-batches covers the "
                                                    "shortfall")),
    "rank-excess": Words(description="imbalance: this rank's excess over the others covers the shortfall"),
    "live-tensors-exceed-room": Words(description=("capacity: the live tensors plus the failed request need "
                                                   "more than the room")),
    "pipeline-in-flight": Words(description=("two or more micro-batches were in flight at the OOM and the job"
                                             " runs a pipeline schedule (evidence schedule_evidence: "
                                             "sidecar-stage, pipeline-framework, point-to-point, "
                                             "losses-in-one-forward)")),
    "held-by-exception": Words(description=("kept-exception: an earlier attempt's tensors, held by its caught"
                                            " exception, cover the shortfall (evidence kept_exception_bytes, "
                                            "kept_oom_event, kept_retry_event)")),
    "oom-in-optimizer-step": Words(description=("the OOM is inside optimizer.step(): a smaller micro-batch "
                                                "does not help (evidence optimizer_state_bytes, "
                                                "parameters_bytes)")),
    "pending-frees": Words(description="deferred-free: blocks held for other streams made the difference"),
    "not-in-one-piece": Words(description="fragmentation: enough was free, but not in one piece"),
    "fraction-cap": Words(description="the room is a memory-fraction cap (evidence room_kind)"),
    "cap-lower-end": Words(description=("the cap is read off the OOM (the device still had the segment free):"
                                        " the room is its lower end, the peak reserved before it (fits' "
                                        "room_source oom-fraction-cap, simulate/capacity.py rule 3)")),
    "free-split": Words(description=("the free bytes are reserved_unallocated_bytes less pending_free_bytes "
                                     "(cached) plus unreserved_bytes (not yet reserved under the room)")),
    "graph-pools": Words(description="CUDA graph private pools reserved memory (evidence graph_pool_bytes)"),
    "fix-simulated": Words(description=("the fragmentation fix was replayed (evidence defragmented_config, "
                                        "fix_*)")),
    "fragmentation-hit-first": Words(description=("the fix was replayed and fragmentation hit first, but the "
                                                  "job is at capacity")),
    "continuation-runs-out": Words(description=("fragmentation: the fix gets through the recorded steps, but "
                                                "the rest of the step, replayed as the previous step ran it, "
                                                "runs out (evidence extended_request_bytes)")),
    "runs-out-without-it": Words(description="... the replay with the fix runs out too"),
    "at-edge-without-it": Words(description=("... the replay with the fix gets through with less spare room "
                                             "than the margin")),
    "kv-generation-at-capacity": Words(description="... the fix leaves less than one token's KV-cache growth"),
    "kv-fits-with-fix": Words(description="the fix lets the KV cache grow by kv_tokens_more tokens"),
    # what fits (:func:`_fit_reason`)
    "fit-micro-batch": Words(description=("the largest whole micro-batch that fits (evidence "
                                          "largest_micro_batch)")),
    "fit-batch-scale": Words(description="the batch scale that fits (evidence batch_scale)"),
    "fit-lower-bound": Words(description=("an estimate from a trace cut in its first forward pass, a lower "
                                          "bound (estimate_assumptions: ids)")),
    "fit-estimate": Words(description="an estimate from a trace cut in its first forward pass"),
    "fit-not-said": Words(description=("what fits is not said (evidence no_fit_reason: an id of "
                                       "report/fits.py NOTES)")),
})
"""What each reason of a verdict means (:data:`oomdoctor.ids.VERDICT_REASONS`): the summary is composed from several
reasons and the evidence by :func:`summary`, so no reason has words of its own."""

KINDS = table("verdict kind", VERDICT_KINDS, {
    "capacity": Words(description="the live tensors need more than the room: the job does not fit as configured"),
    "fragmentation": Words(description=("enough memory was free, reserved but unallocated, yet not in one piece for "
                                        "the failed request")),
    "deferred-free": Words(description=("blocks freed by Python but held for other streams (record_stream) made the "
                                        "difference, or hold a material share of the peak")),
    "growth": Words(description="memory kept across micro-batches or steps grows: outputs accumulated, a leak"),
    "kept-exception": Words(description="an earlier attempt's tensors, held by its caught exception, cover the "
                                        "shortfall"),
    "imbalance": Words(description="one rank holds materially more than the others"),
    "healthy": Words(description="no OOM, and nothing material decides another answer"),
    "empty": Words(description="the snapshot holds no segments and no events"),
})
"""What each verdict kind answers (:data:`oomdoctor.ids.VERDICT_KINDS`); the summary says it with its reasons."""

ACTIONS = table("verdict action", VERDICT_ACTIONS, {
    "pipeline-schedule": Words(description="run a pipeline schedule that holds fewer micro-batches in flight"),
    "optimizer-memory": Words(description=("give the optimizer less state (8-bit, factored or momentum-only, or "
                                           "sharded or offloaded): the OOM is inside optimizer.step()")),
    "kv-cache-smaller": Words(description="make the KV cache smaller or steadier (the framework's knob)"),
    "micro-batch-at-most": Words(description=("the largest whole micro-batch that fits, with gradient accumulation "
                                              "to keep the global batch")),
    "micro-batch-scale": Words(description="the scale of the micro-batch that fits, with gradient accumulation"),
    "activation-checkpointing": Words(description="what activation checkpointing frees at most"),
    "shard-optimizer": Words(description="what sharding the optimizer state over the data-parallel ranks frees"),
    "framework-activations": Words(description="the framework's own knob for activations"),
    "alloc-conf-not-simulated": Words(description="an allocator setting against fragmentation, not replayed"),
    "alloc-conf-simulated": Words(description="an allocator setting against fragmentation, with its replay's outcome"),
    "alloc-conf-not-enough": Words(description=("an allocator setting against fragmentation, replayed and not "
                                                "enough: lower the micro-batch too")),
    "finding-fix": Words(description="the fix of the finding that decides the verdict"),
    "logits": Words(description=("the loss's logits and where they are held: compute the loss in chunks or fuse "
                                 "the LM head with the cross-entropy")),
})
"""What each action means (:data:`oomdoctor.ids.VERDICT_ACTIONS`); :func:`action_template` says it with the
evidence."""

NO_MATERIAL = "no OOM and nothing worth fixing; "
ONE_MATERIAL = " The finding below is worth fixing, but it decides no other verdict."
MATERIAL = " The findings below are worth fixing, but none decides another verdict."
ALLOC_CONF = "Set PYTORCH_ALLOC_CONF={setting} (PYTORCH_CUDA_ALLOC_CONF before PyTorch 2.9)"


def fix_prediction(ev: dict[str, Any]) -> dict[str, Any]:
    """The prediction of the fragmentation fix a verdict's evidence holds under ``fix_`` (report/verdict.py)."""
    return {k[4:]: x for k, x in ev.items() if k.startswith("fix_")}


def fix_outcome_template(ev: dict[str, Any]) -> str:
    """How the fix's replay ended (:func:`.predict.outcome_template`), as a template over the verdict's evidence."""
    return re.sub(r"\{(\w)", r"{fix_\1", predict_words.outcome_template(fix_prediction(ev)))


def literal(text: str) -> str:
    """``text`` as a template that renders as itself (a fix's or a framework's text may hold braces:
    ``auto_wrap_policy={Block}``)."""
    return text.replace("{", "{{").replace("}", "}}")


def _peak_words(r: set[VerdictReason], ev: dict[str, Any]) -> tuple[str, str, str]:
    """A healthy verdict's pieces: after the peak reserved, after the peak allocated, and a last sentence."""
    counters = "PyTorch's counters" + (", from the sidecar" if ev.get("peak_source") == "sidecar" else
                                       ", from the memory_stats file")
    reserved = (f" (the job's, {counters}; the recorded window's peak was {{window_peak_reserved_bytes:bytes}}: "
                "the window missed it)" if "reserved-window-missed" in r else
                f" (the job's, {counters}; {{window_peak_reserved_bytes:bytes}} in the recorded window)"
                if "reserved-job-peak" in r else "")
    allocated = (" (the job's; the recorded window's peak was {window_peak_allocated_bytes:bytes}: the window missed "
                 "it)" if "allocated-window-missed" in r else
                 " (the job's; {window_peak_allocated_bytes:bytes} in the recorded window) in the {phase} phase"
                 if "allocated-job-peak" in r else " in the {phase} phase")
    unknown = (" Peaks before the recorded window are not known (the trace starts after the job's first allocation "
               "and no sidecar holds PyTorch's counters): these are the window's, and the job's may be higher."
               if "peaks-before-window-unknown" in r else "")
    return reserved, allocated, unknown


def _estimated_from(ev: dict[str, Any]) -> str:
    """What an estimate of what fits is made from: the job's peak of a generate() run (its assumptions say so), else
    the first forward pass its trace ends in (:func:`oomdoctor.report.fits.fits`)."""
    if "generate-peak-grows" in (ev.get("estimate_assumptions") or ()):
        return "from the job's peak reserved, scaled with the batch"
    return "from the first forward pass"


def assumptions(v: Verdict) -> list[str]:
    """What the verdict's estimate of what fits rests on, in words, one each (``estimate_assumptions``: ids of
    :data:`oomdoctor.report.fits.ASSUMPTIONS`, said with ``fit_note_values``); empty for a replayed answer."""
    ids = v.evidence.get("estimate_assumptions") or []
    return [fits_words.assumption(x, v.evidence.get("fit_note_values", {})) for x in ids]


def _fit(r: set[VerdictReason], kind: str, ev: dict[str, Any] | None = None) -> str:
    """What fits (reasons ``fit-*``); a fragmentation verdict says it is with the recorded settings. An estimate says
    its answer and kind; its assumptions are listed apart (:func:`assumptions`), not chained into the sentence."""
    ev = ev or {}
    if "fit-micro-batch" in r:
        return (" With the recorded settings the largest micro-batch that fits is {largest_micro_batch}."
                if kind == "fragmentation" else " The largest micro-batch that fits: {largest_micro_batch}.")
    if "fit-batch-scale" in r:
        return (" With the recorded settings {batch_scale}x the current micro-batch fits."
                if kind == "fragmentation" else " What fits: {batch_scale}x the current micro-batch.")
    if "fit-lower-bound" in r:
        return (" At least {estimated_fit} fits: a lower bound " + _estimated_from(ev) + ", not a replay, on the "
                "assumptions listed below.")
    if "fit-estimate" in r:
        return (" About {estimated_fit} would fit: an estimate " + _estimated_from(ev) + ", not a replay, on the "
                "assumptions listed below; the fragmentation of the steps that were not recorded is not in it, so take "
                "less.")
    if "fit-not-said" in r:
        return " What fits is not said: {no_fit_reason}."
    return ""


def _fragmentation(r: set[VerdictReason], ev: dict[str, Any], kind: str) -> str:
    """An OOM where enough was free but not in one piece, with what the fix's replay says (the verdict is
    ``capacity`` where fragmentation hit first but the job does not fit without it)."""
    # a cap read off the OOM is known from below only (simulate says the range): its lower end is the room
    cap = ("a memory-fraction cap of at least {room_bytes:bytes}" if "cap-lower-end" in r
           else "the memory-fraction cap of {room_bytes:bytes}")
    if "free-split" in r:  # the fragmentation finding's bytes at stake are the reserved-but-unallocated ones
        pending, unreserved = bool(ev.get("pending_free_bytes")), bool(ev.get("unreserved_bytes"))
        split = "{reserved_unallocated_bytes:bytes} reserved but not allocated"
        if pending:
            split += ", less {pending_free_bytes:bytes} held by deferred frees" + ("," if unreserved else "")
        if unreserved:
            split += " and {unreserved_bytes:bytes} not yet reserved" + ("" if "fraction-cap" in r else " on the device")
        where = ("under " + cap + " (" + split + ")," if "fraction-cap" in r else "(" + split + ")")
    else:
        where = "under " + cap + ", cached or not yet reserved," if "fraction-cap" in r else "(cached or on the device)"
    out = ("{free_bytes:bytes} were free " + where + " for a request of {request_bytes:bytes}, but not "
           "in one piece (largest free block {largest_free_block_bytes:bytes}).")
    if "graph-pools" in r:
        out += (" {graph_pool_bytes:bytes} were reserved by CUDA graph private pools (torch.compile "
                "mode='reduce-overhead'): their free space serves only their graphs, and the allocator cannot "
                "release cached segments while a graph is being captured.")
    if "fix-simulated" in r:
        out += " Simulated with {defragmented_config}, it " + fix_outcome_template(ev)
        if "runs-out-without-it" in r:
            out += ": fragmentation hit first, but the job runs out even without it."
        elif "at-edge-without-it" in r:
            out += ": fragmentation hit first, but the job is at the edge of the GPU even without it."
        elif "kv-generation-at-capacity" in r:
            out += (": fragmentation hit first, but the KV cache grows {kv_cache_growth_per_token_bytes:bytes} per "
                    "generated token and the fix leaves {kv_room_after_fix_bytes:bytes} beyond the request and the "
                    "margin: the generation is at capacity. The cache fits {kv_cache_tokens_fit} tokens per sequence "
                    "at this batch (it holds {kv_cache_tokens} now).")
        else:
            out += "."
            if "kv-fits-with-fix" in r:
                out += (" With it the KV cache fits {kv_cache_tokens_fit} tokens per sequence at this batch "
                        "({kv_tokens_more} more than the {kv_cache_tokens} it holds).")
    return out + _fit(r, kind, ev)


def summary_template(v: Verdict) -> str:
    """The one-paragraph summary of ``v`` as a template over ``v.evidence``."""
    r, ev = set(v.reasons), v.evidence
    if "nothing-recorded" in r:
        return ("nothing recorded: the snapshot holds no segment and no event (taken before any CUDA allocation, or "
                "on a device the job did not use).")
    if "finding-decides" in r:
        return "{title}: {finding_bytes:bytes} at stake (no OOM in this trace; peak reserved {peak_reserved_bytes:bytes})."
    if "kept-across-micro-batches" in r:
        return ("out of memory after {kept_bytes:bytes} were kept across micro-batches (outputs gathered or cached, "
                "{phase} phase): the job accumulates; a larger GPU only delays it.")
    if "held-by-exception" in r:
        return ("out of memory while {kept_exception_bytes:bytes} of an earlier attempt were still allocated: the job "
                "caught the OOM at event {kept_oom_event} and ran the same code again (event {kept_retry_event}) with "
                "the exception, its traceback and the failed attempt's tensors still alive; without them the request "
                "fits.")
    if "rank-excess" in r:
        return ("out of memory on this rank, which holds {excess_bytes:bytes} more than the others: without the excess "
                "it would fit.")
    if "pending-frees" in r:
        return ("{pending_free_bytes:bytes} freed by Python were still held for other streams (record_stream) at the "
                "OOM; without them the request fits.")
    if "not-in-one-piece" in r:
        return _fragmentation(r, ev, v.kind)
    if "live-tensors-exceed-room" in r:
        out = ("the live tensors ({allocated_bytes:bytes}) plus the failed request ({request_bytes:bytes}) need "
               "{need_bytes:bytes}, {shortfall_bytes:bytes} more than the {room_bytes:bytes} the allocator could "
               "use on this GPU: no allocator setting helps.")
        if "pipeline-in-flight" in r:
            out += (" {in_flight} micro-batches were in flight, their activations awaiting their backward: the "
                    "pipeline schedule holds them at once.")
        if "kv-cache-named" in r:
            out += " The KV cache holds {kv_cache_bytes:bytes}, and grows with the batch and every generated token."
        if "oom-in-optimizer-step" in r:
            out += (" It ran out inside optimizer.step(), holding {optimizer_state_bytes:bytes} of optimizer state "
                    "beside {parameters_bytes:bytes} of parameters: the activations are freed by then, so a smaller "
                    "micro-batch does not help.")
        return out + _fit(r, v.kind, ev)
    if v.kind == "capacity" and "room-unknown" in r:
        return ("out of memory asking for {request_bytes:bytes} with {allocated_bytes:bytes} allocated; the GPU's room "
                "is unknown, so capacity cannot be told from fragmentation.")
    if "final-state-only" in r:
        out = ("final state only, without allocation history: {allocated_bytes:bytes} allocated, "
               "{reserved_bytes:bytes} reserved, no OOM recorded; record with "
               "torch.cuda.memory._record_memory_history(max_entries=100000) to see what happened.")
    else:
        opening = "no OOM; " if "material-findings" in r else NO_MATERIAL
        reserved, allocated, unknown = _peak_words(r, ev)
        if "room-known" in r:
            out = (opening + "peak reserved {peak_reserved_bytes:bytes}" + reserved
                   + " of the {room_bytes:bytes} the allocator could use on this GPU ({headroom_bytes:bytes} headroom), "
                   "peak allocated {peak_allocated_bytes:bytes}" + allocated + "." + unknown)
            if "at-edge" in r:
                out = "at the edge: " + out
                if "kv-cache-named" in r:
                    out += (" The KV cache holds {kv_cache_bytes:bytes}: it grows with the batch and with every "
                            "generated token.")
        else:
            out = (opening + "peak reserved {peak_reserved_bytes:bytes}" + reserved
                   + ", peak allocated {peak_allocated_bytes:bytes}" + allocated
                   + " (the GPU's size is not recorded)." + unknown)
    if "material-findings" in r:
        out += ONE_MATERIAL if ev.get("material_findings") == 1 else MATERIAL
    return out


def action_template(a: Action, ev: dict[str, Any]) -> str:
    """One action (:data:`oomdoctor.report.verdict.ACTIONS`) as a template over the verdict's evidence."""
    setting = ev.get("defragmented_config") or "expandable_segments:True"
    if a.id == "pipeline-schedule":
        return PIPELINE_KNOB[:1].upper() + PIPELINE_KNOB[1:] + "."
    if a.id == "optimizer-memory":
        return ("Give the optimizer less state: an 8-bit optimizer (bitsandbytes AdamW8bit) keeps Adam's two moments "
                "in a quarter of the bytes, a factored one (Adafactor) keeps row and column statistics instead of "
                "full moments, SGD with momentum one state instead of two (plain SGD none); or shard the state over "
                "more GPUs (ZeRO-1 / FSDP, DeepSpeed) or offload it to the host.")
    if a.id == "kv-cache-smaller":
        return "Make the KV cache smaller or steadier: " + literal(framework(a.framework or "generate").knobs["kv-cache"]) + "."
    if a.id == "micro-batch-at-most":
        return ("Use a per-device micro-batch of at most {largest_micro_batch} and more gradient accumulation steps to "
                "keep the global batch.")
    if a.id == "micro-batch-scale":
        return ("Cut the per-device micro-batch to {batch_scale}x the current one (give --micro-batch N to get the "
                "number) and accumulate gradients to keep the global batch.")
    if a.id == "activation-checkpointing":
        return ("Activation checkpointing frees at most {checkpointing_frees_bytes:bytes} (the activations saved for "
                "backward at the peak; recomputation adds back one layer's).")
    if a.id == "shard-optimizer":
        return ("Sharding the optimizer state over the data-parallel ranks (ZeRO-1 / FSDP) frees "
                "{sharding_frees_bytes:bytes}.")
    if a.id == "framework-activations":
        fw = framework(a.framework or "")
        return literal(f"{fw.name}: {fw.knobs['activations']}.")
    if a.id == "alloc-conf-not-simulated":
        return (ALLOC_CONF.format(setting=setting) + " so that free memory is not stranded between segments (not "
                "simulated: the allocator model cannot replay this recording).")
    if a.id == "alloc-conf-simulated":
        return ALLOC_CONF.format(setting=setting) + ": simulated, it " + fix_outcome_template(ev) + "."
    if a.id == "alloc-conf-not-enough":
        return (ALLOC_CONF.format(setting=setting) + " to stop stranding free memory; simulated, it is not enough "
                "here: lower the micro-batch too.")
    if a.id == "finding-fix":
        return literal(fix_text(a.fix)) if a.fix is not None else ""
    if a.id == "logits":
        knob = framework(a.framework).knobs["logits"] if a.framework else None
        return ("The loss's logits hold {logits_bytes:bytes} ({logits_sites}): "
                + (literal(knob) if knob else "compute the loss in chunks or fuse the LM head with the cross-entropy")
                + ".")
    raise KeyError(a.id)


def said_evidence(evidence: dict[str, Any]) -> dict[str, Any]:
    """A verdict's evidence with the ids it holds in words: the finding's title (a ``FindingTitle``) and what fits
    (:func:`.fits.verdict_evidence`); what the summary, the actions and every renderer's evidence are filled from."""
    return fits_words.verdict_evidence(verdict_evidence(evidence))


def summary(v: Verdict) -> str:
    """The summary of ``v``, filled in."""
    return fill(summary_template(v), said_evidence(v.evidence))


def actions(v: Verdict) -> list[str]:
    """What to do, in order, filled in."""
    ev = said_evidence(v.evidence)
    return [fill(action_template(a, v.evidence), ev) for a in v.to_do]
