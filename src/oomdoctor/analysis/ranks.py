"""Ranks side by side: peaks, and the allocation sites whose bytes differ between ranks.

Each rank is reduced to a :class:`RankProfile` (its peaks and the bytes of every site holding at
least :data:`PROFILE_MIN_SITE_BYTES` at its peak and at its end), so that ranks can be compared
without their traces: in one process (``diagnose``) or after gathering the profiles of a whole job
(the in-job summary). Frames are compared by text (file, line, function), since each rank's trace
interns its own frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..units import MiB
from .device import DeviceAnalysis
from .sites import Site, group_sites

#: Sites below this at a point are left out of a profile. A site missing from a profile counts as 0
#: bytes there, so a delta is overstated by less than this; the detectors' thresholds are 16x larger.
PROFILE_MIN_SITE_BYTES = 1 * MiB


@dataclass
class SiteBytes:
    """One site's bytes at a point; ``ref`` is the detector-facing description (label, stack...)."""

    bytes: int
    count: int
    ref: Any = None


@dataclass
class RankProfile:
    """What rank comparisons need of one rank. ``group``: ranks are compared within a group
    (e.g. the same pipeline stage). Sites are keyed by ``"file:line:function"``."""

    rank: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    end_allocated_bytes: int
    group: Any = "all"
    sites_at_peak: dict[str, SiteBytes] = field(default_factory=dict[str, SiteBytes])
    sites_at_end: dict[str, SiteBytes] = field(default_factory=dict[str, SiteBytes])


@dataclass
class SiteDelta:
    """A site's bytes on one rank minus the median over the other ranks."""

    key: str
    rank: int
    bytes: int
    others_median_bytes: int
    count: int
    ref: Any

    @property
    def delta_bytes(self) -> int:
        return self.bytes - self.others_median_bytes


def site_key(a: DeviceAnalysis, s: Site) -> str:
    if s.frame < 0:  # PRE_TRACE, NO_STACK, UNMATCHED
        return f"<special>:{s.frame}"
    filename, line, name = a.trace.stacks.frames[s.frame]
    return f"{filename}:{line}:{name}"


def sites_held(a: DeviceAnalysis, at: str) -> list[Site]:
    """Sites holding at least :data:`PROFILE_MIN_SITE_BYTES` at the rank's peak allocated
    (``at="peak"``) or at its last event (``"end"``), largest first."""
    k = a.peak_allocated[1] if at == "peak" else a.end_index
    rows = np.flatnonzero(a.lifetimes.allocated_mask(k))
    return group_sites(a.trace, a.lifetimes, rows, PROFILE_MIN_SITE_BYTES)


def site_deltas(profiles: list[RankProfile], rank_index: int, at: str = "peak") -> list[SiteDelta]:
    """Sites of ``profiles[rank_index]`` holding more than on the other ranks (median), largest excess
    first; ``at`` is ``"peak"`` (each rank's own peak allocated) or ``"end"`` (the last event)."""
    per_rank = [p.sites_at_peak if at == "peak" else p.sites_at_end for p in profiles]
    mine = per_rank[rank_index]
    others = [p for i, p in enumerate(per_rank) if i != rank_index]
    out: list[SiteDelta] = []
    for key, s in mine.items():
        med = int(np.median([o[key].bytes if key in o else 0 for o in others])) if others else 0
        if s.bytes > med:
            out.append(SiteDelta(key, profiles[rank_index].rank, s.bytes, med, s.count, s.ref))
    return sorted(out, key=lambda d: -d.delta_bytes)
