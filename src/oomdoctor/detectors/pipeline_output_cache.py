"""``pipeline-output-cache``: the last pipeline stage keeps every micro-batch's output until ``step()``
returns (seed 003, AP-04).

``torch.distributed.pipelining`` ``_PipelineStageBase.forward_one_chunk`` appends each micro-batch's
output to ``output_chunks`` for ``_merge_outputs`` (last stage only since 2.8, PR #153383). The
outputs (often ``[seq, vocab]`` logits) stay allocated for the whole step, so memory grows with the
number of micro-batches.

Signature: blocks allocated under ``pipelining/stage.py`` ``forward_one_chunk`` from one site and of
one requested size, of which at least 3 are allocated at once, and whose frees come in one burst (within 10% of
the span of their allocations) instead of one per backward.

Fix: ``schedule.step(..., return_outputs=False)`` (PyTorch >= 2.10, PR #165822; torchtitan PR #1922);
before 2.10 skip ``output_chunks.append`` as seed 003's patch does, or compute the loss inside the
schedule (``loss_fn``) and chunk the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..analysis.device import DeviceAnalysis
from ..analysis.lifetimes import Lifetimes
from ..analysis.sites import group_sites, site_index
from ..units import MiB
from .common import rows_with, site_refs, stacks_matching
from .context import Context
from .finding import Evidence, Finding, Fix

ID = "pipeline-output-cache"
MIN_CONCURRENT = 3
MIN_BYTES = 256 * MiB
BURST_FRACTION = 0.10


@dataclass(frozen=True, kw_only=True)
class PipelineOutputCacheEvidence(Evidence):
    """The evidence of a ``pipeline-output-cache`` finding: the group of outputs of one site and size kept the most."""

    FINDING: ClassVar[str] = ID

    outputs_kept: int
    """micro-batch outputs allocated at once"""
    output_bytes: int
    """one output's requested size (bytes)"""
    kept_bytes: int
    """the outputs allocated at once, added up (bytes)"""
    micro_batches_seen: int
    """outputs of that site and size in the group (one per micro-batch)"""
    median_held_us: int
    """how long an output stayed allocated, the median (µs)"""
    peak_allocated_bytes: int
    """the rank's peak allocated (bytes)"""
    torch_version: str
    """the PyTorch version: the sidecar's, a lower bound read off the snapshot ('>= 2.8 (snapshot has ...)') or 'unknown'"""


EVIDENCE: tuple[type[Evidence], ...] = (PipelineOutputCacheEvidence,)
"""The evidence classes of this detector's findings."""


def _max_concurrent(alloc: np.ndarray, free: np.ndarray, n: int) -> int:
    d = np.zeros(n + 1, dtype=np.int64)
    np.add.at(d, alloc, 1)
    np.subtract.at(d, np.where(free >= 0, free, n), 1)
    return int(np.cumsum(d[:n]).max()) if n else 0


def _by_step(g: np.ndarray, lt: Lifetimes, n: int) -> list[np.ndarray]:
    """Split one site's blocks at the gaps between bursts of frees (one burst per ``step()`` when a
    trace spans several steps): a gap longer than ``BURST_FRACTION`` of the span of the allocations."""
    if g.size < MIN_CONCURRENT:
        return []
    frees = np.where(lt.free_requested[g] >= 0, lt.free_requested[g], n - 1)
    order = np.argsort(frees, kind="stable")
    span = max(int(lt.alloc[g].max() - lt.alloc[g].min()), 1)
    cuts = np.flatnonzero(np.diff(frees[order]) > BURST_FRACTION * span) + 1
    return [part for part in np.split(g[order], cuts) if part.size >= MIN_CONCURRENT]


def _kept_at_once(g: np.ndarray, lt: Lifetimes, n: int) -> int:
    """The bytes of ``g``'s blocks allocated at once when most of them are: their own sizes added up (a block may
    be larger than the others by an unsplit remainder), as the report's holders count them."""
    alloc, free = lt.alloc[g], np.where(lt.free_requested[g] >= 0, lt.free_requested[g], n)
    d = np.zeros(n + 1, dtype=np.int64)
    np.add.at(d, alloc, 1)
    np.subtract.at(d, free, 1)
    k = int(np.argmax(np.cumsum(d[:n])))
    return int(lt.size[g][(alloc <= k) & (free > k)].sum())


def _candidate(g: np.ndarray, lt: Lifetimes, n: int) -> tuple[int, int, np.ndarray] | None:
    """``(bytes kept at once, blocks kept at once, rows)`` when ``g`` is kept and freed in one burst."""
    conc = _max_concurrent(lt.alloc[g], lt.free_requested[g], n)
    if conc < MIN_CONCURRENT:
        return None
    total = _kept_at_once(g, lt, n)
    if total < MIN_BYTES:
        return None
    frees = np.where(lt.free_requested[g] >= 0, lt.free_requested[g], n - 1)
    span = max(int(lt.alloc[g].max() - lt.alloc[g].min()), 1)
    burst = (int(frees.max() - frees.min()) <= BURST_FRACTION * span) or bool((lt.free_requested[g] < 0).all())
    return (total, conc, g) if burst else None


def detect_rank(a: DeviceAnalysis, ctx: Context) -> Finding | None:
    lt = a.lifetimes
    mask = stacks_matching(a.trace, "torch/distributed/pipelining/stage.py", ("forward_one_chunk",))
    rows = np.flatnonzero(rows_with(mask, lt.stack) & (lt.alloc >= 0))
    if rows.size < MIN_CONCURRENT:
        return None
    n = a.num_events
    sites = site_index(a.trace).sites_of(lt.stack[rows])
    best = None
    # group by site and requested size (block sizes may differ by an unsplit remainder)
    req = lt.requested[rows]
    for key in set(zip(sites.tolist(), req.tolist())):
        for g in _by_step(rows[(sites == key[0]) & (req == key[1])], lt, n):
            cand = _candidate(g, lt, n)
            if cand is not None and (best is None or cand[0] > best[0]):
                best = cand
    if best is None:
        return None
    total, conc, g = best
    tu = a.device.events["time_us"]
    frees = np.where(lt.free_requested[g] >= 0, lt.free_requested[g], n - 1)
    held_us = tu[frees] - tu[lt.alloc[g]]
    v = ctx.versions[a.rank]
    evidence = PipelineOutputCacheEvidence(
        outputs_kept=conc,
        output_bytes=int(lt.requested[g][0]),
        kept_bytes=total,
        micro_batches_seen=int(g.size),
        median_held_us=int(np.median(held_us)),
        peak_allocated_bytes=int(a.peak_allocated[0]),
        torch_version=v.text,
    )
    fixes = [
        Fix("return-outputs-false", versions=">=2.10",
            source="pytorch/pytorch PR #165822; torchtitan PR #1922", kind="code",
            setting="return_outputs=False", applies=v.at_least((2, 10))),
        Fix("skip-output-chunks", versions="2.4-2.9", source="pytorch/pytorch issue #159251; discuss.pytorch.org/t/221886", kind="code",
            applies=None if v.at_least((2, 10)) is None else not v.at_least((2, 10))),
        Fix("chunked-loss", versions="all", source="github.com/pytorch/torchtitan/blob/main/docs/chunked_loss.md", kind="code"),
    ]
    return Finding(ID, "high", [a.rank], total, evidence, site_refs(a, group_sites(a.trace, lt, g)), fixes,
                   per_rank_bytes={a.rank: total})


def detect(ctx: Context) -> list[Finding]:
    return [f for a in ctx.analyses if (f := detect_rank(a, ctx)) is not None]
