"""Micro-batches in flight: how many forward passes hold activations that still await their backward.

A pipeline schedule runs the forwards of several micro-batches before their backwards (GPipe: all of
them; 1F1B: one per later stage, Narayanan et al. 2021, arXiv:2006.09503 §2), so a stage holds several
micro-batches' activations at once; a plain training step holds one. Read off the trace at an event, two
ways, and the larger wins:

- passes: distinct forward passes (:mod:`.phases`) with activations still allocated (a schedule whose
  micro-batches the pass finder tells apart: their forwards are separated by other work, such as
  point-to-point transfers);
- losses: in the latest forward run, how many times the loss was computed with its activations still
  allocated (a GPipe run on one GPU is one long forward run; its micro-batches end in one loss each). The
  loss is found by name (``cross_entropy``, ``log_softmax``, ``nll_loss``, ``mse_loss``: a name rule).
"""

from __future__ import annotations

import numpy as np

from .accounting import ACTIVATIONS, Accounting
from .lifetimes import Lifetimes
from .phases import FORWARD_PHASE, Phases

LOSS_NAMES = ("cross_entropy", "log_softmax", "nll_loss", "mse_loss", "binary_cross_entropy_with_logits")


def in_flight(stacks, lt: Lifetimes, acc: Accounting, ph: Phases, k: int) -> int:
    """Micro-batches whose activations are allocated after event ``k`` (see the module doc); 0 with none.
    ``stacks``: the trace's :class:`~oomdoctor.trace.model.StackTable`."""
    rows = np.flatnonzero(lt.allocated_mask(k) & (acc.category == ACTIVATIONS) & (lt.alloc >= 0))
    if rows.size == 0:
        return 0
    passes = int(np.unique(ph.pass_of(lt.alloc[rows])).size)
    loss = {s for s, fids in enumerate(stacks.stacks)
            if fids and any(stacks.frames[f][2] in LOSS_NAMES for f in fids[:4])}
    if not loss:
        return passes
    runs = ph.run_starts(FORWARD_PHASE)
    latest = rows[lt.alloc[rows] >= runs[runs <= k][-1]] if np.any(runs <= k) else rows
    in_loss = latest[np.isin(lt.stack[latest], list(loss))]
    if in_loss.size == 0:
        return passes
    # one loss per micro-batch: its largest block (the log-probabilities of every token) counted while alive
    big = in_loss[np.argmax(lt.requested[in_loss])]
    same = np.count_nonzero((lt.stack[in_loss] == lt.stack[big]) & (lt.requested[in_loss] == lt.requested[big]))
    return max(passes, int(same))
