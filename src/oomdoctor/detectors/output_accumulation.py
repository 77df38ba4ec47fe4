"""``output-accumulation``: outputs of many micro-batches kept on the GPU (AP-12, eval accumulation).

An evaluation loop that gathers every batch's logits to compute metrics at the end (Hugging Face
Trainer with ``compute_metrics`` and no ``preprocess_logits_for_metrics``; a LightningModule appending
``outputs`` in ``validation_step``; a plain loop keeping ``logits`` in a list) grows by one batch of
outputs per step until the GPU is full. Signature, from the accounting (:mod:`oomdoctor.analysis.accounting`):
blocks in the ``outputs`` category (model code's tensors still allocated after later micro-batches ran),
born in at least two different passes, at the OOM or the peak. Outputs cached by a pipeline schedule are
left to ``pipeline-output-cache``.

Fixes in the framework's own words (:mod:`oomdoctor.frameworks`): Trainer's
``preprocess_logits_for_metrics`` (``transformers/trainer.py`` ``evaluation_loop``; measured in the corpus:
``eval_accumulation_steps`` alone moved 79 GB of fp32 logits per rank to host RAM, where the kernel's OOM
killer ended the job, ``docs/corpus/README.md``), Lightning's "keep only what the metric needs", and in
general moving kept tensors to the CPU or reducing them per batch.
"""

from __future__ import annotations

import numpy as np

from ..analysis.accounting import OUTPUTS
from ..analysis.device import DeviceAnalysis
from ..analysis.sites import group_sites
from ..frameworks import detect_frameworks
from .common import rows_with, site_refs, stacks_matching
from .context import Context
from .finding import Finding, Fix

ID = "output-accumulation"
HIGH_FRACTION = 0.25
MIN_KEPT_BYTES = 1 << 20
"""Below this, what is kept is a loss or a metric scalar per step, not outputs."""


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
    passes = np.unique(ph.pass_of(lt.alloc[rows]))
    if passes.size < 2:
        return None
    kept = int(lt.size[rows].sum())
    if kept < MIN_KEPT_BYTES:
        return None
    allocated = a.allocated_at(k)
    biggest = int(lt.alloc[rows][np.argmax(lt.size[rows])])
    phase = ph.phase_name(biggest) if biggest >= 0 else "evaluation"
    evidence = {
        "kept_bytes": kept,
        "blocks": int(rows.size),
        "passes": int(passes.size),
        "allocated_bytes": allocated,
        "kept_fraction": round(kept / max(allocated, 1), 3),
        "at": "the OOM" if at_oom else "the peak",
        "phase": phase,
    }
    summary = ("At {at}, {kept_bytes:bytes} in {blocks} blocks are outputs of {passes} micro-batches kept on the GPU "
               "while later ones ran ({phase} phase): {kept_fraction:.0%} of the {allocated_bytes:bytes} allocated. "
               "They grow by one batch per step until the device is full.")
    frameworks = detect_frameworks(f for f, _l, _n in a.trace.stacks.frames)
    fixes = [Fix(f"{fw.name}: {fw.knobs['eval-outputs']}.", versions="all",
                 source="oomdoctor frameworks table; docs/corpus/README.md (trainer-ddp-gpt2-eval-*)", kind="config")
             for fw in frameworks if "eval-outputs" in fw.knobs]
    fixes.append(Fix("Keep only what the metric needs per batch (e.g. logits.argmax(-1)), or move kept tensors to the "
                     "CPU with t.detach().cpu(); accumulate metric state instead of outputs (torchmetrics).",
                     versions="all", source="shared/reference/antipatterns.md; PyTorch FAQ (accumulating history)",
                     kind="code"))
    sev = "high" if kept >= HIGH_FRACTION * allocated else "medium"
    return Finding(ID, sev, "Outputs of many micro-batches are kept on the GPU", [a.rank], kept, summary, evidence,
                   site_refs(a, group_sites(a.trace, lt, rows)), fixes, per_rank_bytes={a.rank: kept})


def detect(ctx: Context) -> list[Finding]:
    return [f for a in ctx.analyses if (f := detect_rank(a, ctx)) is not None]
