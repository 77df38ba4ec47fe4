"""Two runs' ranks paired for a comparison (``oomdoctor diff``): the one rule both the in-process diff
(:mod:`oomdoctor.report.diff`, over analyses) and the per-rank workers (:mod:`oomdoctor.report.job`, over files)
use."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def pair_by_rank(before: list[T], after: list[T], rank: Callable[[T], int],
                 path: Callable[[T], str]) -> tuple[list[tuple[T, T]], list[str]]:
    """Pairs of (before, after) with the same ``rank``, in the before run's order; with one input a side, those two
    whatever their ranks. Also one note per rank found in one run only (the before run's first, then the after
    run's by rank), naming its file (``path``)."""
    if len(before) == 1 and len(after) == 1:
        return [(before[0], after[0])], []
    a_by = {rank(x): x for x in after}
    pairs: list[tuple[T, T]] = []
    notes: list[str] = []
    for b in before:
        if rank(b) in a_by:
            pairs.append((b, a_by.pop(rank(b))))
        else:
            notes.append(f"rank {rank(b)} is only in the before run ({path(b)})")
    notes += [f"rank {r} is only in the after run ({path(x)})" for r, x in sorted(a_by.items())]
    return pairs, notes
