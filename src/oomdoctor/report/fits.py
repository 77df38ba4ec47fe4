"""What fits on the device: the room the allocator has, and the largest micro-batch that replays in it.

**Room** (:func:`device_room`): the most memory PyTorch's caching allocator could hold on this GPU, from
the best evidence, in order:

1. a memory cap (``set_per_process_memory_fraction``) in the sidecar: the allocator refuses beyond it;
2. an ``oom`` trace entry: the reserved bytes then plus ``device_free`` (``cudaMemGetInfo`` at the
   failure, ``CUDACachingAllocator.cpp`` ``malloc``): exactly what was there to take; unless the device
   still had the failed segment's bytes free, where a memory-fraction cap failed the request: the cap's
   lower end (:func:`oomdoctor.simulate.capacity.infer_capacity`, the peak reserved before the OOM), as
   ``oomdoctor simulate`` replays it;
3. the sidecar's ``device_free_bytes`` at the dump plus ``memory_stats``' reserved bytes then;
4. the GPU's total memory less what lives outside the allocator, estimated with the planner's measured
   constants (CUDA context, and NCCL's first communicator when the job is distributed:
   :data:`oomdoctor.plan.terms.CUDA_CONTEXT_BYTES`, ``NCCL_FIRST_COMMUNICATOR_BYTES``).

**Fits** (:func:`fits`): the largest scale of the micro-batch's tensors (the accounting's
``batch_scaled`` blocks) whose replay through the allocator model stays within the room less the margin
(:func:`oomdoctor.simulate.scale.largest_scale`, searched over the whole room: up to the room less the
margin filled with the growing blocks alone), under the recorded settings and with
``expandable_segments:True``; with the current micro-batch given, the largest whole micro-batch. The
replay keeps free the margin of a claim about the recorded steps (:mod:`.margin`: the model's error on
this trace, what the memory outside the allocator may grow by) plus the rounding of the blocks that grow
(:func:`job_margin`); the answer holds for inputs up to the heaviest recorded step. A trace cut by an OOM lacks the rest of its step: the
replay also keeps free the persistent memory the job created after the first step's peak (optimizer
state made lazily), or, when no step finished, the gradients the rest of the backward still makes (the
parameters' bytes less the gradients alive at the cut) and an estimate of the optimizer state still to come
(twice the parameters: Adam's two moments), said as such. A trace that ends inside its first forward pass is not
replayed as it is (the pass's peak is not in it: replaying such a trace once said 117 fits where 117 ran
out of memory); it gets a lower bound, said as one (``bound``: ``"lower"``), with its assumptions
(:func:`_first_forward_estimate`): what surely fits, never the recorded micro-batch or more.
An OOM inside ``generate()`` or evaluation is not sized (what the loop would still have made is not in
the trace); a run that generates and finished gets a lower bound from its peak reserved scaled with the batch
(:func:`_generation_estimate`), not a replay.
Where PyTorch's counters say the job's peak was above the recorded window's (a ring buffer dropped it), the
answer is held to the job's peak (:func:`job_peak_bound`); a trace starting mid-job without counters says that
the peaks before it are not known.
Also: what activation checkpointing could free at most (the activations at the peak), and what
sharding the optimizer state over the data-parallel ranks would (ZeRO-1 / FSDP: (1 - 1/world) of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..analysis.accounting import ACTIVATIONS, GRADIENTS, OPTIMIZER_STATE, PARAMETERS
from ..analysis.device import DeviceAnalysis
from ..analysis.phases import BACKWARD_PHASE, EVALUATION_PHASE, FORWARD_PHASE, GENERATION_PHASE
from ..ids import FITS_ASSUMPTIONS, FITS_NOTES, FitsAssumption, FitsNote, RoomSource
from ..trace.model import OOM
from .margin import MarginInputs, complete_steps
from .margin import margin as prediction_margin

# The planner (plan/) and the replay (simulate/) are imported where they are used: a report that replays
# nothing (a healthy run, no cap stated) does not pay for importing them (docs/benchmarks.md, start-up).
if TYPE_CHECKING:
    from ..simulate.capacity import Capacity
    from ..simulate.replay import Prepared, Validation


@dataclass(kw_only=True)
class Room:
    """The most the allocator could hold (bytes; None when nothing says), its ``source`` (an id of
    :data:`ROOM_SOURCES`, its numbers in ``values``; said in words by ``oomdoctor.render.words.fits``) and
    ``kind``: ``fraction`` (a cap), ``device`` (measured at the failure or the dump) or ``estimated``."""

    bytes: int | None
    kind: str
    source: RoomSource
    values: dict[str, Any] = field(default_factory=dict[str, Any])


# Where the room comes from: oomdoctor.ids.ROOM_SOURCES (the first rule of device_room that applies).


def device_room(a: DeviceAnalysis, outside_bytes: int | None = None) -> Room:
    """See the module doc (``outside_bytes``: the process's memory outside the allocator, rule 4). Pure. Outside
    memory is taken off the room here, once; the margin keeps free only what it may grow by
    (:func:`.margin.outside_allocator`)."""
    meta = a.trace.meta
    cap, source, values = None, None, {}
    if meta.get("memory_cap_bytes") is not None or meta.get("memory_fraction") is not None:
        from ..simulate.capacity import sidecar_cap

        cap, source, values = sidecar_cap(meta)
    if cap is not None:
        return Room(bytes=cap, kind="fraction", source="sidecar-cap",
                    values={"capacity_source": source, **values})
    if a.oom_events.size:
        from ..simulate.capacity import infer_capacity

        inferred = infer_capacity(a.trace, a.device)
        if inferred.kind == "fraction" and inferred.limit_bytes is not None:
            # the device still had the segment's bytes free at the OOM: a memory-fraction cap failed it, not the
            # device (simulate/capacity.py, rule 3); its lower end is the peak reserved before the OOM
            return Room(bytes=inferred.limit_bytes, kind="fraction", source="oom-fraction-cap")
        k = int(a.oom_events[-1])
        free = int(a.device.events["device_free"][k])
        if free >= 0:
            reserved = int(a.timeline.reserved[k])
            return Room(bytes=reserved + free, kind="device", source="oom-device")
    free = meta.get("device_free_bytes")  # sidecar fields' shapes are checked at load
    stats: dict[str, Any] = meta.get("memory_stats") or {}
    reserved = stats.get("reserved_bytes.all.current")
    if isinstance(free, int) and isinstance(reserved, int):
        return Room(bytes=free + reserved, kind="device", source="sidecar-free")
    total = meta.get("gpu_total_memory_bytes")
    if isinstance(total, int) and total > 0 and outside_bytes is not None:
        return Room(bytes=total - int(outside_bytes), kind="estimated", source="gpu-total-less-outside",
                    values={"given": bool(meta.get("gpu_total_memory_given")), "outside_bytes": int(outside_bytes)})
    if isinstance(total, int) and total > 0:
        from ..plan.terms import outside_allocator_bytes

        world = meta.get("world_size") or 1
        nccl, outside = world > 1, outside_allocator_bytes(world)
        return Room(bytes=total - outside, kind="estimated", source="gpu-total",
                    values={"given": bool(meta.get("gpu_total_memory_given")), "nccl": nccl})
    return Room(bytes=None, kind="none", source="none")


def room_capacity(room: Room, a: DeviceAnalysis | None = None) -> Capacity:
    """The capacity a what-fits replay runs under: the room, a fraction cap when the room is one; a cap the sidecar
    states holds from the first event it can have held at in ``a``'s trace (a cap set during the run:
    :func:`oomdoctor.simulate.capacity.limit_from_event`)."""
    from ..simulate.capacity import Capacity, limit_from_event

    start = (limit_from_event(a.device, room.bytes) if a is not None and room.source == "sidecar-cap"
             and room.bytes is not None else 0)
    return Capacity(limit_bytes=room.bytes, kind="fraction" if room.kind == "fraction" else "device",
                    source="device-room", source_values={"room_source": room.source, **room.values},
                    from_event=start)


@dataclass
class Fits:
    """What fits on this rank's device. Scales multiply the recorded micro-batch; None where the trace
    cannot say. Bytes.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema diagnose``), which
    :func:`oomdoctor.render.schema.generated` makes from this dataclass."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    room_bytes: int | None
    """what the allocator could use on this GPU (bytes)"""
    room_source: RoomSource
    """where the room comes from (the OOM message, the sidecar's device size, a memory fraction), in words (the
    dataclass holds an id, report/fits.py ROOM_SOURCES; its words: render/words/capacity.py)"""
    batch_scale: float | None = None
    """the largest multiple of the recorded micro-batch whose replay fits (recorded settings)"""
    largest_micro_batch: int | None = None
    """the largest whole micro-batch that fits, replayed (when the micro-batch is known)"""
    micro_batch: int | None = None
    """the recorded per-device micro-batch"""
    expandable_batch_scale: float | None = None
    """the same with expandable_segments:True"""
    expandable_largest_micro_batch: int | None = None
    """the same with expandable_segments:True"""
    batch_scaled_bytes_at_peak: int = 0
    """bytes at the peak that grow with the micro-batch (bytes)"""
    margin_bytes: int = 0
    """kept free in the replay: the margin of a claim about the recorded steps (margin) plus the rounding of the
    blocks that grow, and on a trace cut by its OOM the state still to come (bytes)"""
    #: the prediction margin's parts (:mod:`.margin`, bytes), included in ``margin_bytes``
    margin: dict[str, int] = field(default_factory=dict[str, int])
    """the margin's parts (report/margin.py: model_error_bytes, outside_bytes, the keys of a prediction's margin; all
    in margin_bytes), empty where no replay was tried"""
    checkpointing_frees_at_most_bytes: int = 0
    """activations saved for backward at the peak (what activation checkpointing frees at most) (bytes)"""
    sharding_optimizer_frees_bytes: int = 0
    """what sharding the optimizer state over the data-parallel ranks frees (bytes)"""
    replays: int = 0
    """allocator replays run to find the answer"""
    notes: list[FitsNote] = field(default_factory=list[FitsNote])
    """why an answer is missing, or what it assumes, in words (the dataclass holds ids, report/fits.py NOTES; their words:
    render/words/fits.py)"""
    #: the scale reached the top of the search (the room less the margin, filled with the blocks that grow alone):
    #: at least that much fits
    batch_scale_at_limit: bool = False
    """the search stopped at its upper limit: at least batch_scale fits"""
    expandable_at_limit: bool = False
    """the same for the expandable search"""
    #: a trace cut in its first forward pass: what fits estimated from the recorded part completed by the
    #: ``assumptions`` (never a replay of the whole step, so never in ``largest_micro_batch``)
    estimated_batch_scale: float | None = None
    """an estimate, not a replay (a trace cut in its first forward pass)"""
    estimated_largest_micro_batch: int | None = None
    """the estimate as a whole micro-batch"""
    assumptions: list[FitsAssumption] = field(default_factory=list[FitsAssumption])
    """what the estimate assumes, in words (the dataclass holds ids, report/fits.py ASSUMPTIONS; their words:
    render/words/fits.py)"""
    bound: str | None = None
    """lower: the estimate is a lower bound, what surely fits (a trace cut in its first forward pass);
    null: no estimate"""
    #: the peak the answer is held to: the job's own (PyTorch's counters) when above the recorded window's
    #: (:func:`job_peak_bound`), with its source (:data:`oomdoctor.analysis.jobpeak.PEAK_SOURCES`)
    job_peak_reserved_bytes: int | None = None
    """the job's own peak reserved the answer is held to (see the rank's) (bytes)"""
    peak_source: str = "trace"
    """where that peak comes from (see the rank's peak_source)"""
    #: the largest scale the job's peak allows, where the window missed it (None: not bounded by it)
    job_peak_scale_bound: float | None = None
    """where the recorded window missed the job's peak (reserved or allocated): the largest multiple of the
    micro-batch that peak allows, taking the job's bytes above the window's fixed ones to grow with the micro-batch;
    batch scales above it are cut to it"""
    note_values: dict[str, Any] = field(default_factory=dict[str, Any])
    """what the notes and assumptions are said with: replay_error (why the replay refused the trace, a note
    replay-failed), loss_copies and unseen_fragmentation_percent (the first-forward estimate's assumptions)"""
    room_source_values: dict[str, Any] = field(default_factory=dict[str, Any])
    """the numbers the room's source is said with: capacity_source, fraction, gpu_total_memory_bytes (a cap the
    sidecar states), given (the GPU's size came with --gpu-memory), nccl (NCCL's buffers were taken off)"""


