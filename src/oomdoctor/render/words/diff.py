"""The words of ``oomdoctor diff`` (:class:`oomdoctor.report.diff.Diff`): its first line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..format import count, format_bytes

if TYPE_CHECKING:  # annotations only
    from ...report.diff import Diff


def headline(diff: Diff) -> str:
    """The first line of ``oomdoctor diff``: the rank whose peak reserved moved most, before → after and by how much,
    then how many rank pairs and what became of the findings."""
    out = "oomdoctor diff: "
    if diff.ranks:
        r = max(diff.ranks, key=lambda x: (abs(x.peak_reserved_saved_bytes), -x.rank))
        saved = r.peak_reserved_saved_bytes
        moved = (f"{format_bytes(saved)} less after" if saved > 0 else f"{format_bytes(-saved)} more after" if saved
                 else "unchanged")
        where = f"on rank {r.rank}" if len(diff.ranks) == 1 or saved else "on every rank"
        out += (f"peak reserved {format_bytes(r.before_peak_reserved_bytes)} → "
                f"{format_bytes(r.after_peak_reserved_bytes)} {where}, {moved}; ")
    out += count(len(diff.ranks), "rank pair")
    by = {st: sum(1 for f in diff.findings if f.status == st) for st in ("resolved", "new", "changed")}
    said = [f"{count(n, 'finding')} {st}" if i == 0 else f"{n} {st}" for i, (st, n) in
            enumerate((st, n) for st, n in by.items() if n)]
    return out + ("; " + ", ".join(said) if said else "")
