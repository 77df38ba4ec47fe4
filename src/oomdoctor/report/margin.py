"""The margin of a prediction: how far from the room a replayed peak must stay to be believed.

Every claim the allocator model makes about a run that did not happen (a setting's outcome, the rest of a
step cut by its OOM, the largest micro-batch that fits) is a replayed peak compared with the room the
allocator had (:func:`.fits.device_room`). The replay is exact only for the events recorded, under the model's
rules, on the memory the caching allocator sees; a rerun differs by what those leave out. The margin is that
difference, in bytes, read from the job itself (:func:`margin`), as the sum of:

- ``step_variation_bytes``: the job's own step-to-step variation: max - min of the per-step peak allocated and
  of the per-step peak reserved over its complete steps (the first step, which creates state, and a step cut by
  an OOM are not complete; ``analysis/phases.py`` finds the steps), the larger of the two. The same work moved
  that much between steps of this very run.
- ``model_error_bytes``: the allocator model's measured error on this trace: the largest difference of
  reserved bytes between the self-replay (recorded settings, :func:`..simulate.replay.replay` with
  ``validate``) and the recording, after any event (``Validation.max_reserved_difference_bytes``); 0 when the
  self-replay is exact.
- ``extension_bytes``: for a claim about a step extended by replaying the previous step
  (:mod:`..simulate.extend`): the largest rise of the peak reserved from one complete step to the next. The
  replays of consecutive steps differ by it (they equal the recording's where the self-replay is exact, and
  are within ``model_error_bytes`` of it otherwise, counted already). Counted only for extended claims
  (:meth:`Margin.for_claim`).
- ``outside_bytes``: what the caching allocator does not see: the CUDA context, NCCL's buffers, cuBLAS / cuDNN
  workspaces and kernels loaded lazily. The room was read once (at the OOM: reserved + ``cudaMemGetInfo``'s
  free bytes, ``CUDACachingAllocator.cpp`` ``malloc``); that memory is allocated lazily and differs from run to
  run, so as much again is kept free. Read, in order: given by the caller (a sidecar with the process's own
  usage); the OOM message's "this process has X memory in use" less what PyTorch reserved then (the message's
  allocated plus reserved-but-unallocated bytes; :mod:`oomdoctor.trace.oommessage`, from the sidecar's
  ``oom.message``: within three times the message's rounding, at most 16 MiB in GiB); the GPU's total
  memory less the room read at the OOM or at the dump (sidecar ``device_free_bytes`` + ``memory_stats``'
  reserved bytes); the planner's constants when the room is estimated from them
  (:data:`oomdoctor.plan.terms.CUDA_CONTEXT_BYTES`, ``NCCL_FIRST_COMMUNICATOR_BYTES``). Under a memory-fraction
  cap it is 0: the cap is the allocator's own limit, below what lives outside it.
- ``unrecorded_bytes``: the job's own peak reserved (``memory_stats``' ``reserved_bytes.all.peak``, from a
  sidecar, given by the caller) above the trace's peak reserved: memory the trace did not record (a ring
  buffer that dropped the peak).

What it does not cover: another process on the same GPU; a rerun with other shapes or data (the variation is
this run's); allocator behaviour the model does not have (it says so when it cannot replay a trace).

A claim whose spare room (room - predicted peak reserved) is below the margin is **at the edge**: it may still
run out, and is never counted as a fix (:func:`at_edge`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing_extensions import TypedDict  # pydantic (the schema) reads a TypedDict from typing_extensions only

from ..analysis.device import DeviceAnalysis
from ..trace.oommessage import sidecar_oom_message

SOURCES = ("fewer-than-two-steps", "steps-spread", "steps-rise", "self-replay-difference", "self-replay-exact",
           "fraction-cap", "given", "oom-message", "gpu-size-unknown", "device-free-at-oom", "device-free-at-dump",
           "cuda-context", "cuda-context-and-nccl", "job-peak-above-trace")
"""How a part of the margin was read (the module doc says each): too few complete steps; the spread (max - min)
of the steps' peaks, or the largest rise of the peak reserved from one step to the next; the self-replay's
difference from the recording, or none; outside the allocator: nothing under a memory-fraction cap, the caller's
count, the OOM message's, unknown without the GPU's size, the GPU's total less the free and reserved bytes at the
OOM or at the dump, the planner's constants (the CUDA context, and NCCL's first communicator with several ranks);
the job's own peak reserved above the trace's."""


class MarginParts(TypedDict):
    """The margin's parts as the JSON writes them (:meth:`Margin.parts`; bytes). The docstring under each key is
    its description in the JSON schema (``oomdoctor schema diagnose``)."""

    step_variation_bytes: int
    """max - min of the per-step peak allocated and of the peak reserved over the complete steps, the larger
    (bytes)"""
    model_error_bytes: int
    """the self-replay's largest reserved difference from the recording, 0: exact (bytes)"""
    extension_bytes: int
    """the largest rise of the peak reserved between consecutive complete steps, counted for an extended step
    only (bytes)"""
    outside_bytes: int
    """memory outside the caching allocator (CUDA context, NCCL, library workspaces): the GPU's total less the
    room read at the OOM or dump, or given by a sidecar; 0 under a fraction cap (bytes)"""
    unrecorded_bytes: int
    """the job's own peak reserved (memory_stats) above the trace's (bytes)"""


