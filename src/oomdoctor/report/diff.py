"""Before/after comparison of two runs: peaks, fragmentation, findings and allocation sites.

Ranks are paired by rank number (a single file on each side is paired whatever its rank). Findings are
matched by ``id``: *resolved* (before only), *new* (after only), *changed* (bytes at stake moved by more
than :data:`CHANGED_FRACTION`, or other ranks), else *unchanged*. Sites are compared at each side's
peak reserved, over the blocks alive then (allocated, or freed and awaiting a deferred free), keyed by
their site label (``file:line in function``), so the same code lines up across runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..analysis.device import DeviceAnalysis
from ..analysis.fragmentation import Anatomy
from ..analysis.sites import group_sites, site_label
from .model import Report

CHANGED_FRACTION = 0.10
SITE_MIN_DELTA_BYTES = 1 << 20
TOP_SITE_DELTAS = 15


@dataclass
class SiteDelta:
    """Bytes one site held at peak reserved, before and after (0 where absent)."""

    label: str
    before_bytes: int
    after_bytes: int
    before_count: int
    after_count: int

    @property
    def delta_bytes(self) -> int:
        return self.after_bytes - self.before_bytes


@dataclass
class RankDiff:
    """One pair of ranks. Bytes; ``anatomy_*`` at each side's peak reserved."""

    rank: int
    before_path: str
    after_path: str
    before_peak_reserved_bytes: int
    after_peak_reserved_bytes: int
    before_peak_allocated_bytes: int
    after_peak_allocated_bytes: int
    before_oom: bool
    after_oom: bool
    before_anatomy: Anatomy | None
    after_anatomy: Anatomy | None
    sites: list[SiteDelta] = field(default_factory=list)

    @property
    def peak_reserved_saved_bytes(self) -> int:
        return self.before_peak_reserved_bytes - self.after_peak_reserved_bytes

    @property
    def peak_allocated_saved_bytes(self) -> int:
        return self.before_peak_allocated_bytes - self.after_peak_allocated_bytes


@dataclass
class FindingChange:
    """A finding id across the two runs. ``peak_reserved_saved_bytes`` is, for a resolved or changed
    finding, the drop of peak reserved summed over the ranks it concerned before (negative: grew)."""

    id: str
    status: str  # resolved | new | changed | unchanged
    title: str
    before_bytes: int
    after_bytes: int
    before_ranks: list[int]
    after_ranks: list[int]
    peak_reserved_saved_bytes: int


@dataclass
class Diff:
    before_inputs: list[str]
    after_inputs: list[str]
    ranks: list[RankDiff]
    findings: list[FindingChange]
    notes: list[str] = field(default_factory=list)

    @property
    def peak_reserved_saved_bytes(self) -> int:
        return sum(r.peak_reserved_saved_bytes for r in self.ranks)

    def by_status(self, status: str) -> list[FindingChange]:
        return [f for f in self.findings if f.status == status]


def _sites_at_peak(a: DeviceAnalysis) -> dict[str, tuple[int, int]]:
    lt = a.lifetimes
    rows = np.flatnonzero(lt.alive_mask(a.peak_reserved[1]))
    return {site_label(a.trace, s.frame): (s.bytes, s.count) for s in group_sites(a.trace, lt, rows)}


def site_deltas(before: DeviceAnalysis, after: DeviceAnalysis, limit: int = TOP_SITE_DELTAS) -> list[SiteDelta]:
    """Sites whose bytes at peak reserved moved by at least :data:`SITE_MIN_DELTA_BYTES`, largest move
    first."""
    b, a = _sites_at_peak(before), _sites_at_peak(after)
    out = []
    for label in b.keys() | a.keys():
        bb, bc = b.get(label, (0, 0))
        ab, ac = a.get(label, (0, 0))
        if abs(ab - bb) >= SITE_MIN_DELTA_BYTES:
            out.append(SiteDelta(label, bb, ab, bc, ac))
    return sorted(out, key=lambda s: (-abs(s.delta_bytes), s.label))[:limit]


def _pair(before: list[DeviceAnalysis], after: list[DeviceAnalysis]) -> tuple[list[tuple], list[str]]:
    if len(before) == 1 and len(after) == 1:
        return [(before[0], after[0])], []
    a_by = {x.rank: x for x in after}
    pairs, notes = [], []
    for b in before:
        if b.rank in a_by:
            pairs.append((b, a_by.pop(b.rank)))
        else:
            notes.append(f"rank {b.rank} is only in the before run ({b.trace.path})")
    notes += [f"rank {r} is only in the after run ({x.trace.path})" for r, x in sorted(a_by.items())]
    return pairs, notes


def _finding_changes(before: Report, after: Report, saved_by_rank: dict[int, int]) -> list[FindingChange]:
    b = {f.id: f for f in before.findings}
    a = {f.id: f for f in after.findings}
    out = []
    for fid in list(b) + [x for x in a if x not in b]:
        fb, fa = b.get(fid), a.get(fid)
        if fb is not None and fa is None:
            status = "resolved"
        elif fb is None:
            status = "new"
        elif (abs(fa.bytes - fb.bytes) > CHANGED_FRACTION * max(fb.bytes, 1)) or sorted(fa.ranks) != sorted(fb.ranks):
            status = "changed"
        else:
            status = "unchanged"
        ranks = fb.ranks if fb is not None else fa.ranks
        saved = sum(saved_by_rank.get(r, 0) for r in ranks) if status in ("resolved", "changed") else 0
        out.append(FindingChange(fid, status, (fb or fa).title, fb.bytes if fb else 0, fa.bytes if fa else 0,
                                 list(fb.ranks) if fb else [], list(fa.ranks) if fa else [], saved))
    order = {"resolved": 0, "new": 1, "changed": 2, "unchanged": 3}
    return sorted(out, key=lambda f: (order[f.status], -max(f.before_bytes, f.after_bytes)))


def diff_runs(before: list[DeviceAnalysis], after: list[DeviceAnalysis], before_report: Report,
              after_report: Report) -> Diff:
    """Compare two runs, each given as its analyses (one per rank) and the report built from them."""
    pairs, notes = _pair(before, after)
    ranks = []
    for b, a in pairs:
        ranks.append(RankDiff(
            rank=b.rank, before_path=b.trace.path, after_path=a.trace.path,
            before_peak_reserved_bytes=b.peak_reserved[0], after_peak_reserved_bytes=a.peak_reserved[0],
            before_peak_allocated_bytes=b.peak_allocated[0], after_peak_allocated_bytes=a.peak_allocated[0],
            before_oom=bool(b.oom_events.size), after_oom=bool(a.oom_events.size),
            before_anatomy=b.anatomy_at(b.peak_reserved[1]), after_anatomy=a.anatomy_at(a.peak_reserved[1]),
            sites=site_deltas(b, a) if b.num_events and a.num_events else []))
    # findings name the ranks of the before run; with one file a side the pair is keyed by the before rank
    saved = {r.rank: r.peak_reserved_saved_bytes for r in ranks}
    return Diff([x.trace.path for x in before], [x.trace.path for x in after], ranks,
                _finding_changes(before_report, after_report, saved), notes)
