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
from ..detectors.finding import Finding, FindingTitle
from .model import Report

CHANGED_FRACTION = 0.10
SITE_MIN_DELTA_BYTES = 1 << 20
TOP_SITE_DELTAS = 15


@dataclass
class SiteDelta:
    """Bytes one site held at peak reserved, before and after (0 where absent).

    The docstring under each field (and of ``delta_bytes``) is its description in the JSON schema (``oomdoctor
    schema diff``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    label: str
    """the allocation site"""
    before_bytes: int
    """held before (bytes)"""
    after_bytes: int
    """held after (bytes)"""
    before_count: int
    """blocks before"""
    after_count: int
    """blocks after"""

    @property
    def delta_bytes(self) -> int:
        """after minus before (bytes)"""
        return self.after_bytes - self.before_bytes


@dataclass
class RankDiff:
    """One pair of ranks. Bytes; ``anatomy_*`` at each side's peak reserved.

    The docstring under each field (and of the ``*_saved_bytes`` properties) is its description in the JSON schema
    (``oomdoctor schema diff``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    rank: int
    """the rank"""
    before_path: str
    """the before snapshot"""
    after_path: str
    """the after snapshot"""
    before_peak_reserved_bytes: int
    """peak reserved before (bytes)"""
    after_peak_reserved_bytes: int
    """after (bytes)"""
    before_peak_allocated_bytes: int
    """peak allocated before (bytes)"""
    after_peak_allocated_bytes: int
    """after (bytes)"""
    before_oom: bool
    """the before run ran out of memory"""
    after_oom: bool
    """the after run did"""
    before_anatomy: Anatomy | None
    """before, at its peak reserved"""
    after_anatomy: Anatomy | None
    """after, at its peak reserved"""
    sites: list[SiteDelta] = field(default_factory=list)
    """the sites that grew or shrank most"""

    @property
    def peak_reserved_saved_bytes(self) -> int:
        """before minus after (negative: the after run needs more) (bytes)"""
        return self.before_peak_reserved_bytes - self.after_peak_reserved_bytes

    @property
    def peak_allocated_saved_bytes(self) -> int:
        """before minus after (bytes)"""
        return self.before_peak_allocated_bytes - self.after_peak_allocated_bytes


@dataclass
class FindingChange:
    """A finding id across the two runs. ``peak_reserved_saved_bytes`` is, for a resolved or changed finding,
    the part of its ranks' drop of peak reserved that its own bytes account for (:func:`_shares`: each rank's
    drop is shared among the findings that changed there in proportion to their own drop of bytes at stake,
    never more than that own drop; negative: grew). The shares of one rank add up to at most its drop.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema diff``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    id: str
    """the finding"""
    status: str  # one of STATUSES
    """in the after run against the before run"""
    title: FindingTitle
    """one line"""
    before_bytes: int
    """at stake before (bytes)"""
    after_bytes: int
    """at stake after (bytes)"""
    before_ranks: list[int]
    """ranks before"""
    after_ranks: list[int]
    """ranks after"""
    peak_reserved_saved_bytes: int
    """the peak reserved saved on the finding's ranks that this finding's own bytes account for (a share of each
    rank's saving, never more than it) (bytes)"""


STATUSES = ("resolved", "new", "changed", "unchanged")
"""A :class:`FindingChange`'s ``status``."""


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


def _own_change(fb: Finding | None, fa: Finding | None) -> dict[int, int]:
    """Per rank: the finding's bytes at stake before minus after (a resolved finding's after is 0)."""
    def per_rank(f: Finding | None) -> dict[int, int]:
        if f is None:
            return {}
        return {r: int(f.per_rank_bytes.get(r, f.bytes)) for r in f.ranks}

    b, a = per_rank(fb), per_rank(fa)
    return {r: b.get(r, 0) - a.get(r, 0) for r in b.keys() | a.keys()}


def _shares(changes: dict[str, dict[int, int]], saved_by_rank: dict[int, int]) -> dict[str, int]:
    """Each finding's share of the peak reserved saved: on every rank, the drop (or the growth) of peak reserved
    goes to the findings whose own bytes dropped (grew) there, in proportion to that own change, and none gets
    more than its own change. ``changes``: finding id -> rank -> own change (bytes)."""
    out = {fid: 0 for fid in changes}
    for r, saved in saved_by_rank.items():
        movers = {fid: c[r] for fid, c in changes.items() if c.get(r, 0) != 0 and (c[r] > 0) == (saved > 0)}
        total = sum(movers.values())
        if not movers or saved == 0:
            continue
        scale = min(1.0, saved / total)
        for fid, own in movers.items():
            out[fid] += int(own * scale)
    return out


def _finding_changes(before: Report, after: Report, saved_by_rank: dict[int, int]) -> list[FindingChange]:
    b = {f.id: f for f in before.findings}
    a = {f.id: f for f in after.findings}
    statuses: dict[str, str] = {}
    for fid in list(b) + [x for x in a if x not in b]:
        fb, fa = b.get(fid), a.get(fid)
        if fb is not None and fa is None:
            statuses[fid] = "resolved"
        elif fb is None:
            statuses[fid] = "new"
        elif (abs(fa.bytes - fb.bytes) > CHANGED_FRACTION * max(fb.bytes, 1)) or sorted(fa.ranks) != sorted(fb.ranks):
            statuses[fid] = "changed"
        else:
            statuses[fid] = "unchanged"
    moved = {fid: _own_change(b.get(fid), a.get(fid)) for fid, st in statuses.items() if st in ("resolved", "changed")}
    shares = _shares(moved, saved_by_rank)
    out = []
    for fid, status in statuses.items():
        fb, fa = b.get(fid), a.get(fid)
        out.append(FindingChange(fid, status, (fb or fa).title_ref(), fb.bytes if fb else 0, fa.bytes if fa else 0,
                                 list(fb.ranks) if fb else [], list(fa.ranks) if fa else [], shares.get(fid, 0)))
    order = {"resolved": 0, "new": 1, "changed": 2, "unchanged": 3}
    return sorted(out, key=lambda f: (order[f.status], -max(f.before_bytes, f.after_bytes)))


def rank_diff(b: DeviceAnalysis, a: DeviceAnalysis) -> RankDiff:
    """One rank in both runs (keyed by the before run's rank)."""
    return RankDiff(
        rank=b.rank, before_path=b.trace.path, after_path=a.trace.path,
        before_peak_reserved_bytes=b.peak_reserved[0], after_peak_reserved_bytes=a.peak_reserved[0],
        before_peak_allocated_bytes=b.peak_allocated[0], after_peak_allocated_bytes=a.peak_allocated[0],
        before_oom=bool(b.oom_events.size), after_oom=bool(a.oom_events.size),
        before_anatomy=b.anatomy_at(b.peak_reserved[1]), after_anatomy=a.anatomy_at(a.peak_reserved[1]),
        sites=site_deltas(b, a) if b.num_events and a.num_events else [])


def diff_of(ranks: list[RankDiff], notes: list[str], before_paths: list[str], after_paths: list[str],
            before_report: Report, after_report: Report) -> Diff:
    """The comparison from its rank pairs and the two runs' reports (``notes``: ranks in one run only)."""
    # findings name the ranks of the before run; with one file a side the pair is keyed by the before rank
    saved = {r.rank: r.peak_reserved_saved_bytes for r in ranks}
    return Diff(before_paths, after_paths, ranks, _finding_changes(before_report, after_report, saved), notes)


def diff_runs(before: list[DeviceAnalysis], after: list[DeviceAnalysis], before_report: Report,
              after_report: Report) -> Diff:
    """Compare two runs, each given as its analyses (one per rank) and the report built from them."""
    pairs, notes = _pair(before, after)
    return diff_of([rank_diff(b, a) for b, a in pairs], notes, [x.trace.path for x in before],
                   [x.trace.path for x in after], before_report, after_report)
