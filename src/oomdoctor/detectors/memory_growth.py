"""``memory-growth``: memory allocated in step i still allocated steps later, step after step (AP-13).

Steps come from :func:`oomdoctor.analysis.find_steps`. Blocks allocated in the first two steps and
kept (optimizer state created lazily at the first ``step()``, DDP's buckets rebuilt after the first
iteration) are warm-up, and so is what the step just before the last one leaves for its successor.
Growth is what steps 2 .. last-2 each leave behind: a finding when at least two of them do, for at
least 64 MiB and 2% of the peak allocated in all. Outputs cached by a pipeline schedule are left to
``pipeline-output-cache``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..analysis.device import DeviceAnalysis
from ..analysis.iterations import step_growth
from ..analysis.sites import group_sites
from ..units import MiB
from .common import rows_with, site_refs, stacks_matching
from .context import Context
from .finding import Evidence, Finding, Fix

ID = "memory-growth"
WARMUP_STEPS = 2
MIN_BYTES = 64 * MiB
MIN_FRACTION = 0.02
MIN_STEPS = 2


@dataclass(frozen=True, kw_only=True)
class MemoryGrowthEvidence(Evidence):
    """The evidence of a ``memory-growth`` finding; steps numbered as the job counts them."""

    FINDING: ClassVar[str] = ID

    steps: int
    """optimizer steps the trace shows"""
    step_source: str
    """what told the steps: 'markers', 'annotations' or 'optimizer frames'"""
    steps_leaving_memory: int
    """of the steps counted, those that left memory allocated"""
    leaking_steps: list[int]
    """those steps' numbers"""
    first_counted_step: int
    """the first step counted (the warm-up steps before it are not)"""
    last_counted_step: int
    """the last step counted (the two still running at the end are not)"""
    retained_bytes: int
    """what the counted steps left allocated, added up (bytes)"""
    retained_bytes_per_step: list[int]
    """what each counted step left allocated, in order (bytes)"""
    allocated_at_first_step_bytes: int
    """allocated at the start of the first step counted (bytes)"""
    allocated_at_last_step_bytes: int
    """allocated at the start of the last step (bytes)"""
    peak_allocated_bytes: int
    """the rank's peak allocated (bytes)"""


EVIDENCE: tuple[type[Evidence], ...] = (MemoryGrowthEvidence,)
"""The evidence classes of this detector's findings."""


def detect_rank(a: DeviceAnalysis, ctx: Context) -> Finding | None:
    steps = a.steps
    # the steps counted are WARMUP_STEPS .. len(steps) - 3 (the last two are still running at the end): at
    # least MIN_STEPS of them must leave memory behind
    if steps is None or len(steps) < WARMUP_STEPS + MIN_STEPS + 2:
        return None
    g = step_growth(a.lifetimes, a.timeline.allocated, steps)
    pp = stacks_matching(a.trace, "torch/distributed/pipelining/")
    counted = range(WARMUP_STEPS, len(steps) - 2)
    rows: list[np.ndarray] = []
    per_step: list[int] = []
    for i in counted:
        r = g.retained_rows[i]
        r = r[~rows_with(pp, a.lifetimes.stack[r])]
        rows.append(r)
        per_step.append(int(a.lifetimes.size[r].sum()))
    total = sum(per_step)
    growing = [i for i, b in zip(counted, per_step) if b > 0]
    if len(growing) < MIN_STEPS or total < max(MIN_BYTES, MIN_FRACTION * a.peak_allocated[0]):
        return None
    all_rows = np.concatenate(rows)
    start_alloc = g.allocated_at_start
    evidence = MemoryGrowthEvidence(
        steps=len(steps),
        step_source=steps.source,
        steps_leaving_memory=len(growing),
        # numbered as the job counts them (a recording window's first step is not 0), as the breakdown's step is
        leaking_steps=[i + steps.first for i in growing],
        first_counted_step=counted[0] + steps.first,
        last_counted_step=counted[-1] + steps.first,
        retained_bytes=total,
        retained_bytes_per_step=per_step,
        allocated_at_first_step_bytes=int(start_alloc[WARMUP_STEPS]),
        allocated_at_last_step_bytes=int(start_alloc[-1]),
        peak_allocated_bytes=int(a.peak_allocated[0]),
    )
    fixes = [
        Fix("detach-kept-tensors", versions="all",
            source="PyTorch FAQ 'Don't accumulate history across your training loop'", kind="code"),
        Fix("bound-growing-containers", versions=">=2.1", source="PyTorch blog 'Understanding GPU Memory 2'",
            kind="code"),
    ]
    return Finding(ID, "high", [a.rank], total, evidence, site_refs(a, group_sites(a.trace, a.lifetimes, all_rows)),
                   fixes, per_rank_bytes={a.rank: total})


def detect(ctx: Context) -> list[Finding]:
    return [f for a in ctx.analyses if (f := detect_rank(a, ctx)) is not None]