NOTES = FITS_NOTES
"""The ids :attr:`Fits.notes` holds (:data:`oomdoctor.ids.FITS_NOTES`; their words: :data:`oomdoctor.render.words.fits.NOTES`)."""

ASSUMPTIONS = FITS_ASSUMPTIONS
"""The ids :attr:`Fits.assumptions` holds (:data:`oomdoctor.ids.FITS_ASSUMPTIONS`; their words:
:data:`oomdoctor.render.words.fits.ASSUMPTIONS`)."""


_GROWS: dict[int, tuple[DeviceAnalysis, np.ndarray]] = {}


def grows_with_batch(a: DeviceAnalysis) -> np.ndarray:
    """Per block (the lifetimes' rows): does its size grow with the micro-batch? The accounting's ``batch_scaled``
    (activations, temporaries, outputs and KV cache made by a pass), less the blocks the trace shows do not (issue 49:
    a MoCo job's 4 GiB memory bank and its clone were scaled with the batch, and what fits came out 30% low):

    - **state made in a pass**: a block made by a pass before the trace's last one, alive at the trace's end, whose
      size no later pass made again (a buffer created lazily in the first forward, a memory bank): per-batch tensors
      are made by every pass;
    - **a copy of persistent state**: a block the size of blocks that were alive before the trace's first pass and to
      its end and that no gradient has the size of (a registered buffer, a frozen table: not ``batch_scaled``, not a
      trained parameter; so only once a backward made gradients), made in every pass no more often than such blocks
      exist (``queue.clone()`` once per step).
      A batch-sized activation that matched a frozen weight's size would be made more often per pass than that
      weight exists (every layer makes its own); a trained weight's size is never taken (its gradient has it).

    Pure; kept per analysis (the replay asks several times)."""
    got = _GROWS.get(id(a))
    if got is not None and got[0] is a:
        return got[1]
    lt, acc, ph = a.lifetimes, a.accounting, a.phases
    grows = acc.batch_scaled.copy()
    rows = np.flatnonzero(grows & (lt.alloc >= 0))
    if rows.size and ph.pass_starts.size:
        end = lt.allocated_mask(a.num_events - 1)
        pass_of = ph.pass_of(lt.alloc[rows])
        last = int(ph.pass_of(a.num_events - 1))
        # state made in a pass: alive at the end, made before the last pass, its size never made again later
        for i in np.flatnonzero(end[rows] & (pass_of >= 0) & (pass_of < last)):
            r = rows[i]
            if not np.any((pass_of > pass_of[i]) & (lt.size[rows] == lt.size[r])):
                grows[r] = False
        # copies of persistent state made before the first pass; only where gradients were made (a backward ran):
        # before that, a trained weight's size cannot be told from a buffer's, and every block keeps growing
        first = int(ph.pass_starts[0])
        if not np.any(acc.category == GRADIENTS):
            first = -1
        before = ~acc.batch_scaled & (lt.alloc < first) & end & lt.allocated_mask(max(first - 1, 0))
        before &= ~np.isin(lt.size, lt.size[acc.category == GRADIENTS]) & (first >= 0)
        sizes, counts = np.unique(lt.size[before], return_counts=True)
        held = dict(zip(sizes.tolist(), counts.tolist()))
        for size, n in held.items():
            same = np.flatnonzero((lt.size[rows] == size) & (pass_of >= 0))
            if same.size and np.bincount(pass_of[same]).max() <= n:
                grows[rows[same]] = False
    _GROWS.clear()  # one analysis at a time: a fresh analysis replaces it
    _GROWS[id(a)] = (a, grows)
    return grows


