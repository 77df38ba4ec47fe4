"""Who holds the memory at one event: allocation sites with their category and phase.

A *holder* is the blocks allocated after event ``k`` that share an allocation site
(:mod:`.sites`) and an accounting category (:mod:`.accounting`), largest first. Its phase is the phase
most of its bytes were allocated in. Blocks of the autograd engine's threads carry no Python frame;
with Python stacks they are named for what they are (the backward pass) instead of
"no stack recorded".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ids import BreakdownCategory
from ..trace.model import Trace
from .accounting import CATEGORIES, Accounting
from .lifetimes import IN_TRACE, Lifetimes
from .phases import BACKWARD_PHASE, PHASE_NAMES, Phases
from .sites import NO_STACK, PRE_TRACE, mark_unmatched, matched_rows, site_index, site_label

BACKWARD_LABEL = "<autograd backward: the engine's threads record no Python frames>"


@dataclass
class Holder:
    """Bytes (block sizes) and block count one site holds in one category after an event; ``stack`` is
    the stack id of its largest block (-1: none)."""

    frame: int
    label: str
    category: BreakdownCategory
    phase: str
    bytes: int
    count: int
    stack: int
    largest_block_bytes: int
    #: bytes of these blocks whose stack was matched from a stacked step (``--stack-steps``), not recorded
    matched_bytes: int = 0


def holders_at(trace: Trace, lt: Lifetimes, acc: Accounting, ph: Phases, k: int, limit: int | None = None) -> list[Holder]:
    """The holders of the blocks allocated after event ``k``, largest first (``limit``: keep that many)."""
    rows = np.flatnonzero(lt.allocated_mask(k))
    if rows.size == 0:
        return []
    idx = site_index(trace)
    site = mark_unmatched(trace, lt, rows, idx.sites_of(lt.stack[rows], lt.start_state[rows] != IN_TRACE))
    cat = acc.category[rows]
    size = lt.size[rows]
    born = acc.born_phase[rows]
    matched = np.where(matched_rows(trace, lt, rows), size, 0)
    key = site * len(CATEGORIES) + cat
    uniq, inv = np.unique(key, return_inverse=True)
    total = np.bincount(inv, weights=size).astype(np.int64)
    count = np.bincount(inv)
    out: list[Holder] = []
    for u in np.argsort(-total, kind="stable")[: limit or uniq.size].tolist():
        members = np.flatnonzero(inv == u)
        big = members[np.argmax(size[members])]
        phase_bytes = np.bincount(born[members], weights=size[members], minlength=len(PHASE_NAMES))
        phase = int(np.argmax(phase_bytes))
        frame = int(site[members[0]])
        if frame == NO_STACK and phase == BACKWARD_PHASE and ph.python_stacks:
            label = BACKWARD_LABEL
        else:
            label = site_label(trace, frame)
        out.append(Holder(frame, label, CATEGORIES[int(cat[members[0]])], PHASE_NAMES[phase], int(total[u]),
                          int(count[u]), int(lt.stack[rows[big]]), int(size[big]), int(matched[members].sum())))
    return out


__all__ = ["BACKWARD_LABEL", "Holder", "PRE_TRACE", "holders_at"]
