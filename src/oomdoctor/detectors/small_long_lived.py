"""``small-long-lived``: many small long-lived blocks scattered through segments (seed 001 tip 3, AP-10).

Per-parameter gradients, optimizer states or cached tensors allocated one by one, at different times,
end up spread over many segments; each pins its segment, whose free space then only fits requests no
larger than the gaps, and which ``empty_cache()`` cannot release.

Signature, at the end of the trace: at least 256 blocks smaller than 10 MiB (``kMinLargeAlloc``:
requests that share 2 MiB or 20 MiB segments) alive for at least half of the trace, spread over
segments whose free bytes add up to at least 256 MiB and 10% of reserved memory.
Fix: one contiguous buffer sliced into views (Megatron's contiguous grad buffer, DeepSpeed
``contiguous_gradients``, DDP ``gradient_as_bucket_view=True``), or create long-lived state before the
first forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..analysis.arrays import distinct
from ..analysis.device import DeviceAnalysis
from ..analysis.fragmentation import live_segments
from ..analysis.rounding import K_MIN_LARGE_ALLOC
from ..analysis.sites import group_sites
from ..units import MiB
from .common import site_refs
from .context import Context
from .finding import Evidence, Finding, Fix

ID = "small-long-lived"
MIN_BLOCKS = 256
MIN_PINNED_BYTES = 256 * MiB
MIN_PINNED_FRACTION = 0.10


@dataclass(frozen=True, kw_only=True)
class SmallLongLivedEvidence(Evidence):
    """The evidence of a ``small-long-lived`` finding, at the end of the trace."""

    FINDING: ClassVar[str] = ID

    blocks: int
    """small blocks (under 10 MiB) alive for at least half of the trace"""
    bytes: int
    """their sizes added up (bytes)"""
    segments_pinned: int
    """segments those blocks sit in"""
    free_in_pinned_segments_bytes: int
    """free bytes in those segments, which empty_cache() cannot return (bytes)"""
    reserved_bytes: int
    """reserved at the end of the trace (bytes)"""


EVIDENCE: tuple[type[Evidence], ...] = (SmallLongLivedEvidence,)
"""The evidence classes of this detector's findings."""


def detect_rank(a: DeviceAnalysis, ctx: Context) -> Finding | None:
    if a.num_events == 0:
        return None
    lt, k = a.lifetimes, a.end_index
    tu = a.device.events["time_us"]
    duration = int(tu[-1] - tu[0]) or 1
    born = np.where(lt.alloc >= 0, tu[np.maximum(lt.alloc, 0)], tu[0])
    rows = np.flatnonzero(lt.allocated_mask(k) & (lt.size < K_MIN_LARGE_ALLOC) & ((tu[-1] - born) >= duration // 2))
    if rows.size < MIN_BLOCKS:
        return None
    an = a.anatomy_at(k)
    segs = live_segments(a.device, k)
    starts = np.array([s.address for s in segs], dtype=np.int64)
    si = distinct(np.searchsorted(starts, lt.addr[rows], side="right") - 1)
    pinned_segments = {int(i) for i in si if i >= 0}
    # free bytes in the segments these blocks pin, from the final state
    final = {s.address: s for s in a.device.segments}
    pinned_free = 0
    for i in pinned_segments:
        s = final.get(segs[i].address)
        if s is not None:
            pinned_free += sum(b.size for b in s.blocks if not b.is_active)
    if pinned_free < max(MIN_PINNED_BYTES, MIN_PINNED_FRACTION * an.reserved_bytes):
        return None
    evidence = SmallLongLivedEvidence(
        blocks=int(rows.size),
        bytes=int(lt.size[rows].sum()),
        segments_pinned=len(pinned_segments),
        free_in_pinned_segments_bytes=pinned_free,
        reserved_bytes=an.reserved_bytes,
    )
    fixes = [
        Fix("contiguous-buffer", versions="all", source="Megatron-LM's contiguous gradient buffer (megatron/core/distributed/param_and_grad_buffer.py)", kind="code"),
        Fix("bucket-view-gradients", versions=">=1.7", source="torch/nn/parallel/distributed.py docstring; DeepSpeed PR #1199", kind="config"),
        Fix("optimizer-state-first", versions="all", source="the allocator's best-fit reuse of freed blocks (c10/cuda/CUDACachingAllocator.cpp get_free_block)",
            kind="code"),
    ]
    return Finding(ID, "low", [a.rank], pinned_free, evidence, site_refs(a, group_sites(a.trace, lt, rows)), fixes, per_rank_bytes={a.rank: pinned_free})


def detect(ctx: Context) -> list[Finding]:
    return [f for a in ctx.analyses if (f := detect_rank(a, ctx)) is not None]
