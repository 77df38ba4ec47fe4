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
from .pairing import pair_by_rank

CHANGED_FRACTION = 0.10
SITE_MIN_DELTA_BYTES = 1 << 20
TOP_SITE_DELTAS = 15


@dataclass
class SiteDelta:
    """Bytes one site held at peak reserved, before and after (0 where absent).

    The docstring under each field (and of ``saved_bytes``, ``delta_bytes``) is its description in the JSON schema (``oomdoctor
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
    def saved_bytes(self) -> int:
        """before minus after, as every saving of the diff (negative: the site holds more after) (bytes)"""
        return self.before_bytes - self.after_bytes

    @property
    def delta_bytes(self) -> int:
        """after minus before, the opposite of saved_bytes (kept for readers of schema 1.3 and before) (bytes)"""
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
    sites: list[SiteDelta] = field(default_factory=list[SiteDelta])
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
    never more than that own drop; negative: grew). The shares of one rank add up to at most its drop. Findings
    that point at the same allocation site on a rank describe the same blocks (:func:`_same_blocks`: a rank keeping
    a batch's logits is a rank imbalance, kept outputs and memory growth at once): their saving is attributed once,
    to the first of them in the report's order, and the others name it in ``same_bytes_as``.

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
    rank's saving, never more than it; 0 where same_bytes_as names the finding the saving is attributed to) (bytes)"""
    same_bytes_as: str | None = None
    """the finding of this diff whose allocation sites on a rank this one shares: the same blocks, whose saving is
    attributed to that one only (null: its own)"""


STATUSES = ("resolved", "new", "changed", "unchanged")
"""A :class:`FindingChange`'s ``status``."""


@dataclass
class Diff:
    before_inputs: list[str]
    after_inputs: list[str]
    ranks: list[RankDiff]
    findings: list[FindingChange]
    notes: list[str] = field(default_factory=list[str])

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
    out: list[SiteDelta] = []
    for label in b.keys() | a.keys():
        bb, bc = b.get(label, (0, 0))
        ab, ac = a.get(label, (0, 0))
        if abs(ab - bb) >= SITE_MIN_DELTA_BYTES:
            out.append(SiteDelta(label, bb, ab, bc, ac))
    return sorted(out, key=lambda s: (-abs(s.delta_bytes), s.label))[:limit]


def _pair(before: list[DeviceAnalysis],
          after: list[DeviceAnalysis]) -> tuple[list[tuple[DeviceAnalysis, DeviceAnalysis]], list[str]]:
    return pair_by_rank(before, after, lambda x: x.rank, lambda x: x.trace.path)


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


def _same_blocks(order: list[str], findings: dict[str, Finding]) -> dict[str, str]:
    """Per finding id of ``order``: the first id in ``order`` it shares blocks with, through any chain of findings
    that point at the same allocation site (``SiteRef.label``) on one of their ranks; itself when it shares none."""
    lead: dict[str, str] = {}
    owner: dict[tuple[int, str], str] = {}  # (rank, site) -> the lead of the first finding seen there
    for fid in order:
        f = findings[fid]
        keys = {(r, s.label) for r in f.ranks for s in f.sites}
        leads = {lead[owner[k]] for k in keys if k in owner}
        first = min(leads, key=order.index) if leads else fid
        for other in [x for x, y in lead.items() if y in leads]:
            lead[other] = first  # two groups met through this finding
        lead[fid] = first
        for k in keys:
            owner.setdefault(k, fid)
    return lead


def _finding_changes(before: Report, after: Report, saved_by_rank: dict[int, int]) -> list[FindingChange]:
    b = {f.id: f for f in before.findings}
    a = {f.id: f for f in after.findings}
    statuses: dict[str, str] = {}
    for fid in list(b) + [x for x in a if x not in b]:
        fb, fa = b.get(fid), a.get(fid)
        if fb is None:
            statuses[fid] = "new"
        elif fa is None:
            statuses[fid] = "resolved"
        elif (abs(fa.bytes - fb.bytes) > CHANGED_FRACTION * max(fb.bytes, 1)) or sorted(fa.ranks) != sorted(fb.ranks):
            statuses[fid] = "changed"
        else:
            statuses[fid] = "unchanged"
    moved = {fid: _own_change(b.get(fid), a.get(fid)) for fid, st in statuses.items() if st in ("resolved", "changed")}
    # findings on the same blocks are one change: the largest own change among them, attributed to the first
    lead = _same_blocks(list(moved), {fid: b.get(fid) or a[fid] for fid in moved})
    groups: dict[str, dict[int, int]] = {}
    for fid, change in moved.items():
        g = groups.setdefault(lead[fid], {})
        for r, c in change.items():
            g[r] = max(g.get(r, 0), c, key=abs)
    shares = _shares(groups, saved_by_rank)
    out: list[FindingChange] = []
    for fid, status in statuses.items():
        fb, fa = b.get(fid), a.get(fid)
        same = lead.get(fid, fid)
        either = fb or fa
        assert either is not None  # fid is a finding of before or of after
        out.append(FindingChange(fid, status, either.title_ref(), fb.bytes if fb else 0, fa.bytes if fa else 0,
                                 list(fb.ranks) if fb else [], list(fa.ranks) if fa else [],
                                 shares.get(fid, 0) if same == fid else 0, None if same == fid else same))
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
