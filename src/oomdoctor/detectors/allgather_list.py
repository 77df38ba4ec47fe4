"""``allgather-list``: ``all_gather`` into a Python list, then ``torch.cat`` (seed 001 tip 1, AP-05).

``ProcessGroupNCCL::allgather`` with a list of same-sized outputs gathers into a temporary flat buffer
(``newLikeFlat``, world size x input) and copies it into each list element; the user's ``torch.cat``
makes a third copy. Signature: allocations whose innermost Python frame is
``distributed_c10d.py`` in ``all_gather`` (the flat buffer). Fix: one preallocated output and
``all_gather_into_tensor`` (PR #85686, public since 1.13; named ``all_gather_single`` from about 2.13,
PR #186124).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..analysis.device import DeviceAnalysis
from ..analysis.sites import group_sites
from .common import rows_with, site_refs, stacks_matching
from .context import Context
from .finding import Evidence, Finding, Fix

ID = "allgather-list"


@dataclass(frozen=True, kw_only=True)
class AllgatherListEvidence(Evidence):
    """The evidence of an ``allgather-list`` finding."""

    FINDING: ClassVar[str] = ID

    calls: int
    """allocations of all_gather's temporary flat buffer (one per all_gather into a list)"""
    flat_buffer_bytes_total: int
    """the flat buffers' sizes added up (bytes)"""
    largest_flat_buffer_bytes: int
    """the largest flat buffer: what one preallocated output saves at once (bytes)"""
    extra_copies_per_call: int
    """copies of the gathered data each call makes beyond one: the flat buffer and torch.cat's output"""
    peak_reserved_bytes: int
    """the rank's peak reserved (bytes)"""
    peak_allocated_bytes: int
    """the rank's peak allocated (bytes)"""


EVIDENCE: tuple[type[Evidence], ...] = (AllgatherListEvidence,)
"""The evidence classes of this detector's findings."""


def detect_rank(a: DeviceAnalysis, ctx: Context) -> Finding | None:
    lt = a.lifetimes
    mask = stacks_matching(a.trace, "distributed_c10d.py", ("all_gather",), innermost_python=True)
    rows = np.flatnonzero(rows_with(mask, lt.stack) & (lt.alloc >= 0))
    if rows.size == 0:
        return None
    flat = lt.size[rows]
    evidence = AllgatherListEvidence(
        calls=int(rows.size),
        flat_buffer_bytes_total=int(flat.sum()),
        largest_flat_buffer_bytes=int(flat.max()),
        extra_copies_per_call=2,
        peak_reserved_bytes=int(a.peak_reserved[0]),
        peak_allocated_bytes=int(a.peak_allocated[0]),
    )
    fixes = [
        Fix("all-gather-into-tensor", versions=">=1.13", source="pytorch/pytorch PR #85686; DeepSpeed PR #4705",
            kind="code", setting="all_gather_into_tensor"),
        Fix("reduce-scatter-tensor", versions=">=1.13", source="pytorch/pytorch PR #85686", kind="code"),
    ]
    return Finding(ID, "medium", [a.rank], int(flat.max()), evidence, site_refs(a, group_sites(a.trace, lt, rows)),
                   fixes, per_rank_bytes={a.rank: int(flat.max())})


def detect(ctx: Context) -> list[Finding]:
    return [f for a in ctx.analyses if (f := detect_rank(a, ctx)) is not None]
