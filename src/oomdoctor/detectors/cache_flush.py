"""``cache-flush``: ``empty_cache()`` churn or allocator retries (AP-08, AP-09).

Segment frees come from ``torch.cuda.empty_cache()`` (frames show ``torch/cuda/memory.py``
``empty_cache``) or from the allocator itself when ``cudaMalloc`` failed: it synchronises every stream,
frees all cached segments and retries (``release_cached_blocks``; ``num_alloc_retries``). Both cost
device-wide synchronisation and fresh ``cudaMalloc`` calls. A finding when segments are freed in
bursts that the trace then allocates again (empty_cache churn, at least two bursts), or when the
allocator had to retry (any burst without ``empty_cache`` frames, or ``num_alloc_retries > 0`` in the
sidecar's ``memory_stats``).

Without free stacks (recorded with ``context="alloc"``, oomdoctor's default, or ``"state"``), a segment
free carries the stack of the segment's allocation, so ``empty_cache`` frames cannot show. Bursts are then
told apart by ``num_alloc_retries`` (each retry frees the cache once, ``release_cached_blocks`` in
``CUDACachingAllocator.cpp`` ``malloc``) when the sidecar has it. With neither, nothing in the trace tells them apart (after an
``empty_cache()`` the next allocation also opens with a ``segment_alloc``, as a retry does): the finding
then names both causes, says why, and stays LOW. The evidence says how the bursts were classified.

Not churn, and not counted: the flush torch.compile's CUDA graph trees make before recording a graph
(``torch/_inductor/cudagraph_trees.py``: the next allocation is made by ``_record``), the burst of an OOM itself (the allocator frees its cache and retries just
before raising: the OOM's verdict covers it, and ``num_alloc_retries`` counts it once per ``oom``
entry), and bursts outside the training passes (``empty_cache()`` at setup, after the last step, as
Lightning and accelerate do at phase changes). A retry that succeeded means the job runs at the edge:
reported LOW, with no memory at stake (its cost is synchronisation time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..analysis.arrays import distinct
from ..analysis.device import DeviceAnalysis
from ..analysis.jobpeak import counters
from ..analysis.phases import BACKWARD_PHASE, EVALUATION_PHASE, FORWARD_PHASE, OPTIMIZER_PHASE
from ..trace.model import ALLOC, OOM, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP
from .common import rows_with, stacks_matching
from .context import Context
from .finding import Evidence, Finding, Fix

ID = "cache-flush"


@dataclass(frozen=True, kw_only=True)
class CacheFlushEvidence(Evidence):
    """The evidence of a ``cache-flush`` finding (every variant)."""

    FINDING: ClassVar[str] = ID
    VARIANTS: ClassVar[tuple[str, ...]] = ("churn-unknown", "empty-cache", "retries", "retries-or-gc")

    segment_free_bursts: int
    """bursts of segment frees inside the training passes (consecutive frees with no allocation between)"""
    empty_cache_bursts: int
    """of those, the bursts counted as empty_cache() calls"""
    allocator_retry_bursts: int
    """the other bursts: allocator retries (or garbage collection, without num_alloc_retries)"""
    num_alloc_retries: int
    """the allocator's own num_alloc_retries, less one per OOM (0 without memory_stats)"""
    freed_bytes: int
    """what the bursts freed (bytes)"""
    reallocated_after_bytes: int
    """segments allocated after the first burst (bytes)"""
    last_flush_event: int
    """the event index of the last segment free counted (-1: none)"""
    bursts_classified_by: str
    """what told the bursts apart: 'free stacks', 'memory_stats' or 'unknown'"""
    flush_time_us: int
    """the time the trace shows for the flushes and the cudaMalloc calls after them, an estimate (µs)"""
    cuda_malloc_calls_after: int
    """segments the allocator made after the first flush"""
    alloc_retries: int
    """the retries the finding states: num_alloc_retries where known, else the bursts no empty_cache() explains"""
    alloc_retries_source: str
    """where that count comes from: 'sidecar', 'memory_stats_file' or 'inferred from segment-free bursts'"""