def _scale_events(a: DeviceAnalysis) -> np.ndarray:
    """Events whose request grows with the micro-batch: allocations of the blocks that grow with it
    (:func:`grows_with_batch`), and an ``oom`` request made by a forward, backward or evaluation pass."""
    lt = a.lifetimes
    mask = np.zeros(a.num_events, dtype=bool)
    rows = np.flatnonzero(grows_with_batch(a) & (lt.alloc >= 0))
    mask[lt.alloc[rows]] = True
    ph = a.phases.phase
    oom = a.device.events["action"] == OOM
    mask |= oom & np.isin(ph, (FORWARD_PHASE, BACKWARD_PHASE, EVALUATION_PHASE))
    return mask


def job_margin(a: DeviceAnalysis) -> tuple[int, int]:
    """What the replay of a scaled micro-batch keeps free beyond the claim's margin (bytes), and the number of
    complete steps the trace holds: the allocator's rounding of every block that grows with the batch (up to 512
    bytes each, ``round_size``, ``c10/cuda/CUDACachingAllocator.cpp``): a scaled request is rounded up to whole
    bytes of its own, where the recorded one may have used its rounding. The spread of the job's step peaks is no
    part of it (issue 49): the replay runs those very steps; what they do not cover (longer inputs) is said as a
    condition (:mod:`.margin`)."""
    lt = a.lifetimes
    alive = lt.allocated_mask(a.peak_allocated[1]) & grows_with_batch(a)
    return 512 * int(np.count_nonzero(alive)), len(complete_steps(a))


