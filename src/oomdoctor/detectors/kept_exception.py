"""``kept-exception``: a caught out-of-memory error whose exception still holds the failed attempt's tensors while
the job runs the work again (issue 49, item 5).

A Python exception keeps its traceback, and the traceback every frame it passed through with their locals: the
failed forward's activations stay referenced for as long as the exception object lives. Python clears the name
bound by ``except ... as e`` at the end of the ``except`` clause (the language reference, "The try statement"), so
a retry written inside the clause, or an exception kept in a list or attribute, runs with the failed attempt's
memory still allocated. PyTorch's FAQ says the same ("My out of memory exception handler can't allocate memory":
move the recovery code outside the ``except`` clause).

Signature, from the trace's lifetimes and the allocator's own ``oom`` entries (no frame names): an ``oom`` entry
that events follow (the job caught it), the blocks the attempt that ran out of memory made and still held at it
(allocated since the start of its pass, :mod:`oomdoctor.analysis.phases`), and, after it, an allocation by one of
the stacks that made them (the same code run again) while some of them are still allocated: those are held by
the exception. A job that leaves the ``except`` clause before retrying frees them first and raises nothing.

Evidence: ``held_bytes`` (what the exception holds when the work runs again), ``held_at_last_oom_bytes`` (what it
still holds at the trace's last OOM, the one a verdict judges), the caught OOM's event and the retry's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..analysis.device import DeviceAnalysis
from ..analysis.sites import group_sites
from .common import site_refs
from .context import Context
from .finding import Evidence, Finding, Fix

ID = "kept-exception"
HIGH_FRACTION = 0.10
"""= :data:`oomdoctor.report.verdict.VERDICT_FRACTION`: held bytes that could decide a verdict without an OOM are
``high``; below, ``medium`` (materiality drops what is below its own floor)."""


@dataclass(frozen=True, kw_only=True)
class KeptExceptionEvidence(Evidence):
    """The evidence of a ``kept-exception`` finding."""

    FINDING: ClassVar[str] = ID

    oom_event: int
    """the event index of the caught OOM whose exception holds the most"""
    retry_event: int
    """the event index where the same code allocated again (the retry)"""
    held_bytes: int
    """what the exception holds when the work runs again (bytes)"""
    held_blocks: int
    """the blocks it holds then"""
    held_at_last_oom_bytes: int
    """what it still holds at the trace's last OOM, the one a verdict judges (bytes)"""
    caught_ooms: int
    """OOMs that events follow (the job caught them)"""
    peak_reserved_bytes: int
    """the rank's peak reserved (bytes)"""


EVIDENCE: tuple[type[Evidence], ...] = (KeptExceptionEvidence,)
"""The evidence classes of this detector's findings."""


def _held(a: DeviceAnalysis, k: int) -> tuple[np.ndarray, int] | None:
    """The rows of the blocks the attempt cut by the OOM at event ``k`` made and still held when the same code ran
    again, and the event it ran again at; None when nothing ran again or nothing was held."""
    lt, ph = a.lifetimes, a.phases
    starts = ph.pass_starts[ph.pass_starts <= k]
    start = int(starts[-1]) if starts.size else 0
    made = np.flatnonzero((lt.alloc >= start) & (lt.alloc < k) & lt.allocated_mask(k))
    if made.size == 0:
        return None
    stacks = np.unique(lt.stack[made])
    later = np.flatnonzero((lt.alloc > k) & np.isin(lt.stack, stacks))
    if later.size == 0:
        return None
    again = int(lt.alloc[later].min())
    held = made[lt.allocated_mask(again)[made]]
    return (held, again) if held.size else None


def detect_rank(a: DeviceAnalysis, ctx: Context) -> Finding | None:
    if a.oom_events.size == 0:
        return None
    lt = a.lifetimes
    last = int(a.oom_events[-1])
    best = None
    for k in a.oom_events.tolist():
        if k >= a.num_events - 1:
            continue  # the job did not go on: not caught
        got = _held(a, int(k))
        if got is not None and (best is None or lt.size[got[0]].sum() > lt.size[best[1]].sum()):
            best = (int(k), got[0], got[1])
    if best is None:
        return None
    k, held, again = best
    held_bytes = int(lt.size[held].sum())
    at_last = held[lt.allocated_mask(last)[held]] if last > again else held[:0]
    evidence = KeptExceptionEvidence(oom_event=k, retry_event=again, held_bytes=held_bytes, held_blocks=int(held.size),
                                     held_at_last_oom_bytes=int(lt.size[at_last].sum()),
                                     caught_ooms=int(np.count_nonzero(a.oom_events < a.num_events - 1)),
                                     peak_reserved_bytes=int(a.peak_reserved[0]))
    severity = "high" if held_bytes >= HIGH_FRACTION * max(int(a.peak_reserved[0]), 1) else "medium"
    fixes = [Fix("release-exception", versions="all", kind="code",
                 source="Python language reference, 'The try statement' (the except target is cleared at the end "
                        "of the clause); PyTorch FAQ, 'My out of memory exception handler can't allocate memory'")]
    return Finding(ID, severity, [a.rank], held_bytes, evidence, site_refs(a, group_sites(a.trace, lt, held)), fixes,
                   per_rank_bytes={a.rank: held_bytes})


def detect(ctx: Context) -> list[Finding]:
    return [f for a in ctx.analyses if (f := detect_rank(a, ctx)) is not None]
