"""``cache-flush``: ``empty_cache()`` churn or allocator retries (AP-08, AP-09).

Segment frees come from ``torch.cuda.empty_cache()`` (frames show ``torch/cuda/memory.py``
``empty_cache``) or from the allocator itself when ``cudaMalloc`` failed: it synchronises every stream,
frees all cached segments and retries (``release_cached_blocks``; ``num_alloc_retries``). Both cost
device-wide synchronisation and fresh ``cudaMalloc`` calls. A finding when segments are freed in
bursts that the trace then allocates again (empty_cache churn, at least two bursts), or when the
allocator had to retry (any burst without ``empty_cache`` frames, or ``num_alloc_retries > 0`` in the
sidecar's ``memory_stats``).
"""

from __future__ import annotations

import numpy as np

from ..analysis.device import DeviceAnalysis
from ..trace.model import ALLOC, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP
from .common import rows_with, stacks_matching
from .context import Context
from .finding import Finding, Fix

ID = "cache-flush"


def detect_rank(a: DeviceAnalysis, ctx: Context) -> Finding | None:
    ev = a.device.events
    act = ev["action"]
    frees = np.flatnonzero((act == SEGMENT_FREE) | (act == SEGMENT_UNMAP))
    stats = a.trace.meta.get("memory_stats") or {}
    retries_stat = int(stats.get("num_alloc_retries", 0) or 0)
    if frees.size == 0 and retries_stat == 0:
        return None
    # bursts: consecutive segment frees with no alloc in between
    allocs_before = np.cumsum(act == ALLOC)
    burst_id = np.concatenate(([0], np.cumsum(np.diff(allocs_before[frees]) > 0))) if frees.size else frees
    empty = stacks_matching(a.trace, "torch/cuda/memory.py", ("empty_cache",))
    is_empty = rows_with(empty, ev["stack"][frees])
    n_bursts = int(burst_id.max()) + 1 if frees.size else 0
    empty_bursts = len(set(burst_id[is_empty].tolist()))
    retry_bursts = n_bursts - empty_bursts
    freed = int(ev["size"][frees].sum())
    realloc = 0
    if frees.size:  # segments created after the first flush
        later = slice(int(frees.min()) + 1, None)
        grow = (act[later] == SEGMENT_ALLOC) | (act[later] == SEGMENT_MAP)
        realloc = int(ev["size"][later][grow].sum())
    retries = max(retries_stat, retry_bursts)
    churn = empty_bursts >= 2 and realloc >= 0.5 * freed
    if not churn and retries == 0:
        return None
    evidence = {
        "segment_free_bursts": n_bursts,
        "empty_cache_bursts": empty_bursts,
        "allocator_retry_bursts": retry_bursts,
        "num_alloc_retries": retries_stat,
        "freed_bytes": freed,
        "reallocated_after_bytes": realloc,
        "last_flush_event": int(frees.max()) if frees.size else -1,
    }
    if churn:
        summary = ("empty_cache() released segments {empty_cache_bursts} times ({freed_bytes:bytes} in all) and "
                   "the trace allocated {reallocated_after_bytes:bytes} again afterwards: each call synchronises "
                   "the device and the next steps pay for fresh cudaMalloc calls.")
        title, sev = "torch.cuda.empty_cache() churn: memory released and allocated again", "medium"
    else:
        summary = ("The allocator ran out of room and had to free its cache and retry cudaMalloc "
                   "({allocator_retry_bursts} bursts of segment frees, {freed_bytes:bytes} released, "
                   "{num_alloc_retries} retries counted by memory_stats): every retry synchronises all streams. "
                   "The job runs at the edge of its memory.")
        title, sev = "Allocator retries: cached memory freed to satisfy cudaMalloc", "medium"
    fixes = [
        Fix("Call torch.cuda.empty_cache() only at phase changes (after initialisation, after evaluation), not "
            "every step; it never gives PyTorch more memory.", versions="all",
            source="discuss.pytorch.org/t/34232 (albanD); notes/cuda.md memory management", kind="code"),
        Fix("Lower the peak (activation checkpointing, a smaller micro-batch) or fix fragmentation so the "
            "allocator never has to flush and retry; watch num_alloc_retries in torch.cuda.memory_stats().",
            versions="all", source="zdevito 'A guide to PyTorch's CUDA Caching Allocator'; torchtitan metrics.py",
            kind="code"),
    ]
    return Finding(ID, sev, title, [a.rank], max(realloc, freed) if churn else freed, summary, evidence, [],
                   fixes, per_rank_bytes={a.rank: freed})


def detect(ctx: Context) -> list[Finding]:
    return [f for a in ctx.analyses if (f := detect_rank(a, ctx)) is not None]
