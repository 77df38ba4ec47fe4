"""Micro-batches in flight: how many forward passes hold activations that still await their backward.

A pipeline schedule runs the forwards of several micro-batches before their backwards (GPipe: all of
them; 1F1B: one per later stage, Narayanan et al. 2021, arXiv:2006.09503 §2), so a stage holds several
micro-batches' activations at once; a plain training step holds one. Read off the trace at an event, two
ways, and the larger wins:

- passes: distinct forward passes (:mod:`.phases`) with activations still allocated (a schedule whose
  micro-batches the pass finder tells apart: their forwards are separated by other work, such as
  point-to-point transfers);
- model recurrences: in the latest forward run, how many times the run's first activation made by model
  code was made again after a loss was computed, with its blocks still allocated (a GPipe run on one GPU
  is one long forward run: each micro-batch runs the whole model, from its first layer, and ends in a
  loss). The loss only separates micro-batches (``cross_entropy``, ``log_softmax``, ``nll_loss``,
  ``mse_loss`` at the exact function name); it is never counted itself: a loss computed in chunks for one
  micro-batch runs the model once, and is one micro-batch in flight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..trace.model import StackTable
from .accounting import ACTIVATIONS, Accounting
from .arrays import distinct
from .lifetimes import Lifetimes
from .phases import FORWARD_PHASE, Phases, table_roles

if TYPE_CHECKING:  # annotations only
    from .device import DeviceAnalysis

LOSS_NAMES = ("cross_entropy", "log_softmax", "nll_loss", "mse_loss", "binary_cross_entropy_with_logits")
PIPELINE_FRAMEWORKS = ("pipelining",)
"""Frameworks whose code runs a pipeline schedule (:mod:`oomdoctor.frameworks`)."""
P2P_ANNOTATIONS = ("nccl:send", "nccl:recv")
"""``record_function`` scopes ProcessGroupNCCL gives point-to-point transfers (``ProcessGroupNCCL.cpp``
``send``/``recv``, their profiling titles): a pipeline stage's activations and gradients cross ranks this way."""


def in_flight(stacks: StackTable, lt: Lifetimes, acc: Accounting, ph: Phases, k: int) -> int:
    """Micro-batches whose activations are allocated after event ``k`` (see the module doc); 0 with none.
    ``stacks``: the trace's :class:`~oomdoctor.trace.model.StackTable`."""
    return max(in_flight_parts(stacks, lt, acc, ph, k))


def in_flight_parts(stacks: StackTable, lt: Lifetimes, acc: Accounting, ph: Phases, k: int) -> tuple[int, int]:
    """The two readings of the module doc, apart: ``(passes, recurrences)``. Only the second is a schedule's own
    signature (several micro-batches' forwards, each ending in a loss, before their backwards): two passes with
    activations alive are also what a caught OOM whose exception keeps the failed pass leaves (issue 49), or any
    graph kept from an earlier batch."""
    rows = np.flatnonzero(lt.allocated_mask(k) & (acc.category == ACTIVATIONS) & (lt.alloc >= 0))
    if rows.size == 0:
        return 0, 0
    passes = int(distinct(ph.pass_of(lt.alloc[rows])).size)
    loss = {s for s, fids in enumerate(stacks.stacks)
            if fids and any(stacks.frames[f][2] in LOSS_NAMES for f in fids[:4])}
    if not loss:
        return passes, 0
    runs = ph.run_starts(FORWARD_PHASE)
    latest = rows[lt.alloc[rows] >= runs[runs <= k][-1]] if np.any(runs <= k) else rows
    latest = latest[np.argsort(lt.alloc[latest], kind="stable")]
    model = table_roles(stacks).lookup(table_roles(stacks).model, lt.stack[latest])
    if not model.any():
        return passes, 0
    first = lt.stack[latest[int(np.argmax(model))]]
    is_loss = np.isin(lt.stack[latest], list(loss))
    count, after_loss = 0, True
    for s, hit in zip(lt.stack[latest].tolist(), is_loss.tolist()):
        if s == first and after_loss:
            count, after_loss = count + 1, False
        elif hit:
            after_loss = True
    return passes, count


def schedule_evidence(a: DeviceAnalysis, recurrences: int) -> str | None:
    """What says the job of ``a`` (a :class:`~oomdoctor.analysis.device.DeviceAnalysis`) runs a pipeline schedule,
    the first that does: the sidecar's stage (``pp_rank`` / ``pipeline_stage``), a pipeline framework's code
    (:data:`PIPELINE_FRAMEWORKS`), point-to-point transfers (:data:`P2P_ANNOTATIONS`), or several micro-batches'
    forwards, each ending in a loss, in one forward run (a GPipe schedule on one GPU: ``recurrences``,
    :func:`in_flight_parts`); None: no pipeline, whatever the passes with activations alive (a caught OOM's kept
    exception leaves two: issue 49)."""
    from ..frameworks import detect_frameworks, running_files

    meta = a.trace.meta
    if meta.get("pp_rank", meta.get("pipeline_stage")) is not None:
        return "sidecar-stage"
    if any(fw.id in PIPELINE_FRAMEWORKS for fw in detect_frameworks(running_files(a.trace.stacks))):
        return "pipeline-framework"
    if any(x.name.startswith(P2P_ANNOTATIONS) for x in a.device.annotations):
        return "point-to-point"
    if recurrences >= 2:
        return "losses-in-one-forward"
    return None
