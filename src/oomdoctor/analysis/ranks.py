"""Ranks side by side: peaks, and the allocation sites whose bytes differ between ranks.

Frames are compared by text (file, line, function), since each rank's trace interns its own frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .device import DeviceAnalysis
from .sites import NO_STACK, PRE_TRACE, Site, group_sites

SiteKey = tuple[str, int, str]


@dataclass
class RankPeaks:
    rank: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    end_allocated_bytes: int


@dataclass
class SiteDelta:
    """A site's bytes on one rank minus the median over the other ranks."""

    key: SiteKey
    rank: int
    bytes: int
    others_median_bytes: int
    count: int
    site: Site

    @property
    def delta_bytes(self) -> int:
        return self.bytes - self.others_median_bytes


def peaks(analyses: list[DeviceAnalysis]) -> list[RankPeaks]:
    return [RankPeaks(a.rank, a.peak_allocated[0], a.peak_reserved[0], a.end_allocated) for a in analyses]


def _key(a: DeviceAnalysis, s: Site) -> SiteKey:
    if s.frame in (PRE_TRACE, NO_STACK):
        return ("<special>", s.frame, "")
    return a.trace.stacks.frames[s.frame]


def site_deltas(analyses: list[DeviceAnalysis], rank_index: int, at: str = "peak") -> list[SiteDelta]:
    """Sites of ``analyses[rank_index]`` holding more than on the other ranks (median), largest excess
    first; ``at`` is ``"peak"`` (each rank's own peak allocated) or ``"end"`` (the last event)."""
    per_rank: list[dict[SiteKey, Site]] = []
    for a in analyses:
        k = a.peak_allocated[1] if at == "peak" else a.end_index
        rows = np.flatnonzero(a.lifetimes.allocated_mask(k))
        per_rank.append({_key(a, s): s for s in group_sites(a.trace, a.lifetimes, rows)})
    mine = per_rank[rank_index]
    others = [p for i, p in enumerate(per_rank) if i != rank_index]
    out = []
    for key, s in mine.items():
        med = int(np.median([o[key].bytes if key in o else 0 for o in others])) if others else 0
        if s.bytes > med:
            out.append(SiteDelta(key, analyses[rank_index].rank, s.bytes, med, s.count, s))
    return sorted(out, key=lambda d: -d.delta_bytes)