MarginParts.__pydantic_config__ = {"use_attribute_docstrings": True}  # type: ignore[attr-defined]


@dataclass
class Margin:
    """The margin of one rank's predictions (bytes; see the module doc), and how each part was read
    (``sources``: component name -> the id of how, :data:`SOURCES`; their words: :mod:`oomdoctor.render.words.margin`)."""

    step_variation_bytes: int = 0
    model_error_bytes: int = 0
    extension_bytes: int = 0
    outside_bytes: int = 0
    unrecorded_bytes: int = 0
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        """The margin of a claim about the recorded events (no extension): every part but ``extension_bytes``."""
        return self.step_variation_bytes + self.model_error_bytes + self.outside_bytes + self.unrecorded_bytes

    def for_claim(self, extended: bool) -> int:
        """The margin of a claim (bytes): :attr:`bytes`, plus ``extension_bytes`` for a step extended by the
        previous step's events."""
        return self.bytes + (self.extension_bytes if extended else 0)

    def parts(self) -> MarginParts:
        """The components, by JSON name (bytes)."""
        return {"step_variation_bytes": self.step_variation_bytes, "model_error_bytes": self.model_error_bytes,
                "extension_bytes": self.extension_bytes, "outside_bytes": self.outside_bytes,
                "unrecorded_bytes": self.unrecorded_bytes}


def complete_steps(a: DeviceAnalysis) -> list[tuple[int, int]]:
    """``(first, end)`` event ranges of the complete steps: every step but the first (it creates state) and
    one cut by an OOM (the last, when the trace ends at an OOM). Empty without steps."""
    steps = a.steps
    if steps is None or len(steps) < 2:
        return []
    bounds = steps.starts.tolist() + [a.num_events]
    last = len(bounds) - (2 if a.oom_events.size else 1)
    return [(bounds[i], bounds[i + 1]) for i in range(1, last) if bounds[i + 1] > bounds[i]]


def step_peaks(a: DeviceAnalysis) -> tuple[list[int], list[int]]:
    """Per complete step (:func:`complete_steps`): the peak allocated and the peak reserved (bytes)."""
    tl = a.timeline
    rng = complete_steps(a)
    return ([int(tl.allocated[lo:hi].max()) for lo, hi in rng], [int(tl.reserved[lo:hi].max()) for lo, hi in rng])


def step_variation(a: DeviceAnalysis) -> tuple[int, str]:
    """The job's step-to-step variation (bytes) and how it was read (module doc); 0 with fewer than two
    complete steps."""
    alloc, res = step_peaks(a)
    if len(alloc) < 2:
        return 0, "fewer-than-two-steps"
    v = max(max(alloc) - min(alloc), max(res) - min(res))
    return v, "steps-spread"