def _margin(a: DeviceAnalysis, room: int) -> tuple[int, FitsNote | None]:
    """Bytes the replay keeps free (see the module doc) and a note id (:data:`NOTES`) when it is an estimate."""
    base = job_margin(a)[0]
    if not a.oom_events.size:
        return base, None
    lt, acc, ph = a.lifetimes, a.accounting, a.phases
    end = a.num_events - 1
    persistent = lt.allocated_mask(end) & ~grows_with_batch(a)
    steps = ph.steps
    if steps is not None and len(steps) >= 2:
        lo, hi = int(steps.starts[0]), int(steps.starts[1])
        seg = a.timeline.allocated[lo:hi]
        peak0 = lo + int(np.argmax(seg)) if seg.size else lo
        later = persistent & (lt.alloc > peak0) & (acc.category != PARAMETERS)
        return base + int(lt.size[later].sum()), None
    if ph.has_backward:
        # no step finished: the rest of the backward and the update are not in the trace. The backward still makes
        # the gradients not alive at the cut (every trained parameter has one of its size), and they are alive at
        # the peaks after it (GPipe's next micro-batch's backward: issue 49, pipeline-gpipe-b32 said 31 where 31
        # ran out); the update makes the optimizer state, Adam's two moments where none was seen
        params = int(lt.size[persistent & (acc.category == PARAMETERS)].sum())
        grads = int(lt.size[lt.allocated_mask(end) & (acc.category == GRADIENTS)].sum())
        extra = max(params - grads, 0)
        if np.any(acc.category[persistent] == OPTIMIZER_STATE):
            return base + extra, "gradients-assumed" if extra else None
        return base + extra + 2 * params, "optimizer-state-assumed"
    return base, None


def _pipeline_warm_up(a: DeviceAnalysis) -> bool:
    """Is the trace a pipeline stage cut in its first step's warm-up (:func:`_pass_seen` is False and the job runs a
    pipeline: :func:`oomdoctor.analysis.schedule.schedule_evidence`)? Its peak comes when every micro-batch the
    schedule holds in flight is (1F1B's first stage: one per later stage; GPipe: all), and how many that is the trace
    does not say: a lower bound from one pass and a mirrored backward would not be true (issue 49: stage 0 of a
    2-stage 1F1B was told "at least 52" where 52 ran out), so none is said."""
    from ..analysis.schedule import in_flight_parts, schedule_evidence

    k = int(a.oom_events[-1])
    _passes, recurrences = in_flight_parts(a.trace.stacks, a.lifetimes, a.accounting, a.phases, k)
    return schedule_evidence(a, recurrences) is not None