EVIDENCE: tuple[type[Evidence], ...] = (CacheFlushEvidence,)
"""The evidence classes of this detector's findings."""


def detect_rank(a: DeviceAnalysis, ctx: Context) -> Finding | None:
    ev = a.device.events
    act = ev["action"]
    frees = np.flatnonzero((act == SEGMENT_FREE) | (act == SEGMENT_UNMAP))
    stats, stats_source = counters(a.trace.meta, a.device.device)  # the allocator's own, for this device
    recorded = (stats or {}).get("num_alloc_retries")  # None: the counters do not have it
    known = recorded is not None
    ooms = a.oom_events
    retries_stat = max(int(recorded or 0) - int(ooms.size), 0)
    if frees.size == 0 and retries_stat == 0:
        return None
    # bursts: consecutive segment frees with no alloc in between
    allocs_before = np.cumsum(act == ALLOC)
    burst_id = np.concatenate(([0], np.cumsum(np.diff(allocs_before[frees]) > 0))) if frees.size else frees
    keep = _training_bursts(a, frees, burst_id)
    frees, burst_id = frees[keep], burst_id[keep]
    if frees.size == 0 and retries_stat == 0:
        return None
    if frees.size:
        burst_id = np.unique(burst_id, return_inverse=True)[1]
    n_bursts = int(burst_id.max()) + 1 if frees.size else 0
    empty_bursts, classified_by = _empty_cache_bursts(a, frees, burst_id, n_bursts, retries_stat, known)
    retry_bursts = n_bursts - empty_bursts
    freed = int(ev["size"][frees].sum())
    realloc = 0
    if frees.size:  # segments created after the first flush
        later = slice(int(frees.min()) + 1, None)
        grow = (act[later] == SEGMENT_ALLOC) | (act[later] == SEGMENT_MAP)
        realloc = int(ev["size"][later][grow].sum())
    # the allocator's own count is the truth when the sidecar has it: under a memory fraction or
    # max_split_size_mb the allocator also releases cached blocks without retrying (garbage collection,
    # release_available_cached_blocks), and those bursts are no retries
    retries = retries_stat if known else retry_bursts
    churn = empty_bursts >= 2 and realloc >= 0.5 * freed
    if not churn and retries == 0:
        return None
    flush_us, mallocs = _flush_cost(a, frees, burst_id)
    evidence = CacheFlushEvidence(
        segment_free_bursts=n_bursts,
        empty_cache_bursts=empty_bursts,
        allocator_retry_bursts=retry_bursts,
        num_alloc_retries=retries_stat,
        freed_bytes=freed,
        reallocated_after_bytes=realloc,
        last_flush_event=int(frees.max()) if frees.size else -1,
        bursts_classified_by=classified_by,
        flush_time_us=flush_us,
        cuda_malloc_calls_after=mallocs,
        # the count the finding states: the allocator's own num_alloc_retries (less its OOMs) when the sidecar or a
        # memory_stats file has it, else the bursts no empty_cache() explains (retries or garbage collection)
        alloc_retries=retries,
        alloc_retries_source=stats_source if known and stats_source is not None else "inferred from segment-free bursts",
    )
    at_stake = 0  # the cost of flushing is time, not memory: no bytes are at stake
    # the wording: churn the trace cannot attribute, empty_cache() churn, PyTorch's own retry count, or bursts that
    # may be retries or the garbage collector (without num_alloc_retries: garbage_collection_threshold and
    # release_available_cached_blocks under max_split_size_mb free cached segments and allocate on as a retry does)
    variant = ("churn-unknown" if churn and classified_by == "unknown" else "empty-cache" if churn
               else "retries" if known else "retries-or-gc")
    sev = "low"
    fixes: list[Fix] = []
    if churn:
        fixes.append(Fix(
            "empty-cache-at-phase-changes", versions="all",
            source="discuss.pytorch.org/t/34232 (albanD); pytorch.org/docs/stable/notes/cuda.html#memory-management",
            kind="code"))
    if retries:
        fixes.append(Fix(
            "lower-peak-no-retries", versions="all", source="zdevito 'A guide to PyTorch's CUDA Caching Allocator'; torchtitan metrics.py",
            kind="code"))
    return Finding(ID, sev, [a.rank], at_stake, evidence, [], fixes, per_rank_bytes={a.rank: at_stake},
                   variant=variant)