def extension_error(a: DeviceAnalysis) -> tuple[int, str]:
    """The largest rise of the peak reserved from one complete step to the next (bytes; module doc)."""
    _alloc, res = step_peaks(a)
    if len(res) < 2:
        return 0, "fewer-than-two-steps"
    rise = max(max(y - x for x, y in zip(res, res[1:])), 0)
    return rise, "steps-rise"


def outside_allocator(a: DeviceAnalysis, outside_bytes: int | None = None) -> tuple[int, str]:
    """What lives outside the caching allocator (bytes) and how it was read (module doc)."""
    from ..plan.terms import (  # imported where used: start-up
        CUDA_CONTEXT_BYTES,
        NCCL_FIRST_COMMUNICATOR_BYTES,
    )
    from ..simulate.capacity import sidecar_cap

    meta = a.trace.meta
    if sidecar_cap(meta)[0] is not None:
        return 0, "fraction-cap"
    if outside_bytes is not None:
        return max(int(outside_bytes), 0), "given"
    msg = sidecar_oom_message(meta)
    if msg is not None and msg.outside_bytes is not None:
        return msg.outside_bytes, "oom-message"
    total = meta.get("gpu_total_memory_bytes")
    if not isinstance(total, int) or total <= 0:
        return 0, "gpu-size-unknown"
    if a.oom_events.size:
        k = int(a.oom_events[-1])
        free = int(a.device.events["device_free"][k])
        if free >= 0:
            return max(total - free - int(a.timeline.reserved[k]), 0), "device-free-at-oom"
    free = meta.get("device_free_bytes")
    reserved = (meta.get("memory_stats") or {}).get("reserved_bytes.all.current")
    if isinstance(free, int) and isinstance(reserved, int):
        return max(total - free - reserved, 0), "device-free-at-dump"
    nccl = (meta.get("world_size") or 1) > 1
    return (CUDA_CONTEXT_BYTES + (NCCL_FIRST_COMMUNICATOR_BYTES if nccl else 0),
            "cuda-context-and-nccl" if nccl else "cuda-context")


def margin(a: DeviceAnalysis, *, model_error_bytes: int = 0, outside_bytes: int | None = None,
           job_peak_reserved_bytes: int | None = None) -> Margin:
    """The margin of ``a``'s predictions (see the module doc). ``model_error_bytes``: the self-replay's
    largest reserved difference (the caller replays); ``outside_bytes``: the process's memory outside the
    allocator, when a sidecar or the OOM message gives it; ``job_peak_reserved_bytes``: the job's own peak
    reserved (``memory_stats``), when known. Pure."""
    m = Margin()
    m.step_variation_bytes, m.sources["step_variation_bytes"] = step_variation(a)
    m.model_error_bytes = max(int(model_error_bytes), 0)
    m.sources["model_error_bytes"] = "self-replay-difference" if m.model_error_bytes else "self-replay-exact"
    m.extension_bytes, m.sources["extension_bytes"] = extension_error(a)
    m.outside_bytes, m.sources["outside_bytes"] = outside_allocator(a, outside_bytes)
    if job_peak_reserved_bytes is None:
        peak = (a.trace.meta.get("memory_stats") or {}).get("reserved_bytes.all.peak")
        job_peak_reserved_bytes = peak if isinstance(peak, int) else None
    if job_peak_reserved_bytes is not None and a.num_events:
        m.unrecorded_bytes = max(int(job_peak_reserved_bytes) - int(a.peak_reserved[0]), 0)
        m.sources["unrecorded_bytes"] = "job-peak-above-trace"
    return m


def at_edge(spare_bytes: int | None, margin_bytes: int) -> bool | None:
    """Is a claim with ``spare_bytes`` left (room - predicted peak) inside the margin? None when the room is
    unknown."""
    return None if spare_bytes is None else spare_bytes < margin_bytes