def _pass_seen(a: DeviceAnalysis) -> bool:
    """Before the OOM, did a forward pass run to its end (a backward began)? Otherwise the trace holds
    only the beginning of a pass and its peak is unknown."""
    return bool(np.any(a.phases.phase[: int(a.oom_events[-1]) + 1] == BACKWARD_PHASE))


LOSS_COPIES = 5
"""Blocks of the pass's output's size the loss still makes at its peak, after the output itself: the hf
planner's loss region at its peak, 12 bytes per bf16 logit (``plan/hf.py``: fp32 log-probabilities and their
gradient beside the logits), is six times the output; an assumption for any other model, said as such."""

RESERVED_OVER_ALLOCATED = 1.1243
"""The most a completed eager training run of the corpus reserves over what it allocates at its peak, at the largest
micro-batch its sweep ran (``benchmarks/margin_terms.py``, ``docs/margin_terms.json`` ``reserved_over_allocated``:
seven jobs, 1.0057 to 1.1243, the largest ``accelerate-ddp-llama`` at 72)."""
MIRRORED_RESERVED_OVER_ALLOCATED = 1.01
"""What the mirrored replay of a first-forward trace reserves over what it allocates at its peak (issue 35, measured
on the two first-forward corpus runs)."""
UNSEEN_FRAGMENTATION = RESERVED_OVER_ALLOCATED / MIRRORED_RESERVED_OVER_ALLOCATED - 1
"""At an OOM in the first forward pass, the blocks that grow with the micro-batch are replayed this much larger for the
lower bound (11.3%): the fragmentation of the steps after the first, which no trace of one pass holds, and which the
mirrored backward reproduces only in part. Derived (issue 49), no longer tuned: the most a completed eager run of the
corpus reserves over what it allocates at its peak (:data:`RESERVED_OVER_ALLOCATED`) over what the mirrored replay
does (:data:`MIRRORED_RESERVED_OVER_ALLOCATED`). Issue 35 had tuned 10% on the two first-forward runs (0% said 99 and
75 where 94 and 72 ran)."""


def _first_forward_estimate(a: DeviceAnalysis, room: Room, micro_batch: int | None, out: Fits,
                            inputs: MarginInputs | None = None) -> bool:
    """At an OOM inside the first forward pass: what fits, estimated by replaying the recorded part plus the
    rest of the step by assumption (:func:`~oomdoctor.simulate.extend.mirror_backward`): the failed request
    is the pass's output and the loss keeps :data:`LOSS_COPIES` more of it; every parameter is trained (its
    gradient has its size); the optimizer state still to come is the one seen, else Adam's two moments per
    parameter; the backward mirrors the forward. Fills ``out`` (reach ``estimate``); False when it cannot."""
    from ..simulate.extend import mirror_backward
    from ..simulate.replay import SimulationError, prepare
    from ..simulate.scale import largest_scale

    lt, acc = a.lifetimes, a.accounting
    k = int(a.oom_events[-1])
    alive = lt.allocated_mask(k - 1)
    first = a.phases.pass_starts[a.phases.pass_starts <= k]
    start = int(first[-1]) if first.size else None
    # what the cut pass made and still holds: its activations, and any other block of it that grows with the
    # micro-batch (a KV cache a forward with use_cache makes, a temporary): the backward frees them all; kept,
    # the next step's forward would make them a second time (accelerate Llama b128: 16 GiB of cache counted twice)
    held = (acc.category == ACTIVATIONS) | (grows_with_batch(a) & (lt.alloc >= (start or 0)))
    saved = np.flatnonzero(alive & held & (lt.alloc >= 0))
    if saved.size == 0:
        return False
    saved = saved[np.argsort(lt.alloc[saved], kind="stable")]
    params = lt.requested[alive & (acc.category == PARAMETERS)].tolist()
    has_state = bool(np.any(alive & (acc.category == OPTIMIZER_STATE)))
    est = mirror_backward(a.device, list(zip(lt.addr[saved].tolist(), lt.size[saved].tolist())), _scale_events(a),
                          LOSS_COPIES, params, [] if has_state else params + params, start)
    if est is None:
        return False
    margin = _with_prediction_margin(out, a, job_margin(a)[0], inputs=inputs)
    cap = room_capacity(room, a)
    grow = 1.0 + UNSEEN_FRAGMENTATION  # the replay's scale is the micro-batch's times this
    unit = grow / micro_batch if micro_batch else None
    # the recorded micro-batch ran out of memory: the bound is below it (one less, or 0.99 of it)
    top = grow * ((micro_batch - 1) / micro_batch if micro_batch and micro_batch > 1 else 0.99)
    try:  # the replay refuses what it does not model (as in fits(): cudaMallocAsync, a fraction without the GPU size)
        prepared = prepare(a.trace, est.device)
        r = largest_scale(prepared, est.scaled, cap, margin_bytes=margin, unit=unit, lo=0.02 * grow, hi=top,
                          tolerance=0.01 * grow)
    except SimulationError as e:
        out.notes.append("replay-failed")
        out.note_values["replay_error"] = str(e)
        return False
    out.replays += len(r.tried)
    out.assumptions = ["loss-copies", "parameters-trained",
                       "optimizer-state-seen" if has_state else "optimizer-state-adam",
                       "backward-mirrors-forward", "unseen-fragmentation"]
    out.note_values |= {"loss_copies": LOSS_COPIES,
                        "unseen_fragmentation_percent": round(100 * UNSEEN_FRAGMENTATION)}
    out.notes.append("first-forward-estimate")
    out.bound = "lower"
    if r.scale is None:
        return True
    s = r.scale / grow
    if micro_batch:  # a multiple of the unit: a whole micro-batch, never rounded up
        out.estimated_largest_micro_batch = int(math.floor(s * micro_batch + 1e-6))
        s = out.estimated_largest_micro_batch / micro_batch
    out.estimated_batch_scale = math.floor(s * 1000 + 1e-6) / 1000
    return True


