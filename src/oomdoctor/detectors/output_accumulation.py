"""``output-accumulation``: outputs of many micro-batches kept on the GPU (AP-12, eval accumulation).

An evaluation loop that gathers every batch's logits to compute metrics at the end (Hugging Face
Trainer with ``compute_metrics`` and no ``preprocess_logits_for_metrics``; a LightningModule appending
``outputs`` in ``validation_step``; a plain loop keeping ``logits`` in a list) grows by one batch of
outputs per step until the GPU is full. Signature, from the accounting (:mod:`oomdoctor.analysis.accounting`):
blocks in the ``outputs`` category (model code's tensors still allocated after later micro-batches ran),
born in at least :data:`MIN_PASSES` different passes, at the OOM or the peak; or one buffer re-allocated
larger pass after pass (:func:`_regrown`). Outputs cached by a pipeline schedule are
left to ``pipeline-output-cache``.

Fixes in the framework's own words (:mod:`oomdoctor.frameworks`): Trainer's
``preprocess_logits_for_metrics`` (``transformers/trainer.py`` ``evaluation_loop``; measured in the corpus:
``eval_accumulation_steps`` alone moved 79 GB of fp32 logits per rank to host RAM, where the kernel's OOM
killer ended the job, ``docs/corpus/README.md``), Lightning's "keep only what the metric needs", and in
general moving kept tensors to the CPU or reducing them per batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from ..analysis.accounting import OUTPUTS
from ..analysis.arrays import distinct, distinct_columns
from ..analysis.device import DeviceAnalysis
from ..analysis.phases import GENERATION_PHASE, role_index
from ..analysis.sites import group_sites
from ..frameworks import detect_frameworks, running_files
from .common import rows_with, site_refs, stacks_matching
from .context import Context
from .finding import Evidence, Finding, Fix, absent

ID = "output-accumulation"
GRAPH_SITES = 4
"""Kept blocks from this many different sites per batch are a whole graph (saved tensors of every layer),
not a batch's outputs (logits and labels come from one or two sites)."""
MIN_PASSES = 3
"""Outputs of at least this many batches alive at once accumulate; two are the last batch's, still referenced
while the next one runs."""
MIN_REGROWN = 3
"""Passes in a row whose kept buffer grew: one growing buffer is accumulation."""
HIGH_FRACTION = 0.25
MIN_KEPT_BYTES = 1 << 20
"""Below this, what is kept is a loss or a metric scalar per step, not outputs."""


@dataclass(frozen=True, kw_only=True)
class OutputAccumulationEvidence(Evidence):
    """The evidence of an ``output-accumulation`` finding (every variant), at the OOM or the peak."""

    FINDING: ClassVar[str] = ID
    VARIANTS: ClassVar[tuple[str, ...]] = ("graph-kept", "regrown", "kept-outputs")

    kept_bytes: int
    """the outputs kept, added up (bytes)"""
    blocks: int
    """their blocks"""
    passes: int
    """the passes (batches) they were made in"""
    allocated_bytes: int
    """allocated at that moment (bytes)"""
    kept_fraction: float
    """kept_bytes over allocated_bytes, three decimals"""
    at: str
    """the moment: 'the OOM' or 'the peak'"""
    phase: str
    """the phase the largest kept block was made in ('before the trace' when it predates it)"""
    sites_per_pass: int
    """model code's allocation sites kept per pass, the median (a whole graph: 4 or more)"""
    kept_unit: str
    """what kept_at counts: 'step' (optimizer steps) or 'batch' (passes)"""
    kept_at: list[int]
    """the steps or batches that kept outputs"""
    kept_every: int
    """how many steps or batches apart they were (0: unevenly, or fewer than two)"""
    regrown_passes: int | None = absent()
    """passes in a row a buffer was re-allocated larger (variant regrown only)"""


EVIDENCE: tuple[type[Evidence], ...] = (OutputAccumulationEvidence,)
"""The evidence classes of this detector's findings."""


