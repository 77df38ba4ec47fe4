"""A rank's facts for its :class:`~.model.RankSummary` (stage 1 of :mod:`.pipeline`, which builds the report): its
peaks, series, OOM, top sites and notes, its breakdowns (:func:`breakdowns`) and the holders at the main one
(:func:`holder_refs`)."""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from ..analysis.accounting import Breakdown
from ..analysis.device import DeviceAnalysis
from ..analysis.holders import holders_at
from ..analysis.phases import BACKWARD_PHASE, OPTIMIZER_PHASE, Phases
from ..analysis.rounding import allocation_size
from ..detectors.common import site_refs
from ..detectors.context import torch_version
from ..frameworks import detect_frameworks, running_files
from ..ids import BreakdownPoint
from .model import HolderRef, OomInfo, RankSummary, StackMatches, StackMatchStep

SERIES_POINTS = 48
TOP_SITES = 5
TOP_HOLDERS = 8


def downsample_max(values: np.ndarray, points: int = SERIES_POINTS) -> list[int]:
    """``values`` reduced to at most ``points`` buckets, each the bucket's maximum (peaks stay exact)."""
    if values.size == 0:
        return []
    if values.size <= points:
        return [int(v) for v in values]
    edges = np.linspace(0, values.size, points + 1).astype(np.int64)
    return [int(v) for v in np.maximum.reduceat(values, edges[:-1])]


def step_points(ph: Phases) -> list[tuple[int, BreakdownPoint]]:
    """Where the gradients are all there: the event before each torch optimizer's ``step`` began
    (``Optimizer.step#`` annotations), else before each run of optimizer work, else (an optimizer the
    trace cannot see) the end of each backward: ``(event, "optimizer_start" | "backward_end")``."""
    if ph.optimizer_starts is not None and ph.optimizer_starts.size:
        return [(max(int(k), 0), "optimizer_start") for k in ph.optimizer_starts.tolist()]
    runs = ph.run_starts(OPTIMIZER_PHASE)
    if runs.size:
        return [(max(int(k) - 1, 0), "optimizer_start") for k in runs.tolist()]
    bw = ph.phase == BACKWARD_PHASE
    ends = np.flatnonzero(bw & ~np.append(bw[1:], False))
    return [(int(k), "backward_end") for k in ends.tolist()]


def breakdowns(a: DeviceAnalysis) -> tuple[Breakdown | None, list[Breakdown]]:
    """The breakdown the verdict reads (at the OOM, else at the peak of allocated memory) and the
    others that matter: peak allocated, peak reserved, and every step's :func:`step_points`."""
    if a.num_events == 0:
        return None, []
    out = [a.breakdown_at(a.peak_allocated[1], "peak_allocated"), a.breakdown_at(a.peak_reserved[1], "peak_reserved")]
    main = out[0]
    if a.oom_events.size:
        main = a.breakdown_at(int(a.oom_events[-1]), "oom")
        out.insert(0, main)
    out += [a.breakdown_at(k, at) for k, at in step_points(a.phases)]
    return main, out


def holder_refs(a: DeviceAnalysis, k: int, limit: int = TOP_HOLDERS) -> list[HolderRef]:
    """The largest holders after event ``k`` with their category, phase and stack (a holder has a site's
    fields, so :func:`site_refs` names its stack and user frame; the label is the holder's own)."""
    hs = holders_at(a.trace, a.lifetimes, a.accounting, a.phases, k, limit)
    return [HolderRef(label=h.label, bytes=h.bytes, count=h.count, stack=ref.stack, user_frame=ref.user_frame,
                      category=h.category, phase=h.phase, matched_bytes=h.matched_bytes)
            for h, ref in zip(hs, site_refs(a, hs, len(hs)))]


def rank_facts(a: DeviceAnalysis) -> RankSummary:
    """The rank's facts (:func:`summarize`: peaks, series, OOM, sites, notes), its breakdowns (at the OOM or the
    peak, and the others that matter: :func:`breakdowns`) and the holders at the main one (:func:`holder_refs`);
    verdict and fits are left for stage 3 (:mod:`.decide`)."""
    r = summarize(a)
    r.breakdown, r.breakdowns = breakdowns(a)
    if r.breakdown is not None:
        r.holders = holder_refs(a, r.breakdown.event_index)
    return r


