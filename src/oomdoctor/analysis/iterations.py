"""Memory retained from step to step (for ``memory-growth``).

Steps themselves are found by :mod:`.phases` (optimizer updates, never repetitions alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..trace.model import DeviceTrace, Trace
from .lifetimes import Lifetimes
from .phases import Steps, find_phases


def find_steps(trace: Trace, dt: DeviceTrace) -> Steps | None:
    """The optimizer steps of ``dt`` (see :func:`.phases.find_phases`), or None when the trace shows none."""
    return find_phases(trace, dt).steps


@dataclass
class StepGrowth:
    """Per step: allocated bytes at its start; and bytes allocated during it that are still allocated
    at the last step start (``retained``), with the block rows behind them."""

    steps: Steps
    allocated_at_start: np.ndarray
    retained: np.ndarray
    retained_rows: list[np.ndarray]


def step_growth(lt: Lifetimes, allocated: np.ndarray, steps: Steps) -> StepGrowth:
    """Memory from step i still allocated at the start of the last step (``allocated``: the
    timeline's allocated bytes per event)."""
    starts = steps.starts
    last = int(starts[-1])
    alloc_at = allocated[np.maximum(starts - 1, 0)]
    still = lt.allocated_mask(last - 1) if last > 0 else np.zeros(len(lt), bool)
    retained: list[int] = []
    rows: list[np.ndarray] = []
    for i in range(len(starts) - 1):
        lo, hi = int(starts[i]), int(starts[i + 1])
        r = np.flatnonzero(still & (lt.alloc >= lo) & (lt.alloc < hi))
        rows.append(r)
        retained.append(int(lt.size[r].sum()))
    return StepGrowth(steps, alloc_at.astype(np.int64), np.array(retained, dtype=np.int64), rows)