def detect_rank(a: DeviceAnalysis, ctx: Context) -> Finding | None:
    if a.num_events == 0:
        return None
    lt, acc, ph = a.lifetimes, a.accounting, a.phases
    at_oom = bool(a.oom_events.size)
    k = int(a.oom_events[-1]) if at_oom else a.peak_allocated[1]
    rows = np.flatnonzero(lt.allocated_mask(k) & (acc.category == OUTPUTS))
    pp = stacks_matching(a.trace, "torch/distributed/pipelining/")
    rows = rows[~rows_with(pp, lt.stack[rows])]
    if rows.size == 0:
        return None
    passes = distinct(ph.pass_of(lt.alloc[rows][lt.alloc[rows] >= 0]))  # the passes the trace shows
    regrown = _regrown(a, rows)
    if passes.size < MIN_PASSES and not regrown:
        return None  # one batch's outputs held while the next runs (a variable reassigned late) do not grow
    kept = int(lt.size[rows].sum())
    if kept < MIN_KEPT_BYTES:
        return None
    allocated = a.allocated_at(k)
    biggest = int(lt.alloc[rows][np.argmax(lt.size[rows])])
    phase = ph.phase_name(biggest) if biggest >= 0 else "before the trace"
    # model code's sites kept per batch: a graph keeps the saved tensors of every layer, outputs one or two
    ri = role_index(a.trace)
    in_model = rows[(lt.alloc[rows] >= 0) & ri.lookup(ri.model, lt.stack[rows])]
    sites = distinct_columns(np.stack([ph.pass_of(lt.alloc[in_model]), lt.stack[in_model]]))
    per_pass = int(np.median(np.unique(sites[0], return_counts=True)[1])) if in_model.size else 0
    unit, kept_at = _kept_at(a, rows)
    evidence = OutputAccumulationEvidence(
        kept_bytes=kept,
        blocks=int(rows.size),
        passes=int(passes.size),
        allocated_bytes=allocated,
        kept_fraction=round(kept / max(allocated, 1), 3),
        at="the OOM" if at_oom else "the peak",
        phase=phase,
        sites_per_pass=per_pass,
        kept_unit=unit,
        kept_at=kept_at,
        kept_every=_every(kept_at),
    )
    frameworks = detect_frameworks(running_files(a.trace.stacks))
    graph = per_pass >= GRAPH_SITES and passes.size >= MIN_PASSES
    if graph:
        # every layer's saved tensors of every batch: what a Python sum of losses keeps alive through
        # their grad_fn chain when the loop runs without no_grad()
        variant = "graph-kept"
        fixes = [Fix("no-grad-evaluation", versions="all",
                     source="PyTorch FAQ 'Don't accumulate history across your training loop'; torch.no_grad docs",
                     kind="code")]
    elif regrown and passes.size < MIN_PASSES:
        evidence = replace(evidence, regrown_passes=regrown)
        variant = "regrown"
        fixes = []
    else:
        variant = "kept-outputs"
        fixes = []
    if not graph:
        fixes = [Fix("framework-eval-outputs", versions="all",
                     source="transformers Trainer docs (preprocess_logits_for_metrics); a measured Trainer evaluation "
                            "whose eval_accumulation_steps moved 79 GB of logits per rank to host RAM", kind="config",
                     framework=fw.id)
                 for fw in frameworks if "eval-outputs" in fw.knobs]
        fixes.append(Fix("keep-what-the-metric-needs", versions="all", source="PyTorch FAQ (accumulating history); torchmetrics docs", kind="code"))
    sev = "high" if kept >= HIGH_FRACTION * allocated else "medium"
    return Finding(ID, sev, [a.rank], kept, evidence, site_refs(a, group_sites(a.trace, lt, rows)), fixes,
                   per_rank_bytes={a.rank: kept}, variant=variant)


def _kept_at(a: DeviceAnalysis, rows: np.ndarray) -> tuple[str, list[int]]:
    """When the outputs kept (``rows``) were made: ``("step", [step numbers])`` where the trace shows its optimizer
    steps and each batch that kept outputs ran in a step of its own (numbered as the job counts them,
    ``Phases.step_of``), else ``("batch", [pass indices])``. Blocks born before the trace are left out."""
    lt, ph = a.lifetimes, a.phases
    born = lt.alloc[rows][lt.alloc[rows] >= 0]
    passes = distinct(ph.pass_of(born))
    steps = a.steps
    if steps is not None and len(steps) and born.size:
        index = np.searchsorted(steps.starts, born, side="right") - 1
        if (index >= 0).all() and distinct(index).size == passes.size:
            return "step", (distinct(index) + steps.first).tolist()
    return "batch", passes.tolist()


def _every(kept_at: list[int]) -> int:
    """How many steps (or batches) apart the outputs kept were made, when evenly spaced (``kept_at``: sorted); 0 when
    not (or fewer than two)."""
    gaps = set(np.diff(kept_at).tolist())
    return gaps.pop() if len(gaps) == 1 else 0


def _regrown(a: DeviceAnalysis, rows: np.ndarray) -> int:
    """How many passes in a row a site among ``rows`` (kept outputs) held more bytes at each pass's start than
    at the one before: one buffer re-allocated larger batch after batch (transformers' ``nested_concat``),
    which at any moment is one block. 0 when none did for :data:`MIN_REGROWN` passes."""
    lt, ph = a.lifetimes, a.phases
    starts = ph.pass_starts
    if starts.size < MIN_REGROWN + 1:
        return 0
    best = 0
    born = np.where(lt.alloc >= 0, ph.phase[np.clip(lt.alloc, 0, max(a.num_events - 1, 0))], -1)
    for s in distinct(lt.stack[rows]).tolist():
        # inside generate() the token ids, mask and cache grow with every token by design
        mine = np.flatnonzero((lt.stack == s) & (a.accounting.category == OUTPUTS) & (lt.alloc >= 0)
                              & (born != GENERATION_PHASE))
        d = np.where(lt.free_requested[mine] >= 0, lt.free_requested[mine], a.num_events)
        live = np.array([int(lt.size[mine][(lt.alloc[mine] <= p) & (d > p)].sum()) for p in starts.tolist()])
        rises = np.diff(live) > 0
        run = longest = 0
        for r in rises.tolist():
            run = run + 1 if r else 0
            longest = max(longest, run)
        best = max(best, longest)
    return best + 1 if best >= MIN_REGROWN else 0


def detect(ctx: Context) -> list[Finding]:
    return [f for a in ctx.analyses if (f := detect_rank(a, ctx)) is not None]