def summarize(a: DeviceAnalysis) -> RankSummary:
    """The per-rank part of the report (without verdict and fits, which need the findings)."""
    tl, dt, lt = a.timeline, a.device, a.lifetimes
    pa, pa_k = a.peak_allocated
    pr, pr_k = a.peak_reserved
    oom = None
    if a.oom_events.size:
        k = int(a.oom_events[-1])
        an = a.anatomy_at(k)
        req = int(dt.events["size"][k])
        oom = OomInfo(k, req, allocation_size(req), int(dt.events["device_free"][k]), an.reserved_bytes,
                      an.allocated_bytes, an.largest_free_block_bytes, int(dt.events["stream"][k]))
    tu = dt.events["time_us"]
    steps = a.steps if a.num_events else None
    jp = a.job_peak
    return RankSummary(
        rank=a.rank, path=a.trace.path, device=dt.device, events=a.num_events, has_history=a.trace.has_history,
        duration_us=int(tu[-1] - tu[0]) if tu.size else 0,
        peak_allocated_bytes=pa, peak_allocated_event=pa_k, peak_reserved_bytes=pr, peak_reserved_event=pr_k,
        end_allocated_bytes=a.end_allocated,
        end_reserved_bytes=dt.final_reserved_bytes, oom=oom,
        anatomy_at_peak=a.anatomy_at(pr_k),
        top_sites=site_refs(a, a.sites_at(pa_k), TOP_SITES),
        series={"reserved": downsample_max(tl.reserved), "allocated": downsample_max(tl.allocated),
                "active": downsample_max(tl.active)},
        steps=len(steps) if steps is not None else None,
        step_source=steps.source if steps is not None else None,
        truncated=lt.truncated, unmatched_frees=lt.unmatched_frees, ghost_blocks=lt.ghost_blocks,
        torch_version=torch_version(a).text,
        allocator_conf=str(a.trace.allocator_settings.get("PYTORCH_CUDA_ALLOC_CONF", "") or ""),
        warnings=list(a.trace.warnings) + _stack_notes(a) + _device_notes(a),
        trace_kind=(a.phases.kind + (", then the OOM" if a.oom_events.size else "")) if a.num_events
        else "final state only (no history)",
        frameworks=[fw.name for fw in detect_frameworks(running_files(a.trace.stacks))],
        job_peak_allocated_bytes=jp.job_peak_allocated_bytes, job_peak_reserved_bytes=jp.job_peak_reserved_bytes,
        peak_source=jp.source, allocated_peak_missed=jp.allocated_missed,
        reserved_peak_missed=jp.reserved_missed, allocated_peak_missed_material=jp.allocated_missed_material,
        reserved_peak_missed_material=jp.reserved_missed_material, alloc_retries=jp.alloc_retries,
        alloc_ooms=jp.alloc_ooms,
        alloc_retries_source=jp.counters_source if jp.alloc_retries is not None and jp.counters_source else "unknown",
        stack_matches=_stack_matches(a),
    )


NO_FREE_STACKS = ("frees carry the stack of their allocation (recorded without free stacks, context='alloc'): "
                  "where a tensor was released, and whether a segment free was empty_cache(), are not known")


NO_STACKS = "recorded without stacks (--stacks none): allocation sites cannot be named"


def _device_notes(a: DeviceAnalysis) -> list[str]:
    """The devices of the file that were not analysed, named (a process that touched several GPUs records
    each; the rank's own is the one with the most events)."""
    others = [d for d in a.trace.devices.values() if d.device != a.device.device and (d.num_events or d.segments)]
    if not others:
        return []
    listed = ", ".join(f"cuda:{d.device} ({d.num_events:,} events, {sum(s.total_size for s in d.segments):,} bytes "
                       "reserved at the end)" for d in sorted(others, key=lambda d: d.device))
    return [f"this snapshot also recorded {listed}; only cuda:{a.device.device}, the device with the most events, is "
            "analysed (oomdoctor.analysis.analyze(trace, trace.devices[i]) analyses another)"]


def _stack_matches(a: DeviceAnalysis) -> StackMatches | None:
    """The matching of steps recorded without stacks, for the analysed device (``trace.meta``)."""
    res = a.trace.meta.get("stack_matches")
    if not isinstance(res, dict):
        return None
    res = cast("dict[str, Any]", res)  # trace/stackmatch.py's record, as JSON (a sidecar's) gives it back
    if res.get("device") != a.device.device:
        return None
    steps = cast("list[Any]", res.get("steps", []))  # JSON objects, read with .get as before
    return {"matched": int(res.get("matched", 0)), "unmatched": int(res.get("unmatched", 0)),
            "steps": [StackMatchStep(step=e.get("step"), from_step=e.get("from_step"), allocations=e.get("allocations"),
                                     matched=e.get("matched"), unmatched=e.get("unmatched"))
                      for e in steps]}


def _stack_notes(a: DeviceAnalysis) -> list[str]:
    """What the report cannot say because stacks were not recorded."""
    if not a.num_events:
        return []
    recording: dict[str, Any] = a.trace.meta.get("recording") or {}
    if recording.get("stacks") == "none":
        return [NO_STACKS]
    out = [] if a.free_stacks else [NO_FREE_STACKS]
    m = _stack_matches(a)
    if m is not None:
        refs = sorted({e["from_step"] for e in m["steps"] if e["from_step"] is not None})
        out.append(f"{len(m['steps'])} steps were recorded without stacks (--stack-steps): {m['matched']} of their "
                   "allocations took the stack of the same allocation (same position, size and stream) in a "
                   f"stacked step ({', '.join(map(str, refs)) or 'none'}); {m['unmatched']} matched none and have "
                   "no site")
    return out