def _generation_estimate(a: DeviceAnalysis, room: Room, micro_batch: int | None, out: Fits,
                         inputs: MarginInputs) -> bool:
    """What fits for a run that generates (``generate()``) and finished: a lower bound, not a replay (issue 35).

    A replay of one batch's generation scaled to another does not reproduce where the concatenated KV cache
    fragments (see :func:`fits`), but the job's own peak reserved ``P`` (the job's counters where the window
    missed it, :func:`oomdoctor.analysis.jobpeak.job_peak`) holds that fragmentation at the recorded batch. At a
    fixed prompt and ``max_new_tokens`` every byte of it above the blocks that do not grow with the batch
    (``fixed``: alive at the peak allocated and not ``batch_scaled``: parameters, buffers) is taken to grow in
    proportion to the batch: the cache is batch x tokens x bytes per token, and the cached-but-free blocks at
    the peak are that cache's earlier, one token shorter, copies (``torch.cat`` in ``DynamicLayer.update``), so
    the fragmentation is charged to the batch too. Scale ``s = (room - margin - fixed) / (P - fixed)``, floored
    to a whole micro-batch; ``margin``: the prediction margin (:mod:`.margin`). Measured on the corpus's
    ``generate-mha`` / ``generate-gqa`` runs that finished (docs/diagnose.md): 3310 where 3328 ran and 3584 ran out,
    10714 and 10745 where 10752 ran and 11264 ran out; their reserved / allocated ratio at the peak is 1.48 at
    8704, 10752 and 11264 alike. Not for a trace cut by an OOM (the tokens still to come are not in it) or
    one starting mid-job without PyTorch's counters (its peak may be missing). Fills ``out``'s estimate
    (``bound``: ``"lower"``); returns False where it says nothing."""
    if a.oom_events.size or room.bytes is None:
        return False
    jp = a.job_peak
    if jp.source == "unknown-before-window":
        return False
    lt = a.lifetimes
    alive = lt.allocated_mask(a.peak_allocated[1])
    fixed = int(lt.size[alive & ~grows_with_batch(a)].sum())
    peak = max(a.peak_reserved[0], jp.job_peak_reserved_bytes or 0)
    if peak <= fixed:
        return False
    margin = _with_prediction_margin(out, a, job_margin(a)[0], inputs=inputs)
    s = (room.bytes - margin - fixed) / (peak - fixed)
    if s <= 0:
        return False
    if micro_batch:  # a whole micro-batch, never rounded up
        out.estimated_largest_micro_batch = int(math.floor(s * micro_batch + 1e-6)) or None
        s = (out.estimated_largest_micro_batch or 0) / micro_batch
    if s <= 0:
        return False
    out.estimated_batch_scale = math.floor(s * 1000 + 1e-6) / 1000
    out.bound = "lower"
    out.assumptions = ["generate-settings-kept", "generate-peak-grows"]
    out.notes.append("generate-estimate")
    return True


def _reproduced(a: DeviceAnalysis, prepared: Prepared, cap: Capacity) -> tuple[bool, int]:
    """Does the replay of the recorded settings, unscaled, under ``cap``, do what the recording did
    (the same OOM, or none)? Predictions are only as good as that. Also the replay's largest reserved
    difference from the recording (bytes: the model's error on this trace, part of the margin)."""
    from ..simulate.replay import replay

    r = replay(prepared, capacity=cap, validate=True)
    v = r.validation
    return reproduces(v, bool(a.oom_events.size)), (v.max_reserved_difference_bytes if v is not None else 0)


