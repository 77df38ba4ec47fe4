"""The words of ``oomdoctor diff`` (:class:`oomdoctor.report.diff.Diff`): its first line, what its rank pairs' peaks
and anatomies were and what became of its findings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..format import count, format_bytes, format_signed_bytes

if TYPE_CHECKING:  # annotations only
    from ...analysis.fragmentation import Anatomy
    from ...report.diff import Diff, FindingChange, RankDiff


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


PEAKS_LEGEND = "peaks per rank; saved = before − after (negative: the after run needs more)"
"""Said above the table of peaks per rank pair."""

NO_FINDING = "No finding in either run."
"""Said where neither run has a finding."""


def oom(r: RankDiff) -> str:
    """Whether each run of the pair ran out of memory, before → after (``no → yes``)."""
    return f"{'yes' if r.before_oom else 'no'} → {'yes' if r.after_oom else 'no'}"


def anatomy_lead(r: RankDiff, side: str) -> str:
    """The lead of a side's anatomy line: the rank, the side (``before`` or ``after``) and where it was taken."""
    return f"rank {r.rank} {side:>6} at peak reserved: "


def anatomy(an: Anatomy) -> str:
    """What a side's reserved bytes were at its peak, every part named (``requested 7.49 GiB, rounding 1.20 MiB,
    ...``), so that the two sides read column by column."""
    return (f"requested {format_bytes(an.requested_bytes)}, "
            f"rounding {format_bytes(an.rounding_waste_bytes)}, pending free {format_bytes(an.pending_free_bytes)}, "
            f"free in used segments {format_bytes(an.free_in_used_segments_bytes)}, "
            f"free segments {format_bytes(an.free_segments_bytes)}")


def finding(f: FindingChange) -> str:
    """What became of a finding's bytes at stake, by its status: before and what its drop saved (resolved), after and
    on which ranks (new), before → after (and, changed, what that saved); the saving is named as another finding's
    where they hold the same blocks (``same_bytes_as``). What a drop saved is said as a part of its ranks' saving (the
    finding's share, :class:`oomdoctor.report.diff.FindingChange`), never as the ranks' whole saving, which the peaks
    table says."""
    ranks = f"rank{'s' if len(f.before_ranks) > 1 else ''} {','.join(map(str, f.before_ranks))}"
    saved = (f"the same blocks as {f.same_bytes_as}, whose saving it is" if f.same_bytes_as else
             f"of the peak reserved saved on {ranks}, its own blocks account for "
             f"{format_signed_bytes(f.peak_reserved_saved_bytes)}")
    if f.status == "resolved":
        return f"{format_bytes(f.before_bytes)} at stake before; {saved}"
    if f.status == "new":
        return (f"{format_bytes(f.after_bytes)} at stake on rank{'s' if len(f.after_ranks) > 1 else ''} "
                f"{','.join(map(str, f.after_ranks))}")
    return (f"{format_bytes(f.before_bytes)} → {format_bytes(f.after_bytes)} at stake"
            + (f"; {saved}" if f.status == "changed" else ""))


def sites_title(r: RankDiff) -> str:
    """The title above a rank pair's table of sites."""
    return f"rank {r.rank}: sites whose bytes at peak reserved moved"
