"""Ranks grouped like a job: alike ranks collapse to one group, the odd ones come first with what makes them odd.

Two ranks are alike when they have the same verdict, the same top holders (the labels of the :data:`TOP_HOLDERS`
largest, in order) and peaks of reserved memory within :data:`PEAK_TOLERANCE` of each other (greedy, from the
lowest peak: a group holds ranks within 1% of its lowest). The largest group is the job's typical ranks; every
other group is odd, and says how it differs from the typical one (verdict, peak, holders). With one rank there is
one group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .model import RankSummary, Report

PEAK_TOLERANCE = 0.01
TOP_HOLDERS = 3


@dataclass
class RankGroup:
    """Alike ranks. ``ranks`` sorted; peaks of reserved memory (bytes) over the group; ``odd``: not the typical
    group; ``why``: how it differs from the typical group (empty for the typical one).

    The docstring under each field is its description in the JSON schema (``oomdoctor schema diagnose``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    ranks: list[int]
    """the ranks of the group, sorted"""
    verdict: str
    """their verdict's kind"""
    holders: list[str]
    """the labels of their largest holders, largest first"""
    min_peak_reserved_bytes: int
    """the lowest peak reserved in the group (bytes)"""
    max_peak_reserved_bytes: int
    """the highest peak reserved in the group (bytes)"""
    odd: bool = False
    """not the job's typical (largest) group"""
    why: list[str] = field(default_factory=list[str])
    """how it differs from the typical group"""


@dataclass
class PeakPoint:
    """A rank's peak reserved."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    rank: int
    """the rank"""
    bytes: int
    """its peak reserved (bytes)"""


@dataclass
class RankGroups:
    """``groups``: the odd groups first (largest peak first), then the typical one; ``min``/``median``/``max``: the
    peaks of reserved memory over all ranks, each with its rank (the median is the lower middle rank's)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    groups: list[RankGroup]
    """alike ranks (same verdict, same top holders, peaks within 1%), the odd groups first"""
    min: PeakPoint
    """the lowest peak reserved and its rank"""
    median: PeakPoint
    """the median peak reserved (lower middle) and its rank"""
    max: PeakPoint
    """the highest peak reserved and its rank"""


def _key(r: RankSummary) -> tuple[str, tuple[str, ...]]:
    return (r.verdict.kind if r.verdict is not None else "none", tuple(h.label for h in r.holders[:TOP_HOLDERS]))


def group_ranks(ranks: list[RankSummary]) -> RankGroups | None:
    """The groups of ``ranks`` (None without ranks)."""
    if not ranks:
        return None
    by_key: dict[tuple[str, tuple[str, ...]], list[RankSummary]] = {}
    for r in ranks:
        by_key.setdefault(_key(r), []).append(r)
    groups: list[RankGroup] = []
    for (kind, holders), rs in by_key.items():
        rs = sorted(rs, key=lambda r: (r.peak_reserved_bytes, r.rank))
        cur: list[RankSummary] = []
        for r in rs + [None]:
            if cur and (r is None or r.peak_reserved_bytes > cur[0].peak_reserved_bytes * (1 + PEAK_TOLERANCE)):
                groups.append(RankGroup(sorted(x.rank for x in cur), kind, list(holders),
                                        cur[0].peak_reserved_bytes, cur[-1].peak_reserved_bytes))
                cur = []
            if r is not None:
                cur.append(r)
    typical = max(groups, key=lambda g: (len(g.ranks), -g.ranks[0]))
    for g in groups:
        if g is typical:
            continue
        g.odd = True
        if g.verdict != typical.verdict:
            g.why.append(f"verdict {g.verdict} (the others: {typical.verdict})")
        mid = (typical.min_peak_reserved_bytes + typical.max_peak_reserved_bytes) // 2
        if abs(g.max_peak_reserved_bytes - mid) > PEAK_TOLERANCE * mid or abs(g.min_peak_reserved_bytes - mid) \
                > PEAK_TOLERANCE * mid:
            pct = (g.max_peak_reserved_bytes if g.max_peak_reserved_bytes > mid else g.min_peak_reserved_bytes) / max(mid, 1) - 1
            g.why.append(f"peak reserved {pct:+.1%} against the others")
        if g.holders != typical.holders:
            g.why.append("other top holders: " + (", ".join(g.holders) or "none"))
    groups.sort(key=lambda g: (not g.odd, -g.max_peak_reserved_bytes, g.ranks[0]))
    peaks = sorted((r.peak_reserved_bytes, r.rank) for r in ranks)

    def point(p: tuple[int, int]) -> PeakPoint:
        return PeakPoint(p[1], p[0])

    return RankGroups(groups, point(peaks[0]), point(peaks[(len(peaks) - 1) // 2]), point(peaks[-1]))


def with_groups(report: Report) -> Report:
    """``report`` with its :class:`RankGroups` set (in place; returned for chaining)."""
    report.groups = group_ranks(report.ranks)
    return report

