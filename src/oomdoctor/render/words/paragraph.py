"""The words of the diagnosis in one paragraph (what the framework callbacks print at the end of training or after an
out-of-memory error, :func:`oomdoctor.render.text.render_paragraph`): its sentences, one a line, from the report."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..format import format_bytes, span
from . import breakdown as breakdown_words
from . import fits as fits_words
from . import verdict as verdict_words

if TYPE_CHECKING:  # annotations only
    from ...report.model import Report


def nothing(report: Report) -> str:
    """The paragraph of a report with no verdict or no rank: nothing to diagnose, in its inputs."""
    return f"oomdoctor: nothing to diagnose in {', '.join(report.inputs) or 'the recording'}"


def lines(report: Report, *, snapshot: str | None = None, holders: int = 3) -> list[str] | None:
    """The paragraph's sentences, one a line (unwrapped): the verdict, the assumptions of its estimate of what fits,
    what holds the memory on the verdict's first rank (its breakdown and ``holders`` largest holders), what fits
    there (replayed), the actions and where the ``snapshot`` is. None where the report has no verdict or no rank
    (:func:`nothing` says it)."""
    v = report.verdict
    if v is None or not report.ranks:
        return None
    by_rank = {r.rank: r for r in report.ranks}
    r = by_rank.get(v.ranks[0] if v.ranks else -1, report.ranks[0])
    many = len(v.ranks) > 1
    out = [f"oomdoctor: {v.kind.upper()} on rank{'s' if many else ''} {span(v.ranks)}. "
           f"{verdict_words.summary(v)}"]
    if verdict_words.assumptions(v):
        out.append("What fits assumes: " + " ".join(f"({i}) {a}." for i, a in
                                                     enumerate(verdict_words.assumptions(v), 1)))
    bd = r.breakdown
    if bd is not None:
        step = f"step {bd.step}, " if bd.step is not None else ""
        at = breakdown_words.at(bd)
        out.append(f"{at[:1].upper()}{at[1:]} ({step}{bd.phase} phase) rank {r.rank} had "
                   f"{format_bytes(bd.allocated_bytes)} allocated: " + ", ".join(breakdown_words.terms(bd)) + ".")
    if r.holders:
        out.append("Largest holders: " + "; ".join(
            f"{format_bytes(h.bytes)} {breakdown_words.line(h.category)} ({h.phase}) at {h.label}"
            for h in r.holders[:holders]) + ".")
    f = r.fits
    if f is not None and f.batch_scale is not None:
        mb = f" (micro-batch {f.largest_micro_batch})" if f.largest_micro_batch is not None else ""
        exp = (f", {fits_words.scale(f.expandable_batch_scale, f.expandable_at_limit)} with expandable_segments"
               if f.expandable_batch_scale is not None else "")
        out.append(f"Fits on this GPU (replayed): {fits_words.scale(f.batch_scale, f.batch_scale_at_limit)} the "
                   f"micro-batch{mb}{exp}.")
    if v.to_do:
        out.append("What to do: " + " ".join(f"({i}) {a}" for i, a in enumerate(verdict_words.actions(v), 1)))
    if snapshot:
        out.append(f"Snapshot: {snapshot} (full report: oomdoctor diagnose {snapshot}).")
    return out
