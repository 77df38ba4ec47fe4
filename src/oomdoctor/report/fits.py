"""What fits on the device: the room the allocator has, and the largest micro-batch that replays in it.

**Room** (:func:`device_room`): the most memory PyTorch's caching allocator could hold on this GPU, from
the best evidence, in order:

1. a memory cap (``set_per_process_memory_fraction``) in the sidecar: the allocator refuses beyond it;
2. an ``oom`` trace entry: the reserved bytes then plus ``device_free`` (``cudaMemGetInfo`` at the
   failure, ``CUDACachingAllocator.cpp`` ``malloc``): exactly what was there to take;
3. the sidecar's ``device_free_bytes`` at the dump plus ``memory_stats``' reserved bytes then;
4. the GPU's total memory less what lives outside the allocator, estimated with the planner's measured
   constants (CUDA context, and NCCL's first communicator when the job is distributed:
   :data:`oomdoctor.plan.terms.CUDA_CONTEXT_BYTES`, ``NCCL_FIRST_COMMUNICATOR_BYTES``).

**Fits** (:func:`fits`): the largest scale of the micro-batch's tensors (the accounting's
``batch_scaled`` blocks) whose replay through the allocator model stays within the room
(:func:`oomdoctor.simulate.scale.largest_scale`), under the recorded settings and with
``expandable_segments:True``; with the current micro-batch given, the largest whole micro-batch. The
replay keeps free what the job itself says varies (:func:`job_margin`: the spread of its complete steps'
peaks, plus the rounding of the blocks that grow). A trace cut by an OOM lacks the rest of its step: the
replay also keeps free the persistent memory the job created after the first step's peak (optimizer
state made lazily), or, when no step finished, an estimate of the optimizer state still to come (twice
the parameters: Adam's two moments, said as such). A trace that ends inside its first forward pass is not
replayed as it is (the pass's peak is not in it: replaying such a trace once said 117 fits where 117 ran
out of memory); it gets an estimate, said as one, with its assumptions (:func:`_first_forward_estimate`).
An OOM inside ``generate()`` or evaluation is not sized (what the loop would still have made is not in
the trace).
Also: what activation checkpointing could free at most (the activations at the peak), and what
sharding the optimizer state over the data-parallel ranks would (ZeRO-1 / FSDP: (1 - 1/world) of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from ..analysis.accounting import ACTIVATIONS, OPTIMIZER_STATE, PARAMETERS
from ..analysis.device import DeviceAnalysis
from ..analysis.phases import BACKWARD_PHASE, EVALUATION_PHASE, FORWARD_PHASE, GENERATION_PHASE
from ..trace.model import OOM

# The planner (plan/) and the replay (simulate/) are imported where they are used: a report that replays
# nothing (a healthy run, no cap stated) does not pay for importing them (docs/benchmarks.md, start-up).
if TYPE_CHECKING:
    from ..simulate.capacity import Capacity


@dataclass
class Room:
    """The most the allocator could hold (bytes; None when nothing says), its ``source`` in words and
    ``kind``: ``fraction`` (a cap), ``device`` (measured at the failure or the dump) or ``estimated``."""

    bytes: int | None
    kind: str
    source: str


def device_room(a: DeviceAnalysis) -> Room:
    """See the module doc. Pure."""
    meta = a.trace.meta
    cap, source = None, ""
    if meta.get("memory_cap_bytes") is not None or meta.get("memory_fraction") is not None:
        from ..simulate.capacity import sidecar_cap

        cap, source = sidecar_cap(meta)
    if cap is not None:
        return Room(cap, "fraction", f"set_per_process_memory_fraction: {source}")
    if a.oom_events.size:
        k = int(a.oom_events[-1])
        free = int(a.device.events["device_free"][k])
        if free >= 0:
            reserved = int(a.timeline.reserved[k])
            return Room(reserved + free, "device", "the OOM: reserved bytes then plus the device's free bytes "
                                                   "(cudaMemGetInfo)")
    free = meta.get("device_free_bytes")  # sidecar fields' shapes are checked at load
    reserved = (meta.get("memory_stats") or {}).get("reserved_bytes.all.current")
    if isinstance(free, int) and isinstance(reserved, int):
        return Room(free + reserved, "device", "the sidecar: free device bytes at the dump plus reserved bytes then")
    total = meta.get("gpu_total_memory_bytes")
    if isinstance(total, int) and total > 0:
        from ..plan.terms import CUDA_CONTEXT_BYTES, NCCL_FIRST_COMMUNICATOR_BYTES

        outside = CUDA_CONTEXT_BYTES + (NCCL_FIRST_COMMUNICATOR_BYTES if (meta.get("world_size") or 1) > 1 else 0)
        return Room(total - outside, "estimated", "the GPU's total memory less the CUDA context"
                    + (" and NCCL's buffers" if outside > CUDA_CONTEXT_BYTES else "") + " (planner constants)")
    return Room(None, "none", "unknown: no OOM and no sidecar with the GPU's memory")


@dataclass
class Fits:
    """What fits on this rank's device. Scales multiply the recorded micro-batch; None where the trace
    cannot say. Bytes."""

    room_bytes: int | None
    room_source: str
    batch_scale: float | None = None
    largest_micro_batch: int | None = None
    micro_batch: int | None = None
    expandable_batch_scale: float | None = None
    expandable_largest_micro_batch: int | None = None
    batch_scaled_bytes_at_peak: int = 0
    margin_bytes: int = 0
    checkpointing_frees_at_most_bytes: int = 0
    sharding_optimizer_frees_bytes: int = 0
    replays: int = 0
    notes: list[str] = field(default_factory=list)
    #: the scale reached the top of the search (:data:`~oomdoctor.simulate.scale.SEARCH_MAX`): at least that much fits
    batch_scale_at_limit: bool = False
    expandable_at_limit: bool = False
    #: a trace cut in its first forward pass: what fits estimated from the recorded part completed by the
    #: ``assumptions`` (never a replay of the whole step, so never in ``largest_micro_batch``)
    estimated_batch_scale: float | None = None
    estimated_largest_micro_batch: int | None = None
    assumptions: list[str] = field(default_factory=list)


def _scale_events(a: DeviceAnalysis) -> np.ndarray:
    """Events whose request grows with the micro-batch: allocations of batch-scaled blocks, and an
    ``oom`` request made by a forward, backward or evaluation pass."""
    lt, acc = a.lifetimes, a.accounting
    mask = np.zeros(a.num_events, dtype=bool)
    rows = np.flatnonzero(acc.batch_scaled & (lt.alloc >= 0))
    mask[lt.alloc[rows]] = True
    ph = a.phases.phase
    oom = a.device.events["action"] == OOM
    mask |= oom & np.isin(ph, (FORWARD_PHASE, BACKWARD_PHASE, EVALUATION_PHASE))
    return mask


def job_margin(a: DeviceAnalysis) -> tuple[int, str]:
    """What the job itself says the replay should keep free (bytes), and how it was read: how much the peak of
    allocated memory moved from step to step over the steps that completed (the run-to-run wobble of the
    same work: allocation order, caches made lazily), plus the allocator's rounding of every block that
    grows with the batch (up to 512 bytes each, ``round_size``). With fewer than two complete steps there is
    no spread to read, and only the rounding is kept."""
    lt, acc = a.lifetimes, a.accounting
    alive = lt.allocated_mask(a.peak_allocated[1]) & acc.batch_scaled
    rounding = 512 * int(np.count_nonzero(alive))
    steps = a.steps
    if steps is None or len(steps) < 3:  # the first step creates state; at least two more are needed
        return rounding, "rounding of the blocks that grow with the batch (fewer than two complete steps to compare)"
    bounds = steps.starts.tolist() + [a.num_events]
    complete = range(1, len(bounds) - (2 if a.oom_events.size else 1))
    peaks = [int(a.timeline.allocated[bounds[i]:bounds[i + 1]].max()) for i in complete
             if bounds[i + 1] > bounds[i]]
    if len(peaks) < 2:
        return rounding, "rounding of the blocks that grow with the batch (fewer than two complete steps to compare)"
    return max(peaks) - min(peaks) + rounding, (f"spread of the peak allocated over {len(peaks)} complete steps, plus "
                                                "the rounding of the blocks that grow with the batch")


def _margin(a: DeviceAnalysis, room: int) -> tuple[int, str | None]:
    """Bytes the replay keeps free (see the module doc) and a note when it is an estimate."""
    base, _how = job_margin(a)
    if not a.oom_events.size:
        return base, None
    lt, acc, ph = a.lifetimes, a.accounting, a.phases
    end = a.num_events - 1
    persistent = lt.allocated_mask(end) & ~acc.batch_scaled
    steps = ph.steps
    if steps is not None and len(steps) >= 2:
        lo, hi = int(steps.starts[0]), int(steps.starts[1])
        seg = a.timeline.allocated[lo:hi]
        peak0 = lo + int(np.argmax(seg)) if seg.size else lo
        later = persistent & (lt.alloc > peak0) & (acc.category != PARAMETERS)
        return base + int(lt.size[later].sum()), None
    if ph.has_backward and not np.any(acc.category[persistent] == OPTIMIZER_STATE):
        params = int(lt.size[persistent & (acc.category == PARAMETERS)].sum())
        return base + 2 * params, ("no optimizer step finished before the OOM: the replay keeps room for optimizer "
                                   "state of twice the parameters (Adam's two moments)")
    return base, None


def _pass_seen(a: DeviceAnalysis) -> bool:
    """Before the OOM, did a forward pass run to its end (a backward began)? Otherwise the trace holds
    only the beginning of a pass and its peak is unknown."""
    return bool(np.any(a.phases.phase[: int(a.oom_events[-1]) + 1] == BACKWARD_PHASE))


LOSS_COPIES = 5
"""Blocks of the pass's output's size the loss still makes at its peak, after the output itself: the hf
planner's loss region at its peak, 12 bytes per bf16 logit (``plan/hf.py``: fp32 log-probabilities and their
gradient beside the logits), is six times the output; an assumption for any other model, said as such."""


def _first_forward_estimate(a: DeviceAnalysis, room: Room, micro_batch: int | None, out: Fits) -> bool:
    """At an OOM inside the first forward pass: what fits, estimated by replaying the recorded part plus the
    rest of the step by assumption (:func:`~oomdoctor.simulate.extend.mirror_backward`): the failed request
    is the pass's output and the loss keeps :data:`LOSS_COPIES` more of it; every parameter is trained (its
    gradient has its size); the optimizer state still to come is the one seen, else Adam's two moments per
    parameter; the backward mirrors the forward. Fills ``out`` (reach ``estimate``); False when it cannot."""
    from ..simulate.capacity import Capacity
    from ..simulate.extend import mirror_backward
    from ..simulate.replay import SimulationError, prepare
    from ..simulate.scale import largest_scale

    lt, acc = a.lifetimes, a.accounting
    k = int(a.oom_events[-1])
    alive = lt.allocated_mask(k - 1)
    saved = np.flatnonzero(alive & (acc.category == ACTIVATIONS) & (lt.alloc >= 0))
    if saved.size == 0:
        return False
    saved = saved[np.argsort(lt.alloc[saved], kind="stable")]
    params = lt.requested[alive & (acc.category == PARAMETERS)].tolist()
    has_state = bool(np.any(alive & (acc.category == OPTIMIZER_STATE)))
    first = a.phases.pass_starts[a.phases.pass_starts <= k]
    est = mirror_backward(a.device, list(zip(lt.addr[saved].tolist(), lt.size[saved].tolist())), _scale_events(a),
                          LOSS_COPIES, params, [] if has_state else params + params,
                          int(first[-1]) if first.size else None)
    if est is None:
        return False
    margin, _how = job_margin(a)
    out.margin_bytes = margin
    cap = Capacity(room.bytes, "fraction" if room.kind == "fraction" else "device", room.source)
    unit = 1.0 / micro_batch if micro_batch else None
    try:  # the replay refuses what it does not model (as in fits(): cudaMallocAsync, a fraction without the GPU size)
        prepared = prepare(a.trace, est.device)
        r = largest_scale(prepared, est.scaled, cap, margin_bytes=margin, unit=unit, lo=0.02, hi=1.0)
    except SimulationError as e:
        out.notes.append(f"the trace cannot be replayed: {e}")
        return False
    out.replays += len(r.tried)
    out.assumptions = [
        "the failed request is the pass's output, and the loss keeps "
        f"{LOSS_COPIES} more blocks of its size at its peak (the planner's loss region of a language model)",
        "every parameter is trained: its gradient has its size",
        "the optimizer state seen" if has_state else "the optimizer state to come is Adam's: two moments per parameter",
        "the backward mirrors the forward: it frees what the forward saved, last first, making a gradient of the "
        "same size for each; then the next step's forward runs as recorded, into the cache that backward left",
    ]
    out.notes.append("the trace ends inside its first forward pass: what fits is an estimate from the recorded part "
                     "and the assumptions listed, not a replay of the whole step")
    if r.scale is None:
        return True
    out.estimated_batch_scale = round(r.scale, 3)
    if micro_batch:
        out.estimated_largest_micro_batch = int(round(r.scale * micro_batch))
    return True


def _reproduced(a: DeviceAnalysis, prepared, cap: Capacity) -> bool:
    """Does the replay of the recorded settings, unscaled, under ``cap``, do what the recording did
    (the same OOM, or none)? Predictions are only as good as that."""
    from ..simulate.replay import replay

    r = replay(prepared, capacity=cap, validate=True)
    return r.validation is not None and r.validation.oom_matches and (
        r.validation.segment_events_differing == 0 or bool(a.oom_events.size))


def fits(a: DeviceAnalysis, room: Room, micro_batch: int | None = None, *, recorded: bool = True,
         expandable: bool = True) -> Fits:
    """What fits on ``a``'s device (see the module doc): under the recorded settings (``recorded``) and
    with expandable segments (``expandable``). Pure; a few replays of the trace (bisection from a guess
    made of the peak: the fixed bytes plus the scaled ones times the scale)."""
    from ..simulate.capacity import Capacity
    from ..simulate.replay import SimulationError, prepare
    from ..simulate.scale import SEARCH_MAX, largest_scale

    out = Fits(room.bytes, room.source, micro_batch=micro_batch)
    if a.num_events == 0:
        out.notes.append("no allocation history: nothing to replay")
        return out
    lt, acc = a.lifetimes, a.accounting
    alive = lt.allocated_mask(a.peak_allocated[1])
    out.batch_scaled_bytes_at_peak = int(lt.size[alive & acc.batch_scaled].sum())
    out.checkpointing_frees_at_most_bytes = int(lt.size[alive & (acc.category == ACTIVATIONS)].sum())
    world = a.trace.meta.get("world_size")
    if world and world > 1:  # the optimizer state at the peak or, made later, at the end
        state = acc.category == OPTIMIZER_STATE
        most = max(int(lt.size[alive & state].sum()), int(lt.size[lt.allocated_mask(a.num_events - 1) & state].sum()))
        out.sharding_optimizer_frees_bytes = int(most * (1 - 1 / world))
    if room.bytes is None:
        out.notes.append("the device's size is unknown (no OOM, no sidecar): what fits cannot be replayed")
        return out
    if out.batch_scaled_bytes_at_peak == 0:
        out.notes.append("no tensor of the trace grows with the micro-batch (no forward or backward pass seen)")
        return out
    if a.oom_events.size and a.phases.phase[int(a.oom_events[-1])] in (GENERATION_PHASE, EVALUATION_PHASE):
        out.notes.append("the trace ends inside an inference loop (generate() or evaluation): what it would still have "
                         "made (the cache grows with every token to come) is not recorded, so what fits is not "
                         "replayed; diagnose a run that finished, with --micro-batch")
        return out
    if np.any(a.phases.phase == GENERATION_PHASE):
        out.notes.append("generate() grows its KV cache one token at a time by concatenation, and the caching "
                         "allocator's fragmentation of those caches decides where a larger batch runs out; a replay "
                         "of one batch's generation scaled to another does not reproduce it (measured: it said "
                         "11,871 fit where 11,264 ran out), so what fits is not replayed: lower the batch or "
                         "max_new_tokens, or use a static cache")
        return out
    if a.oom_events.size and not _pass_seen(a):
        if a.phases.has_backward or not _first_forward_estimate(a, room, micro_batch, out):
            out.notes.append("the trace ends inside its first forward pass: the rest of that pass is not in it, so what "
                             "fits cannot be replayed from it; record a run that fits and diagnose it with "
                             "--micro-batch")
        return out
    margin, note = _margin(a, room.bytes)
    out.margin_bytes = margin
    if note:
        out.notes.append(note)
    try:
        prepared = prepare(a.trace, a.device, a.lifetimes)
    except SimulationError as e:
        out.notes.append(f"the trace cannot be replayed: {e}")
        return out
    if prepared.external or prepared.external_start:
        # simulate/pools.py: a private pool is replayed as recorded, so it would not grow with the batch
        out.notes.append("CUDA graph private pools (e.g. torch.compile mode='reduce-overhead') hold part of this "
                         "run's memory and are replayed as recorded, not scaled with the micro-batch: what fits is "
                         "not replayed")
        return out
    events = _scale_events(a)
    cap = Capacity(room.bytes, "fraction" if room.kind == "fraction" else "device", room.source)
    if not _reproduced(a, prepared, cap):
        out.notes.append("the allocator model does not reproduce this recording under the device's room: what fits "
                         "is not replayed")
        return out
    unit = 1.0 / micro_batch if micro_batch else None
    # a run that finished at this micro-batch fits it: search above it
    lo = 1.0 if not a.oom_events.size else 0.05
    fixed = a.peak_reserved[0] - out.batch_scaled_bytes_at_peak
    est = max((room.bytes - margin - fixed) / out.batch_scaled_bytes_at_peak, lo)
    guess = (est * 0.9, est * 1.05)
    try:
        if recorded:
            r = largest_scale(prepared, events, cap, margin_bytes=margin, unit=unit, lo=lo, guess=guess)
            out.replays += len(r.tried)
            if r.scale is None and not a.oom_events.size:
                r.scale = 1.0  # the recorded micro-batch ran; the replay finds no room for more
            out.batch_scale = None if r.scale is None else round(r.scale, 3)
            out.batch_scale_at_limit = r.scale is not None and r.scale >= SEARCH_MAX - 1e-9
            if micro_batch and r.scale is not None:
                out.largest_micro_batch = int(round(r.scale * micro_batch))
        if expandable:
            config = replace(prepared.recorded_config, expandable_segments=True)
            e = largest_scale(prepared, events, cap, config=config, margin_bytes=margin, unit=unit, lo=lo,
                              guess=(est * 0.95, est * 1.1))
            out.replays += len(e.tried)
            if e.scale is None and not a.oom_events.size:
                e.scale = 1.0
            out.expandable_batch_scale = None if e.scale is None else round(e.scale, 3)
            out.expandable_at_limit = e.scale is not None and e.scale >= SEARCH_MAX - 1e-9
            if micro_batch and e.scale is not None:
                out.expandable_largest_micro_batch = int(round(e.scale * micro_batch))
    except SimulationError as e:
        out.notes.append(f"the trace cannot be replayed: {e}")
    return out
