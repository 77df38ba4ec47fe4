"""JSON Schemas (draft 2020-12) of every JSON output, and ``docs/json.md`` made from them.

One schema per command with JSON output (:data:`COMMANDS`): ``diagnose`` (also ``run --format json`` and the
in-job ``summary.json``), ``diff``, ``simulate``, ``plan estimate``, ``plan search``, ``plan validate``, ``fit``,
``verify``. Every
object lists its properties and admits no other (``additionalProperties: false``), except the free-form maps
named as such (a finding's ``evidence``, a verdict's ``evidence``, a prediction's ``extension``), so a field added
to an output without its description here fails the tests that validate real outputs
(``tests/unit/test_schema.py``). Every property has a description with its unit: ``*_bytes`` are bytes,
``*_us`` microseconds, ``*_s`` seconds, event indices count from 0 in the rank's trace (-1: before its first
event). Every output carries ``schema_version`` (:data:`~oomdoctor._version.SCHEMA_VERSION`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from .._version import SCHEMA_VERSION
from ..analysis.jobpeak import PEAK_SOURCES
from ..report.verdict import KINDS

DIALECT = "https://json-schema.org/draft/2020-12/schema"
Schema = dict[str, Any]

# --------------------------------------------------------------------------------------------- helpers


def _t(kind: str, d: str, **kw: Any) -> Schema:
    return {"type": kind, "description": d, **kw}


def b(d: str) -> Schema:
    """Bytes (may be negative only where the description says so)."""
    return _t("integer", d + " (bytes)")


def i(d: str, **kw: Any) -> Schema:
    return _t("integer", d, **kw)


def f(d: str) -> Schema:
    return _t("number", d)


def s(d: str, enum: tuple[str, ...] | None = None) -> Schema:
    return _t("string", d, **({"enum": list(enum)} if enum else {}))


def yes(d: str) -> Schema:
    return _t("boolean", d)


def null(x: Schema) -> Schema:
    """``x`` or ``null``."""
    out = dict(x)
    if "type" in out and isinstance(out["type"], str):
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = out["enum"] + [None]
        return out
    return {"anyOf": [x, {"type": "null"}], "description": x.get("description", "")}


def arr(items: Schema, d: str) -> Schema:
    return {"type": "array", "items": items, "description": d}


def obj(props: dict[str, Schema], d: str, optional: tuple[str, ...] = ()) -> Schema:
    """An object with exactly ``props`` (all required but ``optional``)."""
    return {"type": "object", "description": d, "properties": props,
            "required": [k for k in props if k not in optional], "additionalProperties": False}


def mapping(values: Schema, d: str) -> Schema:
    """An object whose keys are data (names, ranks), each value ``values``."""
    return {"type": "object", "description": d, "additionalProperties": values}


def free(d: str) -> Schema:
    """A free-form object: its keys depend on the rule that wrote it (documented with the rule)."""
    return {"type": "object", "description": d}


def from_dataclass(cls: type, descriptions: dict[str, str]) -> Schema:
    """The schema of ``dataclasses.asdict(cls(...))``: each field's type from its annotation (int, float, str,
    bool, ``X | None``, ``list[X]``, ``dict[str, X]``, ``tuple``, a nested dataclass), its description from
    ``descriptions`` (a field missing there raises KeyError: every field is documented).

    Raises:
        KeyError: a field of ``cls`` has no description.
    """
    hints = typing.get_type_hints(cls)
    props = {fl.name: _from_type(hints[fl.name], descriptions[fl.name], descriptions)
             for fl in dataclasses.fields(cls)}
    return obj(props, (cls.__doc__ or cls.__name__).strip().split("\n\n")[0].replace("\n", " "))


def _from_type(tp: Any, d: str, descriptions: dict[str, str]) -> Schema:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return null(_from_type(rest[0], d, descriptions))
    if origin is list:
        return arr(_from_type(args[0], "", descriptions), d)
    if origin is tuple:
        return arr(_from_type(args[0], "", descriptions), d)
    if origin is dict:
        return mapping(_from_type(args[1], "", descriptions), d)
    if dataclasses.is_dataclass(tp):
        out = from_dataclass(tp, descriptions)
        out["description"] = d
        return out
    kind = {int: "integer", float: "number", str: "string", bool: "boolean"}.get(tp)
    if kind is None:
        return {"description": d}
    out = _t(kind, d)
    if tp is float:
        out["type"] = "number"
    return out


def document(command: str, body: Schema, optional: tuple[str, ...] = ()) -> Schema:
    """The top-level schema of ``command``'s output: ``body`` (its properties all required but ``optional``)
    with ``schema_version`` and the dialect."""
    props = {"schema_version": {"const": SCHEMA_VERSION,
                                "description": "the version of this shape (major: a field removed or changed "
                                               "meaning; minor: fields added)"},
             "oomdoctor_version": s("the oomdoctor version that wrote it"), **body["properties"]}
    return {"$schema": DIALECT, "$id": f"urn:oomdoctor:schema:{command.replace(' ', '-')}:{SCHEMA_VERSION}",
            "title": f"oomdoctor {command} --format json", **obj(props, body["description"], optional)}


# ------------------------------------------------------------------------------------------ diagnose

VERDICT_KINDS = KINDS
SEVERITIES = ("critical", "high", "medium", "low", "info")
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "communication", "outputs",
              "kv_cache", "workspaces", "weight_copy", "unknown", "rounding")
REACHES = ("complete", "recorded", "step-completed", "step-ran-out")


def _pool_props(whole: bool) -> dict[str, Schema]:
    scope = "the device" if whole else "this group"
    return {
        "pool_id": arr(i(""), "the memory pool: [0, 0] is the default pool, others are CUDA graph private pools"
                              + (" (the whole device: the first group's)" if whole else "")),
        "segment_type": s("'small' (blocks up to 1 MiB) or 'large' segments" + (" (the first group's)" if whole
                                                                                  else "")),
        "stream": i("the CUDA stream the segments belong to" + (" (the first group's)" if whole else "")),
        "is_expandable": yes("segments are expandable (expandable_segments:True)"),
        "segments": i(f"segments in {scope}"),
        "reserved_bytes": b(f"reserved by the allocator in {scope} (cudaMalloc'd segments)"),
        "requested_bytes": b("what the live tensors asked for"),
        "rounding_waste_bytes": b("the allocator's rounding of live blocks (allocated = requested + rounding)"),
        "pending_free_bytes": b("blocks freed by Python but held for other streams (record_stream)"),
        "free_in_used_segments_bytes": b("free blocks inside segments that also hold live blocks"),
        "free_segments_bytes": b("whole free segments (empty_cache() would return them)"),
        "largest_free_block_bytes": b("the largest free block"),
    }


def anatomy_schema(d: str) -> Schema:
    pool = obj(_pool_props(False), "one (pool, segment type, stream) group")
    props = {**_pool_props(True), "event_index": i("the event after which the state is taken (-1: trace start)"),
             "pools": arr(pool, "per group"), "unattributed_bytes": b("active blocks found in no live segment (0 on a "
                                                                     "consistent trace)"),
             "allocated_bytes": b("requested + rounding")}
    return obj(props, d + ": reserved = requested + rounding + pending frees + free in used segments + free "
                          "segments")


def site_schema(d: str, holder: bool = False) -> Schema:
    props = {"label": s("file:line function of the allocation site (the frame of user code nearest the top)"),
             "bytes": b("held by the site's live blocks"), "count": i("live blocks"),
             "stack": arr(s(""), "the allocation stack, innermost first, shortened"),
             "user_frame": null(s("the frame of user code, if any"))}
    if holder:
        props |= {"category": s("what the blocks are (accounting category)", CATEGORIES),
                  "phase": s("the phase most of the bytes were allocated in"),
                  "matched_bytes": b("of those bytes, the blocks whose stack was matched from a stacked step "
                                     "(--stack-steps), not recorded")}
    return obj(props, d)


def prediction_schema(d: str) -> Schema:
    return null(obj({
        "rank": i("the rank replayed"),
        "config": s("the allocator setting replayed (PYTORCH_ALLOC_CONF text; '' for the defaults)"),
        "deferred_frees": s("'recorded' (frees held for other streams as recorded) or 'immediate'"),
        "peak_reserved_bytes": b("the replay's peak reserved"),
        "recorded_peak_reserved_bytes": b("the recording's peak reserved"),
        "oom": null(obj({"event_index": i("the event the replay ran out of memory at"),
                         "requested_bytes": b("the request that failed")}, "the replay's OOM")),
        "recorded_oom_event_index": null(i("the recording's OOM event")),
        "capacity_bytes": null(b("the memory the replay may use (from the snapshot's OOM, sidecar or settings)")),
        "capacity_kind": s("'device' (what the GPU had) or 'fraction' (set_per_process_memory_fraction)"),
        "self_replay_exact": yes("the replay of the recorded settings reproduced the recording's segments"),
        "reach": s("how far the replay reaches: 'complete' (no OOM recorded, replayed to the end), 'recorded' "
                   "(only the recorded events, cut by the OOM), 'step-completed' / 'step-ran-out' (extended by the "
                   "rest of the step as the previous step ran it)", REACHES),
        "outcome": s("the sentence a user reads, filled in"),
        "spare_bytes": b("capacity left at the claim's peak (the extended replay's for a step that completes)"),
        "extended_peak_reserved_bytes": b("peak reserved of the replay extended by the rest of the step"),
        "extended_oom_requested_bytes": b("the request the extended replay ran out of memory on"),
        "extension": obj({"previous_step_events": arr(i(""), "[first, last] event of the previous step replayed "
                                                             "again"),
                          "appended_events": i("events appended after the recording")}, "how the trace was "
                                                                                         "extended"),
        "margin_bytes": b("the claim's margin (report/margin.py): the sum of the parts in margin, extension_bytes "
                          "only for a step extended by the previous step's events"),
        "margin": margin_schema("the margin's parts"),
        "at_edge": yes("spare_bytes is below margin_bytes: at the edge, the claim may still run out and is never "
                       "counted as a fix"),
    }, d, optional=("spare_bytes", "extended_peak_reserved_bytes", "extended_oom_requested_bytes", "extension",
                    "at_edge")))


def margin_schema(d: str) -> Schema:
    return obj({
        "step_variation_bytes": b("max - min of the per-step peak allocated and of the peak reserved over the "
                                  "complete steps (the larger)"),
        "model_error_bytes": b("the self-replay's largest reserved difference from the recording (0: exact)"),
        "extension_bytes": b("the largest rise of the peak reserved between consecutive complete steps (counted for "
                             "an extended step only)"),
        "outside_bytes": b("memory outside the caching allocator (CUDA context, NCCL, library workspaces): the GPU's "
                           "total less the room read at the OOM or dump, or given by a sidecar; 0 under a fraction "
                           "cap"),
        "unrecorded_bytes": b("the job's own peak reserved (memory_stats) above the trace's"),
    }, d)


def fix_schema() -> Schema:
    return obj({
        "text": s("what to do, for the user's PyTorch version"),
        "versions": s("the PyTorch versions the fix applies to ('all', '>=2.8', '2.1-2.7', '<2.8')"),
        "source": s("where the rule comes from: a PyTorch pull request, issue or document"),
        "kind": s("env, config, code or upgrade", ("env", "config", "code", "upgrade")),
        "setting": null(s("the environment setting to apply, when the fix is one")),
        "applies": null(yes("does it apply to the recorded PyTorch version (null: unknown)")),
        "what_if": null(mapping(s(""), "the experiment the simulator replays for it (config, deferred_frees)")),
        "prediction": prediction_schema("the simulator's replay of the fix"),
    }, "one fix")


def finding_schema() -> Schema:
    return obj({
        "id": s("the detector's stable id (deferred-free, fragmentation, output-accumulation, memory-growth, "
                "pipeline-output-cache, allgather-list, rank-imbalance, small-long-lived, cache-flush)"),
        "severity": s("after the materiality rule", SEVERITIES),
        "title": s("one line"),
        "ranks": arr(i(""), "the ranks it was found on"),
        "bytes": b("at stake: what the fix gives back at the peak or the OOM, never more than the ranks' peak "
                   "reserved"),
        "summary": s("what was seen, in numbers, filled in"),
        "evidence": free("the numbers behind it, per detector (bytes in keys ending _bytes, event indices in keys "
                         "ending _event or _index)"),
        "sites": arr(site_schema("an allocation site behind it"), "the allocation sites behind it"),
        "fixes": arr(fix_schema(), "what to do, first the one to try first"),
        "prediction": prediction_schema("the first fix's prediction"),
        "per_rank_bytes": mapping(b(""), "bytes at stake per rank (keys: rank numbers)"),
    }, "a finding")


def verdict_schema(d: str) -> Schema:
    return null(obj({
        "kind": s("the answer: what ran out of memory, or why memory is not what it should be", VERDICT_KINDS),
        "summary": s("one sentence, filled in"),
        "bytes": b("the bytes that decide it (the shortfall, the free memory, the bytes kept, ...)"),
        "ranks": arr(i(""), "the ranks it concerns"),
        "headroom_bytes": null(b("room left at the peak of reserved memory, the job's own when PyTorch's counters "
                                 "say it (see the rank's peak_source) (null: the GPU's size is unknown or the rank "
                                 "ran out of memory)")),
        "finding": null(s("the id of the finding behind it")),
        "evidence": free("the numbers behind it (keys ending _bytes are bytes)"),
        "actions": arr(s(""), "what to do, in order, filled in"),
    }, d))


def breakdown_schema(d: str) -> Schema:
    return obj({
        "at": s("the moment: the OOM, the peaks, or where each optimizer step began (or each backward ended)",
                ("oom", "peak_allocated", "peak_reserved", "optimizer_start", "backward_end")),
        "event_index": i("the event after which the live blocks are counted"),
        "step": null(i("the training step (from 0) of that event")),
        "phase": s("the phase of that event (setup, forward, backward, optimizer, evaluation, generation, other)"),
        "phase_source": s("what set the phase: markers, annotations, autograd engine thread, frames or inferred"),
        "categories": mapping(b(""), "requested bytes per category (" + ", ".join(CATEGORIES[:-1]) + ") and the "
                                     "allocator's 'rounding'; they add up to allocated_bytes"),
        "sources": mapping(s("", ("recorded", "trace")), "per category: from what the job recorded (the sidecar's "
                                                          "storages) or read from the trace"),
        "counts": mapping(i(""), "live blocks per category"),
        "allocated_bytes": b("allocated after that event (requested + rounding)"),
        "unknown_why": mapping(b(""), "the unknown bytes by why no signal placed them: before_trace_no_stack (born "
                                      "before the trace, no allocation stack survives), before_trace (born before "
                                      "it, its stack places nothing), in_trace; they add up to categories.unknown"),
    }, d)


def fits_schema() -> Schema:
    return obj({
        "room_bytes": null(b("what the allocator could use on this GPU")),
        "room_source": s("where the room comes from (the OOM message, the sidecar's device size, a memory "
                         "fraction)"),
        "batch_scale": null(f("the largest multiple of the recorded micro-batch whose replay fits (recorded "
                              "settings)")),
        "largest_micro_batch": null(i("the largest whole micro-batch that fits, replayed (when the micro-batch is "
                                      "known)")),
        "micro_batch": null(i("the recorded per-device micro-batch")),
        "expandable_batch_scale": null(f("the same with expandable_segments:True")),
        "expandable_largest_micro_batch": null(i("the same with expandable_segments:True")),
        "batch_scaled_bytes_at_peak": b("bytes at the peak that grow with the micro-batch"),
        "margin_bytes": b("kept free in the replay: the prediction margin (margin) plus the rounding of the blocks "
                          "that grow, and on a trace cut by its OOM the state still to come"),
        "margin": mapping(b(""), "the prediction margin's parts (report/margin.py; the keys of a prediction's "
                                 "margin; all but extension_bytes are in margin_bytes), empty where no replay was "
                                 "tried"),
        "checkpointing_frees_at_most_bytes": b("activations saved for backward at the peak (what activation "
                                               "checkpointing frees at most)"),
        "sharding_optimizer_frees_bytes": b("what sharding the optimizer state over the data-parallel ranks frees"),
        "replays": i("allocator replays run to find the answer"),
        "notes": arr(s(""), "why an answer is missing, or what it assumes"),
        "batch_scale_at_limit": yes("the search stopped at its upper limit: at least batch_scale fits"),
        "expandable_at_limit": yes("the same for the expandable search"),
        "estimated_batch_scale": null(f("an estimate, not a replay (a trace cut in its first forward pass)")),
        "estimated_largest_micro_batch": null(i("the estimate as a whole micro-batch")),
        "assumptions": arr(s(""), "what the estimate assumes"),
        "job_peak_reserved_bytes": null(b("the job's own peak reserved the answer is held to (see the rank's)")),
        "peak_source": s("where that peak comes from (see the rank's peak_source)", PEAK_SOURCES),
        "job_peak_scale_bound": null(f("where the recorded window missed the job's peak (reserved or allocated): "
                                       "the largest multiple of the micro-batch that peak allows, taking the job's "
                                       "bytes above the window's fixed ones to grow with the micro-batch; batch "
                                       "scales above it are cut to it")),
    }, "what fits on this rank's GPU")


def rank_schema() -> Schema:
    oom = obj({"event_index": i("the OOM event"), "requested_bytes": b("the request that failed"),
               "cuda_malloc_bytes": b("the rounded size the allocator tried to cudaMalloc"),
               "device_free_bytes": b("what CUDA said was free on the device then"),
               "reserved_bytes": b("reserved then"), "allocated_bytes": b("allocated then"),
               "largest_free_block_bytes": b("the largest cached free block then"),
               "stream": i("the request's CUDA stream")}, "the last OOM of the rank")
    return obj({
        "rank": i("the rank"), "path": s("the snapshot file"), "device": i("the CUDA device index analysed"),
        "events": i("trace events"), "has_history": yes("the snapshot has an allocation history (not state only)"),
        "duration_us": i("from the first to the last event (µs)"),
        "peak_allocated_bytes": b("peak allocated over the trace"), "peak_allocated_event": i("its event"),
        "peak_reserved_bytes": b("peak reserved over the trace"), "peak_reserved_event": i("its event"),
        "end_allocated_bytes": b("allocated at the end"), "end_reserved_bytes": b("reserved at the end"),
        "oom": null(oom),
        "anatomy_at_peak": null(anatomy_schema("the state after the peak of reserved memory")),
        "top_sites": arr(site_schema("an allocation site"), "the largest allocation sites at the peak allocated"),
        "series": mapping(arr(b(""), ""), "reserved, allocated and active bytes over the trace, downsampled to at "
                                          "most 48 points, each its bucket's maximum"),
        "steps": null(i("training steps seen")), "step_source": null(s("what the steps were found from")),
        "truncated": yes("the ring buffer wrapped: the trace starts mid-job"),
        "unmatched_frees": i("frees of blocks allocated before the trace"),
        "ghost_blocks": i("blocks alive at the end that no event explains"),
        "torch_version": s("PyTorch's version, or its lower bound read off the snapshot's fields"),
        "allocator_conf": s("PYTORCH_CUDA_ALLOC_CONF as recorded"),
        "warnings": arr(s(""), "what the snapshot cannot tell"),
        "trace_kind": s("what the trace holds, in words"),
        "verdict": verdict_schema("this rank's verdict"),
        "breakdown": null(breakdown_schema("what holds the memory at the OOM, else at the peak allocated")),
        "breakdowns": arr(breakdown_schema("a breakdown"), "the same at the peaks and every step point"),
        "holders": arr(site_schema("a holder", holder=True), "the largest holders at the breakdown's event"),
        "fits": null(fits_schema()),
        "frameworks": arr(s(""), "frameworks seen in the stacks (transformers, accelerate, DeepSpeed, ...)"),
        "job_peak_allocated_bytes": null(b("the job's own peak allocated: torch.cuda.memory_stats() "
                                           "allocated_bytes.all.peak at the dump (sidecar or memory_stats file), or "
                                           "the trace's when it saw the job from its first allocation; at least "
                                           "peak_allocated_bytes; null when not known (peak_source "
                                           "unknown-before-window)")),
        "job_peak_reserved_bytes": null(b("the same for reserved_bytes.all.peak")),
        "peak_source": s("where the job's peaks come from: the sidecar's counters, a memory_stats JSON beside the "
                         "snapshot, the trace itself (it starts with nothing allocated), or not known (the trace "
                         "starts mid-job and nothing holds the counters)", PEAK_SOURCES),
        "allocated_peak_missed": yes("the job's peak allocated is above the recorded window's by more than 2 MiB: "
                                     "the ring buffer dropped it"),
        "reserved_peak_missed": yes("the same for the peak reserved"),
        "alloc_retries": null(i("the allocator's own num_alloc_retries (cudaMalloc failed, cache freed, retried; an "
                                "OOM counts one too), since the process started (count)")),
        "alloc_ooms": null(i("the allocator's own num_ooms since the process started (count)")),
        "alloc_retries_source": s("where alloc_retries comes from", ("sidecar", "memory_stats_file", "unknown")),
        "stack_matches": null(obj({
            "matched": i("allocations of stack-less steps that took a stacked step's stack"),
            "unmatched": i("allocations of stack-less steps that matched none (no site)"),
            "steps": arr(obj({"step": i("the step recorded without stacks (from 0)"),
                              "from_step": null(i("the stacked step it was matched against")),
                              "allocations": i("its allocations in the trace"),
                              "matched": i("those that took a stack"),
                              "unmatched": i("those after the first difference (no site)")}, "a stack-less step"),
                "the steps recorded without stacks")}, "steps recorded without stacks (--stack-steps) and what was "
                                                       "matched; null when every step carried stacks")),
    }, "one rank (one device of one snapshot file)")


def diagnose_schema() -> Schema:
    return document("diagnose", obj({
        "verdict": verdict_schema("the job's verdict: its worst rank's (ranks that ran out of memory first)"),
        "inputs": arr(s(""), "the snapshot files read"),
        "ranks": arr(rank_schema(), "every rank, by rank"),
        "findings": arr(finding_schema(), "ranked: severity, then bytes at stake"),
        "notes": arr(s(""), "about the whole job"),
        "materiality": obj({"fraction": f("of peak reserved"), "min_bytes": b("floor")},
                           "the rule: findings under max(fraction x peak reserved, min_bytes) are LOW"),
        "groups": obj({
            "groups": arr(obj({
                "ranks": arr(i("a rank"), "the ranks of the group, sorted"),
                "verdict": s("their verdict's kind"),
                "holders": arr(s("a holder's label"), "the labels of their largest holders, largest first"),
                "min_peak_reserved_bytes": b("the lowest peak reserved in the group"),
                "max_peak_reserved_bytes": b("the highest"),
                "odd": yes("not the job's typical (largest) group"),
                "why": arr(s("one difference"), "how it differs from the typical group"),
            }, "alike ranks: same verdict, same top holders, peaks within 1%"), "the odd groups first"),
            "min": obj({"rank": i("the rank"), "bytes": b("its peak reserved")}, "the lowest peak reserved and its rank"),
            "median": obj({"rank": i("the rank"), "bytes": b("its peak reserved")}, "the median peak reserved (lower middle) and its rank"),
            "max": obj({"rank": i("the rank"), "bytes": b("its peak reserved")}, "the highest peak reserved and its rank"),
        }, "the ranks grouped like a job"),
        "extra": obj({"in_job_summary": yes("written by the job's ranks (oomdoctor run --summarize)"),
                      "world_size": null(i("the job's ranks")),
                      "missing_ranks": arr(i(""), "ranks that sent nothing")}, "the in-job summary's"),
    }, "the diagnosis of a job's snapshots"), optional=("extra", "groups"))


# ---------------------------------------------------------------------------------------------- diff

def diff_schema() -> Schema:
    site = obj({"label": s("the allocation site"), "before_bytes": b("held before"), "after_bytes": b("held after"),
                "before_count": i("blocks before"), "after_count": i("blocks after"),
                "delta_bytes": b("after minus before")}, "an allocation site at each run's peak reserved")
    rank = obj({
        "rank": i("the rank"), "before_path": s("the before snapshot"), "after_path": s("the after snapshot"),
        "before_peak_reserved_bytes": b("peak reserved before"), "after_peak_reserved_bytes": b("after"),
        "before_peak_allocated_bytes": b("peak allocated before"), "after_peak_allocated_bytes": b("after"),
        "before_oom": yes("the before run ran out of memory"), "after_oom": yes("the after run did"),
        "before_anatomy": null(anatomy_schema("before, at its peak reserved")),
        "after_anatomy": null(anatomy_schema("after, at its peak reserved")),
        "sites": arr(site, "the sites that grew or shrank most"),
        "peak_reserved_saved_bytes": b("before minus after (negative: the after run needs more)"),
        "peak_allocated_saved_bytes": b("before minus after"),
    }, "one rank in both runs")
    finding = obj({
        "id": s("the finding"), "status": s("in the after run against the before run", ("resolved", "new", "changed", "unchanged")),
        "title": s("one line"), "before_bytes": b("at stake before"), "after_bytes": b("at stake after"),
        "before_ranks": arr(i(""), "ranks before"), "after_ranks": arr(i(""), "ranks after"),
        "peak_reserved_saved_bytes": b("the peak reserved saved on the finding's ranks that this finding's own "
                                       "bytes account for (a share of each rank's saving, never more than it)"),
    }, "a finding in either run")
    return document("diff", obj({
        "before": arr(s(""), "the before inputs"), "after": arr(s(""), "the after inputs"),
        "peak_reserved_saved_bytes": b("summed over the ranks: before minus after"),
        "ranks": arr(rank, "per rank"), "findings": arr(finding, "resolved, new, changed, unchanged"),
        "notes": arr(s(""), "notes"),
    }, "what a change did to memory"))


# ------------------------------------------------------------------------------------------ simulate

def simulate_schema() -> Schema:
    cap = obj({"limit_bytes": null(b("the memory the replay may use")),
               "kind": s("'device' (cudaMalloc fails past it) or 'fraction' (the allocator's own limit)"),
               "source": s("where it comes from, in words"),
               "certainty": s("exact, bounded or none"), "lower_bytes": null(b("lower bound")),
               "upper_bytes": null(b("upper bound")), "evidence": s("the rule that set it")}, "the capacity")
    oom = obj({"event_index": i("the event"), "requested_bytes": b("the request"),
               "alloc_size_bytes": b("the rounded size")}, "the replay's OOM")
    validation = obj({
        "segment_events_recorded": i("segment allocations and frees recorded"),
        "segment_events_simulated": i("the same, simulated"),
        "segment_events_differing": i("those that differ (0: the replay reproduces the recording)"),
        "segment_events_unmatched": i("those left unmatched once the two sequences are aligned (one missing, "
                                      "added or changed entry counts one; <= segment_events_differing)"),
        "first_differing_event": null(i("the first that differs")),
        "reserved_events_differing": i("events where reserved bytes differ"),
        "max_reserved_difference_bytes": b("the largest difference of reserved bytes"),
        "oom_event_index_recorded": null(i("the recorded OOM")),
        "oom_matches": yes("the replay runs out of memory where the recording did"),
        "segment_events_compared": i("segment events compared"),
    }, "the replay of the recorded settings against the recording")
    result = obj({
        "config": s("PYTORCH_CUDA_ALLOC_CONF ('' for the defaults)"),
        "deferred_frees": s("'recorded' or 'immediate'"),
        "peak_reserved_bytes": b("peak reserved"), "peak_allocated_bytes": b("peak allocated"),
        "end_reserved_bytes": b("reserved at the end"), "oom": null(oom),
        "matches_recorded": null(yes("for the recorded settings: the replay reproduces the recording")),
        "validation": null(validation), "initial_state": s("recorded, reallocated or empty"),
        "events_replayed": i("events replayed"), "num_alloc_retries": i("allocations that freed cache and retried"),
        "segment_events": i("segment allocations and frees in the replay"), "warnings": arr(s(""), "warnings"),
    }, "one replay")
    return document("simulate", obj({
        "path": s("the snapshot"), "rank": null(i("its rank")), "num_events": i("trace events"),
        "recorded": obj({"config": s("the recorded allocator settings"), "peak_reserved_bytes": b("recorded peak "
                                                                                                 "reserved"),
                         "peak_allocated_bytes": b("recorded peak allocated"),
                         "oom_event_index": null(i("the recorded OOM"))}, "what was recorded"),
        "capacity": cap, "has_deferred_frees": yes("frees held for other streams were recorded"),
        "results": arr(result, "results[0] replays the recorded settings and is checked against the recording"),
        "recommendation": null(obj({"config": s("the setting"), "deferred_frees": s("recorded or immediate"),
                                    "peak_reserved_bytes": b("its peak reserved"), "reason": s("why"),
                                    "incompatibilities": arr(s(""), "what it does not combine with")},
                                   "the setting --search recommends")),
        "search_wall_s": null(f("seconds the search took")), "notes": arr(s(""), "notes"),
    }, "allocator replays of one snapshot"))


# ---------------------------------------------------------------------------------------------- plan

_PLAN_FIELDS = {
    # ModelSpec
    "name": "the model's name", "num_layers": "transformer layers", "hidden_size": "hidden width",
    "ffn_hidden_size": "MLP width (per expert for MoE)", "num_heads": "attention heads",
    "num_kv_heads": "key/value heads (fewer than heads: GQA)", "vocab_size": "vocabulary",
    "tied_embeddings": "input and output embeddings shared", "gated_mlp": "SwiGLU (three matrices)",
    "bias": "linear layers have biases", "norm": "layernorm or rmsnorm",
    "learned_positions": "rows of a learned position table (GPT-2), 0 for none", "num_experts": "MoE experts",
    "experts_per_token": "experts each token is routed to", "shared_experts": "always-on experts",
    "family": "the Hugging Face model_type", "activation": "the MLP activation",
    "use_cache": "the config builds a KV cache in forward (null: what the loop leaves it at)",
    "dropout": "dropout masks are kept",
    # TrainingSpec
    "seq_len": "tokens per sequence", "global_batch": "sequences per optimizer step",
    "micro_batch": "sequences per micro-batch", "param_bytes": "bytes per weight used in the forward",
    "grad_bytes": "bytes per gradient element", "master_bytes": "bytes per fp32 master weight (0 without)",
    "optimizer_state_bytes": "optimizer state bytes per parameter (Adam: 8)",
    "fp8": "linear inputs saved in 1 byte (Transformer Engine)", "flash_attention": "no s^2 attention scores kept",
    "fused_cross_entropy": "the loss does not materialise fp32 logits",
    # ParallelPlan
    "tp": "tensor-parallel size", "pp": "pipeline-parallel size", "dp": "data-parallel size",
    "cp": "context-parallel size", "ep": "expert-parallel size", "vpp": "virtual pipeline stages per rank",
    "schedule": "the pipeline schedule (1f1b, interleaved, gpipe, zero-bubble, zbv)",
    "sequence_parallel": "Megatron sequence parallelism", "dp_sharding": "none, zero1, zero2, zero3 or fsdp",
    "recompute": "none, selective or full", "recompute_layers": "layers per stage fully recomputed (null: all)",
    "cpu_offload_optimizer": "optimizer state in CPU memory",
    "return_outputs": "torch.distributed.pipelining step(return_outputs=True)",
    "framework": "megatron or hf", "expandable_segments": "expandable_segments:True",
    "loop": "the training loop (framework hf)",
    # StageEstimate
    "stage": "the pipeline stage", "parameters": "parameters on the stage",
    "in_flight_chunks": "micro-batches whose activations the schedule holds at once",
    "terms": "bytes per term of the estimate", "gradients_persist": "gradients are kept between micro-batches",
    "allocated_bytes": "peak allocated", "reserved_bytes": "peak reserved (allocated + fragmentation)",
    "device_bytes": "reserved + CUDA context + NCCL", "peak_phase": "activations or optimizer step",
    "breakdown": "model_states, activations, logits_and_loss, other at the peak (bytes)",
    "categories": "diagnose's categories at the peak (bytes)", "loss_moment": "which moment of the loss is the peak",
}


def plan_estimate_schema() -> Schema:
    from ..plan.estimate import StageEstimate
    from ..plan.specs import ModelSpec, ParallelPlan, TrainingSpec

    stage = from_dataclass(StageEstimate, _PLAN_FIELDS)
    for k in ("allocated_bytes", "reserved_bytes", "device_bytes"):
        stage["properties"][k]["description"] += " (bytes)"
    return document("plan estimate", obj({
        "model": from_dataclass(ModelSpec, _PLAN_FIELDS), "train": from_dataclass(TrainingSpec, _PLAN_FIELDS),
        "plan": from_dataclass(ParallelPlan, _PLAN_FIELDS), "label": s("the plan in one line (TP2 PP4 DP8 ...)"),
        "microbatches": i("micro-batches per step and pipeline"), "vocab": i("the vocabulary, padded"),
        "gpu_memory_bytes": null(b("the GPU's memory")),
        "fits": null(yes("the worst stage's device bytes fit the GPU (null: no GPU given)")),
        "peak_stage": i("the stage with the most device bytes"), "stages": arr(stage, "per pipeline stage"),
    }, "memory per pipeline stage of one plan"))


def plan_search_schema() -> Schema:
    from ..plan.specs import ParallelPlan

    cand = obj({
        "label": s("the plan in one line"), "plan": from_dataclass(ParallelPlan, _PLAN_FIELDS),
        "fits": s("yes, no, or a condition under which it fits"),
        "relative_throughput": f("against the best plan (1.0)"),
        "step_time_s": obj({"compute_s": f("seconds"), "tp_comm_s": f("seconds"), "bubble_s": f("seconds"),
                            "dp_comm_s": f("seconds"), "total_s": f("seconds")}, "the modelled step time"),
        "microbatches": i("micro-batches per step"),
        "setting": s("the allocator setting the plan fits with ('' when none is needed or it does not fit)"),
        "peak_stage": i("the stage with the most device bytes, under that setting"),
        "peak_device_bytes": b("the worst stage's device bytes, under that setting"),
        "peak_allocated_bytes": b("the largest stage's allocated, under that setting"),
        "last_stage_allocated_bytes": b("the last stage's allocated, under that setting"),
        "why": arr(s(""), "what decides its rank or its fit"),
    }, "one plan")
    return document("plan search", obj({
        "model": s("the model"), "gpus": i("GPUs"), "gpu_memory_bytes": b("per GPU"),
        "rules": arr(s(""), "the decision rules, in order"), "rejected": i("plans rejected as invalid"),
        "candidates": arr(cand, "valid plans, best first"),
    }, "the parallel plans that fit"))


def plan_validate_schema() -> Schema:
    row = obj({"test_dir": s("the Megatron-LM functional test"), "golden_file": s("its golden values file"),
               "predicted_bytes": null(b("predicted peak")), "measured_bytes": null(b("measured peak")),
               "refused": null(s("why the row is not predicted"))}, "one row")
    summary = obj({"gpt_rows": i("GPT rows"), "covered": i("rows predicted"), "coverage": f("covered / GPT rows"),
                   "median_abs_rel_error": null(f("median |predicted - measured| / measured")),
                   "p90_abs_rel_error": null(f("90th percentile of the same")),
                   "floor_median_abs_rel_error": null(f("the least median error the configuration columns allow")),
                   "floor_p90_abs_rel_error": null(f("the same at the 90th percentile")),
                   "refused": mapping(i(""), "rows refused per reason")}, "the summary")
    return document("plan validate", obj({"rows": arr(row, "per CSV row"), "summary": summary},
                                         "predictions against a Megatron-LM golden-memory CSV"))


# ------------------------------------------------------------------------------------------ fit, verify


def trial_schema(d: str) -> Schema:
    return obj({
        "micro_batch": null(i("the micro-batch of this run (fit), null for verify's runs")),
        "outcome": s("how the run ended: 'ran' (exit code 0), 'oom' (non-zero exit with PyTorch's out-of-memory "
                     "message or an OOM dump), 'failed' (non-zero exit without one)", ("ran", "oom", "failed")),
        "seconds": f("wall time of the run (s)"),
        "exit_code": i("the command's exit code (negative: killed by that signal)"),
        "recorded": yes("run under recording (snapshots written)"),
        "stopped": yes("the job ended itself after the optimizer steps asked"),
        "timed_out": yes("killed at the trial time limit"),
        "measured_peak_reserved_bytes": null(b("the most reserved on any rank (memory_stats "
                                               "reserved_bytes.all.peak in the recorder's sidecars)")),
        "log": s("the file holding the run's output"),
    }, d)


def fit_schema() -> Schema:
    return document("fit", obj({
        "command": arr(s(""), "the command, with {mb} where the micro-batch goes"),
        "steps": i("optimizer steps each trial runs"),
        "low": i("the smallest micro-batch searched"), "high": i("the largest micro-batch searched"),
        "start": i("the micro-batch of the first, recorded trial"),
        "snapshot": yes("a snapshot was recorded (false: no GPU, or the job ended before using CUDA: the search is "
                        "by trials alone)"),
        "guide": s("what the search started from: the replayed answer, a lower bound of it, an estimate, or none",
                   ("replayed", "lower-bound", "estimate", "none")),
        "predicted_micro_batch": null(i("the micro-batch the replay of the recorded trial says fits")),
        "largest_micro_batch": null(i("the largest micro-batch that ran (null: none did, or the search stopped)")),
        "smallest_oom_micro_batch": null(i("the smallest micro-batch that ran out of memory")),
        "trials": arr(trial_schema("one trial"), "every trial, in the order run (the recorded one first)"),
        "trial_count": i("trials run"),
        "seconds": f("wall time of the whole search, analysis included (s)"),
        "analysis_seconds": f("wall time of the diagnosis and replays of the recorded trial (s)"),
        "error": null(s("why the search stopped short: 'failed' (a trial failed without an OOM message) or "
                        "'max-trials'")),
    }, "the largest micro-batch that runs, found with short real runs"))


def verify_schema() -> Schema:
    setting = obj({
        "config": s("the setting as given or proposed (NAME=value, or an allocator option)"),
        "env": mapping(s(""), "the environment variables the rerun had set for it"),
        "predicted_peak_reserved_bytes": null(b("the replay's peak reserved on the tightest rank")),
        "predicted_oom": null(yes("the replay ran out of memory (null: no claim)")),
        "margin_bytes": null(b("the prediction's margin: the measured peak must be within it")),
        "margin_source": null(s("'prediction' (the prediction's own margin) or 'job-spread' (the job's "
                                "step-to-step spread of its peak plus rounding)")),
        "predicted_peak_is_lower_bound": yes("replayed only up to the recorded OOM: the peak is at least the "
                                             "prediction"),
        "reach": null(s("how far the replay reaches", REACHES)),
        "predicted_rank": null(i("the rank the claim is for")),
        "measured_peak_reserved_bytes": null(b("the rerun's most reserved on any rank")),
        "oom": yes("the rerun ran out of memory"),
        "confirmed": null(yes("true: the rerun agrees with the claim; false: refuted; null: no claim, or the rerun "
                              "failed")),
        "why": s("why", ("agrees", "oom-not-predicted", "ran-but-oom-predicted", "peak-above-margin",
                         "peak-below-margin", "no-prediction", "failed")),
        "trial": trial_schema("the rerun"),
    }, "one setting's rerun against its claim")
    return document("verify", obj({
        "command": arr(s(""), "the command"),
        "steps": i("optimizer steps of the recorded baseline run"),
        "rerun_steps": i("optimizer steps of each rerun (through the step of the baseline's OOM, else steps)"),
        "snapshot": yes("the baseline recorded a snapshot (false: no claims, the settings are only rerun)"),
        "source": s("where the settings come from", ("given", "diagnosis")),
        "baseline": trial_schema("the recorded run with the settings as they are"),
        "settings": arr(setting, "each setting's rerun"),
        "seconds": f("wall time of everything (s)"),
        "refuted": i("claims the reruns refuted (the exit code is 1 when any)"),
    }, "each setting's predicted and measured peak reserved and OOM, confirmed or refuted by a rerun"))


COMMANDS = {"diagnose": diagnose_schema, "diff": diff_schema, "simulate": simulate_schema,
            "plan estimate": plan_estimate_schema, "plan search": plan_search_schema,
            "plan validate": plan_validate_schema, "fit": fit_schema, "verify": verify_schema}
"""command -> the function building its schema."""


def schema(command: str) -> Schema:
    """The JSON Schema of ``command``'s ``--format json`` output.

    Raises:
        KeyError: ``command`` has no JSON output (see :data:`COMMANDS`).
    """
    return COMMANDS[command]()


# ----------------------------------------------------------------------------------- docs/json.md


def markdown() -> str:
    """``docs/json.md``: every field of every output with its type and description (units included)."""
    out = ["# JSON outputs", "",
           "Every command with `--format json` writes one JSON object with `schema_version` "
           f"(now `{SCHEMA_VERSION}`) and `oomdoctor_version`. `oomdoctor schema COMMAND` prints its JSON Schema "
           "(draft 2020-12); the tests validate real outputs against it. Units: `*_bytes` are bytes, `*_us` "
           "microseconds, `*_s` seconds; event indices count from 0 in the rank's trace (-1: before its first event). "
           "`run --format json` and the in-job `summary.json` have `diagnose`'s shape.",
           "", "Generated from `src/oomdoctor/render/schema.py` (`python -m oomdoctor.render.schema > docs/json.md`).",
           ""]
    for command, build in COMMANDS.items():
        sch = build()
        out += [f"## `{command}`", "", sch["description"] + ".", "", "| field | type | description |",
                "|---|---|---|"]
        out += [f"| `{path}` | {kind} | {desc} |" for path, kind, desc in _rows(sch, "")]
        out.append("")
    return "\n".join(out)


def _kind(x: Schema) -> str:
    if "const" in x:
        return f"`{x['const']}`"
    if "anyOf" in x:
        return " or ".join(_kind(a) for a in x["anyOf"])
    t = x.get("type", "any")
    kinds = t if isinstance(t, list) else [t]
    names = []
    for k in kinds:
        if k == "object" and "properties" not in x and "additionalProperties" in x:
            names.append("map")
        else:
            names.append(k)
    out = " or ".join(names)
    if x.get("enum"):
        out += ": " + ", ".join(f"`{e}`" for e in x["enum"] if e is not None)
    return out


def _rows(x: Schema, path: str) -> list[tuple[str, str, str]]:
    rows = []
    if "anyOf" in x:
        x = next(a for a in x["anyOf"] if a.get("type") != "null")
    for name, p in x.get("properties", {}).items():
        here = f"{path}.{name}" if path else name
        rows.append((here, _kind(p), (p.get("description") or "").replace("|", "/")))
        inner = p if "anyOf" not in p else next(a for a in p["anyOf"] if a.get("type") != "null")
        if inner.get("type") == "array" or (isinstance(inner.get("type"), list) and "array" in inner["type"]):
            rows += _rows(inner.get("items", {}), here + "[]")
        elif "properties" in inner:
            rows += _rows(inner, here)
        elif isinstance(inner.get("additionalProperties"), dict) and "properties" in inner["additionalProperties"]:
            rows += _rows(inner["additionalProperties"], here + ".*")
    return rows


if __name__ == "__main__":
    print(markdown())