def reproduces(v: Validation | None, cut: bool) -> bool:
    """Does a self-replay with validation ``v`` (:class:`~oomdoctor.simulate.replay.Validation`) do what the
    recording did: the same OOM, or none; and, for a trace not cut by an OOM, the same segments or the same
    reserved bytes after every event. The latter is what what-fits and the predictions compare with the room:
    segments mapped at other addresses (a 2-rank FSDP2 trace with expandable segments: 55 of 283 segment
    events at other addresses, every reserved byte the same) change no claim."""
    return v is not None and v.oom_matches and (v.segment_events_differing == 0 or v.reserved_events_differing == 0
                                                or cut)


def _search_top(room: int, margin: int, grows: int, lo: float) -> float:
    """The top of the search (a scale): the room less the margin filled with the blocks that grow with the
    batch at the peak (``grows`` bytes) alone; no larger scale can fit, whatever else is alive."""
    return max(lo, (room - margin) / max(grows, 1))


def _with_prediction_margin(out: Fits, a: DeviceAnalysis, base: int, model_error: int = 0,
                            inputs: MarginInputs | None = None) -> int:
    """``base`` plus the margin of a claim about the recorded steps (:func:`.margin.margin`, with ``inputs``: its
    ``outside_bytes`` / ``job_peak_reserved_bytes``: the model's error on this trace and the memory outside the
    allocator not already off the room); fills ``out.margin`` and ``out.margin_bytes``. The job's own peak above
    the trace's is :func:`job_peak_bound`'s, not the margin's."""
    none_said = MarginInputs(outside_bytes=None, job_peak_reserved_bytes=None)  # margin()'s defaults
    m = prediction_margin(a, model_error_bytes=model_error, **(inputs or none_said))
    out.margin = cast("dict[str, int]", dict(m.parts()))  # MarginParts: a TypedDict of ints
    out.margin_bytes = base + m.bytes
    return out.margin_bytes


def fits(a: DeviceAnalysis, room: Room, micro_batch: int | None = None, *, recorded: bool = True,
         expandable: bool = True, outside_bytes: int | None = None, job_peak_reserved_bytes: int | None = None
         ) -> Fits:
    """What fits on ``a``'s device (see the module doc): under the recorded settings (``recorded``) and
    with expandable segments (``expandable``). Pure; a few replays of the trace (bisection from a guess
    made of the peak: the fixed bytes plus the scaled ones times the scale). ``outside_bytes`` and
    ``job_peak_reserved_bytes``: what a sidecar says of the memory outside the allocator and of the job's own
    peak reserved, for the margin (:func:`.margin.margin`)."""
    inputs: MarginInputs = {"outside_bytes": outside_bytes, "job_peak_reserved_bytes": job_peak_reserved_bytes}
    from ..simulate.replay import SimulationError, prepare
    from ..simulate.scale import largest_scale

    out = Fits(room.bytes, room.source, micro_batch=micro_batch, room_source_values=dict(room.values))
    jp = a.job_peak
    out.job_peak_reserved_bytes, out.peak_source = jp.job_peak_reserved_bytes, jp.source
    if a.num_events == 0:
        out.notes.append("no-history")
        return out
    lt, acc = a.lifetimes, a.accounting
    alive = lt.allocated_mask(a.peak_allocated[1])
    out.batch_scaled_bytes_at_peak = int(lt.size[alive & grows_with_batch(a)].sum())
    out.checkpointing_frees_at_most_bytes = int(lt.size[alive & (acc.category == ACTIVATIONS)].sum())
    world = a.trace.meta.get("world_size")
    if world and world > 1:  # the optimizer state at the peak or, made later, at the end
        state = acc.category == OPTIMIZER_STATE
        most = max(int(lt.size[alive & state].sum()), int(lt.size[lt.allocated_mask(a.num_events - 1) & state].sum()))
        out.sharding_optimizer_frees_bytes = int(most * (1 - 1 / world))
    if room.bytes is None:
        out.notes.append("room-unknown")
        return out
    if out.batch_scaled_bytes_at_peak == 0:
        out.notes.append("nothing-grows")
        return out
    if a.oom_events.size and a.phases.phase[int(a.oom_events[-1])] in (GENERATION_PHASE, EVALUATION_PHASE):
        out.notes.append("cut-in-inference")
        return out
    if np.any(a.phases.phase == GENERATION_PHASE):
        if _generation_estimate(a, room, micro_batch, out, inputs):
            return out
        out.notes.append("generate-not-replayed")
        return out
    if a.oom_events.size and not _pass_seen(a):
        if _pipeline_warm_up(a):
            out.notes.append("pipeline-warm-up")
        elif a.phases.has_backward or not _first_forward_estimate(a, room, micro_batch, out, inputs):
            out.notes.append("cut-in-first-forward")
        return out
    margin, note = _margin(a, room.bytes)
    if note:
        out.notes.append(note)
    try:
        prepared = prepare(a.trace, a.device, a.lifetimes)
    except SimulationError as e:
        out.notes.append("replay-failed")
        out.note_values["replay_error"] = str(e)
        return out
    if prepared.external or prepared.external_start:
        # simulate/pools.py: a private pool is replayed as recorded, so it would not grow with the batch
        out.notes.append("private-pools")
        return out
    events = _scale_events(a)
    cap = room_capacity(room, a)
    reproduced, model_error = _reproduced(a, prepared, cap)
    margin = _with_prediction_margin(out, a, margin, model_error, inputs)
    if not reproduced:
        out.notes.append("not-reproduced")
        return out
    unit = 1.0 / micro_batch if micro_batch else None
    # a run that finished at this micro-batch fits it: search above it
    lo = 1.0 if not a.oom_events.size else 0.05
    hi = _search_top(room.bytes, margin, out.batch_scaled_bytes_at_peak, lo)
    fixed = a.peak_reserved[0] - out.batch_scaled_bytes_at_peak
    est = max((room.bytes - margin - fixed) / out.batch_scaled_bytes_at_peak, lo)
    guess = (est * 0.9, est * 1.05)
    try:
        if recorded:
            r = largest_scale(prepared, events, cap, margin_bytes=margin, unit=unit, lo=lo, hi=hi, guess=guess)
            out.replays += len(r.tried)
            if r.scale is None and not a.oom_events.size:
                r.scale = 1.0  # the recorded micro-batch ran; the replay finds no room for more
            out.batch_scale = None if r.scale is None else round(r.scale, 3)
            out.batch_scale_at_limit = r.scale is not None and r.scale >= hi - 1e-9
            if micro_batch and r.scale is not None:
                out.largest_micro_batch = int(round(r.scale * micro_batch))
        if expandable:
            config = replace(prepared.recorded_config, expandable_segments=True)
            e = largest_scale(prepared, events, cap, config=config, margin_bytes=margin, unit=unit, lo=lo, hi=hi,
                              guess=(est * 0.95, est * 1.1))
            out.replays += len(e.tried)
            if e.scale is None and not a.oom_events.size:
                e.scale = 1.0
            out.expandable_batch_scale = None if e.scale is None else round(e.scale, 3)
            out.expandable_at_limit = e.scale is not None and e.scale >= hi - 1e-9
            if micro_batch and e.scale is not None:
                out.expandable_largest_micro_batch = int(round(e.scale * micro_batch))
    except SimulationError as e:
        out.notes.append("replay-failed")
        out.note_values["replay_error"] = str(e)
    job_peak_bound(a, room.bytes, margin, fixed, out)
    return out


