"""``deferred-free``: memory held by frees deferred through ``record_stream`` (seed 000, AP-01).

When a block was used on another stream (``Tensor.record_stream``), the allocator does not reuse it
at the user's free: it records CUDA events on those streams and returns the block only when a later
``malloc`` sees them complete (``CUDACachingAllocator.cpp`` ``free``/``insert_events``/
``process_events``). The CPU runs ahead, so such blocks pile up across layers and iterations and
the allocator reserves new segments for what it cannot reuse.

Evidence: bytes between ``free_requested`` and a later ``free_completed`` at the peak of reserved
memory, weighed against the peak (the few small point-to-point sends of a pipeline are not a finding);
whose stream: an FSDP stream (frames in ``torch/distributed/fsdp``), point-to-point (pipelining or
``isend``/``irecv`` frames), a collective (an ``nccl:*`` annotation starts while the block is live),
or user code. A snapshot without history: the blocks its final state shows pending free.

Fixes: ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` on PyTorch 2.1-2.7 (PR #89880/#97053); the default
since 2.8 (PR #148590/#150398: collectives run on the current stream and stash tensors instead);
``async_op=True`` + ``wait()`` before reuse; FSDP1 ``limit_all_gathers=True`` (PRs #83666/#83917) or
FSDP2. ``expandable_segments`` does not help: the memory is held, not fragmented (measured in
a two-rank tensor-parallel job on H200: legacy 2.84 GiB, legacy + expandable 2.23 GiB, modern 1.22 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..analysis.device import DeviceAnalysis
from ..analysis.phases import annotations_named
from ..analysis.sites import group_sites
from ..trace.model import SEGMENT_ALLOC
from ..units import MiB
from .common import rows_with, site_refs, stacks_matching
from .context import Context, TorchVersion
from .finding import Evidence, Finding, Fix

ID = "deferred-free"
MIN_HELD_BYTES = 128 * MiB
MIN_HELD_FRACTION = 0.05
PLATEAU_FRACTION = 0.02
PLATEAU_BYTES = 20 * MiB

NO_HELP_MEASURED: dict[str, list[int]] = {
    "record_stream": [2_449_473_536, 3_053_453_312],
    "expandable_segments": [2_390_753_280, 2_663_383_040],
    "without_record_stream": [1_308_622_848, 1_308_622_848],
}
"""What the ``expandable-segments-no-help`` fix cites: peak reserved (``torch.cuda.max_memory_reserved``) of rank 1 and
rank 0 of the two-rank tensor-parallel job of ``shared/snapshots/tp-allreduce`` (``stats.jsonl``, tags tp-legacy,
tp-legacy-expandable, tp-modern), smallest and largest. How long a deferred free waits depends on the run's timing, so
one rank with expandable segments (2.23 GiB) lands below a run without them (2.84 GiB on the other run's rank 0), while
the same recording replayed with them (the fix's prediction) holds as much as recorded."""

_P2P_NAMES = ("isend", "irecv", "send", "recv", "batch_isend_irecv", "_batch_p2p", "P2POp")


@dataclass(frozen=True, kw_only=True)
class DeferredFreeEvidence(Evidence):
    """The evidence of a ``deferred-free`` finding read off the trace (variant ``at-peak``). Owners: 'fsdp',
    'point-to-point', 'collective', 'user code' or 'unknown' (freed before the trace began)."""

    FINDING: ClassVar[str] = ID
    VARIANTS: ClassVar[tuple[str, ...]] = ("at-peak",)

    held_at_peak_bytes: int
    """blocks freed but not yet reusable at the peak of reserved memory (or where the plateau held the most) (bytes)"""
    max_held_bytes: int
    """the most such blocks held at any event (bytes)"""
    peak_reserved_bytes: int
    """the rank's peak reserved (bytes)"""
    peak_allocated_bytes: int
    """the rank's peak allocated (bytes)"""
    deferred_blocks: int
    """blocks whose free was deferred, over the trace"""
    deferred_bytes_total: int
    """their sizes added up (bytes)"""
    blocks_held_at_peak: int
    """deferred blocks held at that peak"""
    median_deferral_us: int
    """from a deferred free's request to its completion, the median (µs)"""
    max_deferral_us: int
    """the same, the longest (µs)"""
    still_pending_at_end: int
    """deferred frees not completed when the trace ends"""
    owner: str
    """whose stream held most of the bytes at the peak"""
    held_at_peak_by_owner: dict[str, int]
    """bytes held at the peak per owner (bytes)"""
    owners_all: dict[str, int]
    """deferred blocks over the trace per owner"""
    segment_allocs_before_peak: int
    """segments allocated up to the peak"""
    collectives: str
    """the collectives the nccl:* annotations name, comma-separated ('none recorded' without any)"""
    reserved_over_allocated: float
    """peak reserved over peak allocated, two decimals"""
    torch_version: str
    """the PyTorch version: the sidecar's, a lower bound read off the snapshot ('>= 2.8 (snapshot has ...)') or 'unknown'"""


@dataclass(frozen=True, kw_only=True)
class DeferredFreeFinalStateEvidence(Evidence):
    """The evidence of a ``deferred-free`` finding of a snapshot without history (variant ``final-state``): the
    blocks its final state shows pending free."""

    FINDING: ClassVar[str] = ID
    VARIANTS: ClassVar[tuple[str, ...]] = ("final-state",)

    held_at_end_bytes: int
    """blocks pending free in the final state (bytes)"""
    blocks_pending_at_end: int
    """those blocks"""
    reserved_bytes: int
    """reserved in the final state (bytes)"""
    allocated_bytes: int
    """allocated in the final state (bytes)"""
    owner: str
    """whose stream holds them, from their stacks: 'fsdp', 'point-to-point' or 'unknown'"""
    torch_version: str
    """the PyTorch version: the sidecar's, a lower bound read off the snapshot ('>= 2.8 (snapshot has ...)') or 'unknown'"""


EVIDENCE: tuple[type[Evidence], ...] = (DeferredFreeEvidence, DeferredFreeFinalStateEvidence)
"""The evidence classes of this detector's findings."""


def _owners(a: DeviceAnalysis, rows: np.ndarray) -> np.ndarray:
    """Per deferred row (``rows``: row indices of ``a.lifetimes``, shape (k,)): 'fsdp' or 'point-to-point' where
    the block's alloc or free stack says so; else 'collective' where an ``nccl:*`` scope started between its
    alloc and its free request; else 'user code' (its own ``record_stream``); 'unknown' for a block whose free
    was requested before the trace began (what held it then is not recorded)."""
    t = a.trace
    lt = a.lifetimes
    fr_stack = np.where(lt.free_requested[rows] >= 0, a.device.events["stack"][np.maximum(lt.free_requested[rows], 0)], -1)
    alloc_stack = lt.stack[rows]
    fsdp = stacks_matching(t, "torch/distributed/fsdp/")
    p2p = stacks_matching(t, "torch/distributed/pipelining/") | stacks_matching(t, "distributed_c10d.py", _P2P_NAMES)
    owner = np.full(rows.shape[0], "user code", dtype=object)
    # a block freed before the trace began (pending at its start): what held it ran before the trace, unrecorded
    before = lt.free_requested[rows] < 0
    owner[before] = "unknown"
    # collectives: an nccl:* scope starts while the block is allocated
    starts = np.array(sorted(x.time_us for x in annotations_named(a.device, "nccl:") if x.stage == "START"),
                      dtype=np.int64)
    if starts.size:
        tu = a.device.events["time_us"]
        t0 = np.where(lt.alloc[rows] >= 0, tu[np.maximum(lt.alloc[rows], 0)], tu[0])
        t1 = tu[np.maximum(lt.free_requested[rows], 0)]
        coll = ~before & (np.searchsorted(starts, t1, side="right") > np.searchsorted(starts, t0, side="left"))
        owner[coll] = "collective"
    owner[rows_with(p2p, alloc_stack) | rows_with(p2p, fr_stack)] = "point-to-point"
    owner[rows_with(fsdp, alloc_stack) | rows_with(fsdp, fr_stack)] = "fsdp"
    return owner


def _collective_names(a: DeviceAnalysis) -> list[str]:
    names = sorted({x.name[len("nccl:"):] for x in annotations_named(a.device, "nccl:")})
    return names


def _detect_final_state(a: DeviceAnalysis, ctx: Context) -> Finding | None:
    """A snapshot without history: the blocks the final state shows pending free (``active_pending_free``:
    freed by Python, awaiting work on another stream) against the reserved bytes. Whose stream is told
    from the blocks' stacks (FSDP, point-to-point) or is ``unknown``: without history there is no
    ``nccl:*`` annotation to time them against."""
    pending = [b for _s, b in a.device.blocks if b.is_pending_free]
    held = sum(b.size for b in pending)
    reserved, allocated = a.peak_reserved[0], a.peak_allocated[0]
    if held < max(MIN_HELD_BYTES, MIN_HELD_FRACTION * reserved):
        return None
    stacks = np.array([b.stack for b in pending], dtype=np.int64)
    fsdp = stacks_matching(a.trace, "torch/distributed/fsdp/")[stacks]
    p2p = (stacks_matching(a.trace, "torch/distributed/pipelining/")
           | stacks_matching(a.trace, "distributed_c10d.py", _P2P_NAMES))[stacks]
    owner = "fsdp" if fsdp.all() else "point-to-point" if p2p.all() else "unknown"
    v = ctx.versions[a.rank]
    evidence = DeferredFreeFinalStateEvidence(held_at_end_bytes=held, blocks_pending_at_end=len(pending),
                                              reserved_bytes=reserved, allocated_bytes=allocated, owner=owner,
                                              torch_version=v.text)
    sev = "high" if held >= 0.25 * reserved else "medium"
    return Finding(id=ID, severity=sev, ranks=[a.rank], bytes=held, evidence=evidence, sites=[],
                   fixes=_fixes(owner, v), per_rank_bytes={a.rank: held}, variant="final-state")


def detect_rank(a: DeviceAnalysis, ctx: Context) -> Finding | None:
    if a.num_events == 0:
        return _detect_final_state(a, ctx)
    lt = a.lifetimes
    held = a.deferred_held()
    peak_reserved, k = a.peak_reserved
    threshold = max(MIN_HELD_BYTES, MIN_HELD_FRACTION * peak_reserved)
    k = max(k, 0)
    if held[k] < threshold:
        # reserved may stay at its peak for a while (segments cached earlier): look over that plateau,
        # including a last small segment (a barrier's, say) that sets the peak after the held blocks returned
        near = peak_reserved - max(PLATEAU_FRACTION * peak_reserved, PLATEAU_BYTES)
        plateau = np.flatnonzero(a.timeline.reserved >= near)
        if plateau.size:
            k = int(plateau[np.argmax(held[plateau])])
    held_at_peak = int(held[k])
    if held_at_peak < threshold:
        return None
    d = np.flatnonzero(lt.deferred)
    at_peak = ((np.where(lt.free_requested[d] >= 0, lt.free_requested[d], -1) <= k)
               & ((lt.free_completed[d] > k) | (lt.free_completed[d] < 0)))
    live_at_peak = d[at_peak]
    owners = _owners(a, d)
    owner_at_peak = owners[at_peak]
    # owners in name order: a set's order follows the process's string hash seed, which the JSON must not
    by_owner = {o: int(lt.size[live_at_peak][owner_at_peak == o].sum()) for o in sorted(set(owner_at_peak.tolist()))}
    main_owner = max(by_owner, key=by_owner.__getitem__) if by_owner else "user code"
    tu = a.device.events["time_us"]
    fr, fc = lt.free_requested[d], lt.free_completed[d]
    end = a.num_events - 1
    dur_us = tu[np.where(fc >= 0, fc, end)] - tu[np.where(fr >= 0, fr, 0)]
    seg_allocs = int(np.count_nonzero(a.device.events["action"][: k + 1] == SEGMENT_ALLOC))
    v = ctx.versions[a.rank]
    evidence = DeferredFreeEvidence(
        held_at_peak_bytes=held_at_peak,
        max_held_bytes=int(held.max()),
        peak_reserved_bytes=int(peak_reserved),
        peak_allocated_bytes=int(a.peak_allocated[0]),
        deferred_blocks=int(d.size),
        deferred_bytes_total=int(lt.size[d].sum()),
        blocks_held_at_peak=int(live_at_peak.size),
        median_deferral_us=int(np.median(dur_us)) if dur_us.size else 0,
        max_deferral_us=int(dur_us.max()) if dur_us.size else 0,
        still_pending_at_end=int(np.count_nonzero((fr >= 0) & (fc < 0))),
        owner=main_owner,
        held_at_peak_by_owner=by_owner,
        owners_all={o: int(np.count_nonzero(owners == o)) for o in sorted(set(owners.tolist()))},
        segment_allocs_before_peak=seg_allocs,
        collectives=", ".join(_collective_names(a)) or "none recorded",
        reserved_over_allocated=round(peak_reserved / max(a.peak_allocated[0], 1), 2),
        torch_version=v.text,
    )
    sev = "high" if held_at_peak >= 0.25 * peak_reserved else "medium"
    return Finding(
        id=ID, severity=sev, ranks=[a.rank], bytes=held_at_peak, evidence=evidence,
        sites=site_refs(a, group_sites(a.trace, lt, live_at_peak)),
        fixes=_fixes(main_owner, v), per_rank_bytes={a.rank: held_at_peak}, variant="at-peak")


def _fixes(owner: str, v: TorchVersion) -> list[Fix]:
    legacy = v.in_range((2, 1), (2, 8))
    modern = v.at_least((2, 8))
    fixes: list[Fix] = []
    if owner in ("collective", "fsdp", "unknown"):
        fixes.append(Fix(
            "avoid-record-streams", versions="2.1-2.7", source="pytorch/pytorch PR #89880, #97053; issue #124260",
            kind="env", setting="TORCH_NCCL_AVOID_RECORD_STREAMS=1", applies=legacy,
            what_if={"deferred_frees": "immediate"}))
        fixes.append(Fix(
            "upgrade-collectives-current-stream", versions=">=2.8", source="pytorch/pytorch PR #148590 (relanded as #150398)", kind="upgrade",
            applies=None if modern is None else not modern, what_if={"deferred_frees": "immediate"}))
    if owner == "fsdp":
        fixes.append(Fix(
            "fsdp-limit-all-gathers", versions=">=2.1 (FSDP2 >= 2.4)", source="pytorch/pytorch PRs #83666, #83917; github.com/pytorch/torchtitan/blob/main/docs/fsdp.md",
            kind="config", setting="limit_all_gathers=True"))
    if owner in ("collective", "user code", "unknown") or modern:
        fixes.append(Fix(
            "async-op-wait", versions="all", source="torch.Tensor.record_stream docs; pytorch/pytorch issue #124260 (awgu)",
            kind="code", applies=True if (owner == "user code" or modern) else None,
            what_if={"deferred_frees": "immediate"}))
    if owner == "point-to-point":
        fixes.append(Fix(
            "point-to-point-wait", versions="all", source="ProcessGroupNCCL.cpp pointToPoint", kind="code", applies=True))
    fixes.append(Fix(
        "expandable-segments-no-help", versions="all", source="measured on H200 GPUs with PyTorch 2.11: a two-rank tensor-parallel job that "
                               "all-reduces after each of 8 layers, with its inputs record_stream-ed, with "
                               "expandable segments too, and with a plain all_reduce", kind="config", applies=True,
        what_if={"config": "expandable_segments:True"}, measured=dict(NO_HELP_MEASURED)))
    return fixes


def detect(ctx: Context) -> list[Finding]:
    return [f for a in ctx.analyses if (f := detect_rank(a, ctx)) is not None]
