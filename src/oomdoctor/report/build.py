"""Building a :class:`Report` from traces: analyses, detectors, and the series the renderers draw."""

from __future__ import annotations

import numpy as np

from .. import __version__
from ..analysis.device import DeviceAnalysis, analyze
from ..analysis.rounding import allocation_size
from ..detectors.common import site_refs
from ..detectors.context import Context, torch_version
from ..detectors.registry import run_all
from ..trace.model import Trace
from .model import OomInfo, RankSummary, Report
from .predict import attach_predictions

SERIES_POINTS = 64
TOP_SITES = 5


def downsample_max(values: np.ndarray, points: int = SERIES_POINTS) -> list[int]:
    """``values`` reduced to at most ``points`` buckets, each the bucket's maximum (peaks stay exact)."""
    if values.size == 0:
        return []
    if values.size <= points:
        return [int(v) for v in values]
    edges = np.linspace(0, values.size, points + 1).astype(np.int64)
    return [int(v) for v in np.maximum.reduceat(values, edges[:-1])]


def summarize(a: DeviceAnalysis) -> RankSummary:
    """The per-rank part of the report."""
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
        warnings=list(a.trace.warnings) + _stack_notes(a),
    )


NO_FREE_STACKS = ("frees carry the stack of their allocation (recorded without free stacks, context='alloc'): "
                  "where a tensor was released, and whether a segment free was empty_cache(), are not known")


NO_STACKS = "recorded without stacks (--stacks none): allocation sites cannot be named"


def _stack_notes(a: DeviceAnalysis) -> list[str]:
    """What the report cannot say because stacks were not recorded."""
    if not a.num_events:
        return []
    if (a.trace.meta.get("recording") or {}).get("stacks") == "none":
        return [NO_STACKS]
    return [] if a.free_stacks else [NO_FREE_STACKS]


def build_report(traces: list[Trace]) -> Report:
    """Analyse every trace (its primary device), run the detectors, and assemble the report."""
    return report_of([analyze(t) for t in traces])


def report_of(analyses: list[DeviceAnalysis]) -> Report:
    """The report of analyses already made (one per rank)."""
    ctx = Context(analyses)
    findings = run_all(ctx)
    attach_predictions(findings, analyses)
    notes = []
    if any(not a.trace.has_history for a in analyses):
        notes.append("Some snapshots hold no allocation history (recorded with enabled='state'): peaks are the "
                     "final state only; record with torch.cuda.memory._record_memory_history(max_entries=100000).")
    return Report(ranks=[summarize(a) for a in analyses], findings=findings,
                  inputs=[a.trace.path for a in analyses], oomdoctor_version=__version__, notes=notes)