def job_peak_bound(a: DeviceAnalysis, room: int, margin: int, fixed: int, out: Fits) -> None:
    """Hold the replay's answer to the job's own peak (issue 41). The replay sees only the recorded window; where
    PyTorch's counters say the job reserved (or allocated) more before it (``peak_source`` sidecar or memory_stats
    file, :mod:`oomdoctor.analysis.jobpeak`), the scale is bounded by ``(room - margin - fixed) / (job peak - fixed)``,
    ``fixed`` the window's peak reserved (allocated) bytes that do not grow with the micro-batch: all the job's bytes
    above them are taken to grow with it (the prefill's activations and logits do), the smaller bound of the two. A run that finished keeps at least its own micro-batch (scale 1). Without counters, a trace that
    starts mid-job keeps the window's answer, with a note that the peaks before it are not known. Bytes."""
    jp = a.job_peak
    if jp.source == "unknown-before-window" and (out.batch_scale is not None or out.expandable_batch_scale is not None):
        out.notes.append("peaks-before-window-unknown")
        return
    bounds: list[float] = []
    if jp.reserved_missed and jp.job_peak_reserved_bytes is not None and jp.job_peak_reserved_bytes > fixed:
        bounds.append((room - margin - fixed) / (jp.job_peak_reserved_bytes - fixed))
    fixed_allocated = jp.window_peak_allocated_bytes - out.batch_scaled_bytes_at_peak
    if (jp.allocated_missed and jp.job_peak_allocated_bytes is not None
            and jp.job_peak_allocated_bytes > fixed_allocated):
        bounds.append((room - margin - fixed_allocated) / (jp.job_peak_allocated_bytes - fixed_allocated))
    if not bounds:
        return
    bound = max(min(bounds), 0.0)
    if not a.oom_events.size:
        bound = max(bound, 1.0)  # it ran
    out.job_peak_scale_bound = round(bound, 3)
    held = False
    if out.batch_scale is not None and out.batch_scale > bound:
        out.batch_scale, out.batch_scale_at_limit, held = round(bound, 3), False, True
        if out.micro_batch:
            out.largest_micro_batch = max(int(bound * out.micro_batch), 1 if bound >= 1 else 0) or None
    if out.expandable_batch_scale is not None and out.expandable_batch_scale > bound:
        out.expandable_batch_scale, out.expandable_at_limit, held = round(bound, 3), False, True
        if out.micro_batch:
            out.expandable_largest_micro_batch = max(int(bound * out.micro_batch), 1 if bound >= 1 else 0) or None
    if held:
        out.notes.append("held-to-job-peak")