def _flush_cost(a: DeviceAnalysis, frees: np.ndarray, burst_id: np.ndarray) -> tuple[int, int]:
    """Time (µs) the trace shows for the flushes: from the event before each burst to its last segment free
    (synchronising the device and the ``cudaFree`` calls), plus, for every segment the allocator made
    after the first flush, the time since the event before it (its ``cudaMalloc``); and how many such
    segments there were. An estimate read off the event clock, which also counts host work in between."""
    if frees.size == 0:
        return 0, 0
    ev = a.device.events
    t, act = ev["time_us"], ev["action"]
    n: int = t.shape[0]
    total = 0
    for b in distinct(burst_id).tolist():
        members = frees[burst_id == b]
        total += int(t[int(members.max())] - t[max(int(members.min()) - 1, 0)])
    later = np.flatnonzero(((act == SEGMENT_ALLOC) | (act == SEGMENT_MAP)) & (np.arange(n) > int(frees.min())))
    later = later[later > 0]
    total += int((t[later] - t[later - 1]).sum())
    return max(total, 0), int(later.size)


def _training_bursts(a: DeviceAnalysis, frees: np.ndarray, burst_id: np.ndarray) -> np.ndarray:
    """Mask over ``frees``: bursts inside the training passes, and not one whose next request is the
    OOM it made or the recording of a CUDA graph (graph trees flush the cache first, once per graph)."""
    if frees.size == 0:
        return np.ones(0, dtype=bool)
    act, stacks = a.device.events["action"], a.device.events["stack"]
    allocs = np.flatnonzero(act == ALLOC)
    requests = np.flatnonzero((act == ALLOC) | (act == OOM))
    j = np.searchsorted(requests, frees, side="right")
    has_next = j < requests.size
    nxt = requests[np.minimum(j, requests.size - 1)] if requests.size else frees
    record = stacks_matching(a.trace, "cudagraph_trees.py", ("_record", "record_function"))
    flush_of = has_next & ((act[nxt] == OOM) | rows_with(record, stacks[nxt]))
    keep = ~np.isin(burst_id, burst_id[flush_of])
    ph = a.phases
    if ph.pass_starts.size:
        first = int(ph.pass_starts[0])
        model = allocs[np.isin(ph.phase[allocs], (FORWARD_PHASE, BACKWARD_PHASE, OPTIMIZER_PHASE, EVALUATION_PHASE))]
        end = int(model[-1]) if model.size else a.num_events
        keep &= (frees > first) & (frees < end)
    return keep


def _empty_cache_bursts(a: DeviceAnalysis, frees: np.ndarray, burst_id: np.ndarray, n_bursts: int,
                        retries_stat: int, known: bool) -> tuple[int, str]:
    """How many bursts were ``empty_cache()`` calls, and from what: ``"free stacks"``, ``"memory_stats"``
    or ``"unknown"`` (every burst counted as a flush; see the module docstring). ``known``: whether the allocator's
    ``num_alloc_retries`` is recorded (``retries_stat``, less one per OOM)."""
    if n_bursts == 0:
        return 0, "free stacks" if a.free_stacks else "memory_stats"
    if a.free_stacks:
        empty = stacks_matching(a.trace, "torch/cuda/memory.py", ("empty_cache",))
        return len(set(burst_id[rows_with(empty, a.device.events["stack"][frees])].tolist())), "free stacks"
    if known:
        return max(n_bursts - retries_stat, 0), "memory_stats"
    return n_bursts, "unknown"


def detect(ctx: Context) -> list[Finding]:
    return [f for a in ctx.analyses if (f := detect_rank(a, ctx)) is not None]
