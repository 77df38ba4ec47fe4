"""The margin of a prediction: how far from the room a replayed peak must stay to be believed (issue 49).

Every claim the allocator model makes (a setting's outcome, the rest of a step cut by its OOM, the largest
micro-batch that fits) is a replayed peak compared with the room the allocator had (:func:`.fits.device_room`).
A claim says two things, each with its own margin, one term per source, each measured (docs/diagnose.md "The
margin", ``benchmarks/margin_terms.py``, ``docs/margin_terms.json``):

**The recorded steps** (:attr:`Margin.bytes`): the replay of the recorded events under the setting. It is exact
under the model's rules, so only two things stand between it and a rerun of the same steps:

- ``model_error_bytes``: the allocator model's measured error on this trace: the largest difference of reserved
  bytes between the self-replay (recorded settings, :func:`..simulate.replay.replay` with ``validate``) and the
  recording, after any event (``Validation.max_reserved_difference_bytes``); 0 when the self-replay is exact (88
  of 88 corpus ranks the model replays).
- ``outside_bytes``: the memory outside the caching allocator (CUDA context, NCCL's buffers, kernels loaded
  lazily), counted once. Where the room was read from the device (at the OOM: reserved + ``cudaMemGetInfo``'s free
  bytes; at a dump: the sidecar's free + reserved bytes), what lived outside then is off the room already; only
  what it grows by after that moment is not, measured between an OOM and a completed run of the same job (22 pairs
  of ranks): up to :data:`OUTSIDE_GROWTH_BYTES` (92 MiB) where the room was read before the job's first optimizer
  step ended (kernels still to load), up to :data:`OUTSIDE_GROWTH_AFTER_STEP_BYTES` (2 MiB) after it
  (:func:`step_ran_before`). Under a memory-fraction cap it is 0: the cap is
  the allocator's own limit, outside memory does not count against it. Where the room is the GPU's total less the
  planner's constants (nothing read from the device), the constants' largest shortfall measured on the corpus
  (:data:`PLANNER_SHORTFALL_BYTES`), or, where the caller read the process's outside memory
  (``outside_bytes``: the sidecar's OOM message or counters, :func:`margin_inputs`) and the room was taken as the
  total less it, :data:`OUTSIDE_GROWTH_BYTES` again.

**What the recorded steps do not cover** (:attr:`Margin.continuation_bytes`): later steps, longer inputs, the
rest of a step cut by its OOM. It is a condition first: the claim holds for inputs up to the heaviest recorded
step (its peak allocated). A number is given only where the job measured one:

- ``reserved_step_spread_bytes``: max - min of the per-step peak *reserved* over the complete steps (the first
  step, which creates state, and a step cut by an OOM are not complete; ``analysis/phases.py`` finds the steps):
  the same work reserved that much more or less from one step to the next in this very run. None with fewer than
  two complete steps: the condition alone is said.
- ``unrecorded_bytes``: the job's own peak reserved (PyTorch's counters, :mod:`oomdoctor.analysis.jobpeak`) above
  the trace's: memory the recording did not see (a ring buffer that dropped the peak).

What neither covers: another process on the same GPU; a rerun with other shapes or data; allocator behaviour the
model does not have (it says so when it cannot replay a trace); the model's error under a setting other than the
recorded one, which the self-replay does not exercise (measured on paired recordings: -44 MB of 37.38 GB for
``expandable_segments`` on ``fragmentation-oom``, -96 MB to +94 MB of 13.9-15.6 GB for
``garbage_collection_threshold`` / ``max_split_size_mb`` on the H100 allocator traces; docs/diagnose.md).

A claim whose spare room (room - predicted peak reserved) is below its margin is **at the edge**: it may still
run out, and is never counted as a fix (:func:`at_edge`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from typing_extensions import TypedDict  # pydantic (the schema) reads a TypedDict from typing_extensions only

from ..analysis.device import DeviceAnalysis
from ..ids import MARGIN_SOURCES, MarginSource
from ..trace.oommessage import sidecar_oom_message

OUTSIDE_GROWTH_BYTES = 96_468_992
"""How much the memory outside the caching allocator grew, at most, after the room was read from the device before
the job's first optimizer step ended (:func:`step_ran_before`): the rest of the step's kernels are loaded then (CUDA's
lazy module loading) and NCCL makes the buffers of its first collectives. Measured on the corpus
(``benchmarks/margin_terms.py``, ``docs/margin_terms.json`` ``outside``) against a run of the same job that completed
(same world size and rank), 8 pairs of ranks: 0 on ``accelerate-ddp-llama-b76`` (both ranks), 79,691,776 bytes on both
first-forward runs (both ranks), 75,497,472 on ``pipeline-gpipe-b32``, 96,468,992 (92 MiB, the largest) on
``pipelining-1f1b-b32``'s last stage."""

OUTSIDE_GROWTH_AFTER_STEP_BYTES = 2_097_152
"""The same after an optimizer step ended (or, in an inference loop, after an earlier pass of it): at most 2 MiB on
the corpus's 14 such pairs of ranks (0 on 12, 64 KiB on ``deepspeed-z1-gpt2-b120``, 2 MiB on
``generate-gqa-b11264``): ``cudaMemGetInfo`` counts the device's memory in 2 MiB pages."""

PLANNER_SHORTFALL_BYTES = {1: 1_058_111_232, 2: 327_074_560}
"""Where the room is the GPU's total less the planner's constants (``plan/terms.py``: the CUDA context, 740 MB, and
NCCL's first communicator, 880 MB, with several ranks), the most the memory outside the allocator measured above
them on the corpus (``docs/margin_terms.json`` ``summary.planner_constants_shortfall_max_bytes``): one process,
1,058,111,232 bytes (``deepspeed-z3-gpt2-b16``: 1.80 GB outside, DeepSpeed's NCCL group on one GPU); several
ranks (key 2: two or more), 327,074,560 (``pipelining-1f1b-b28`` rank 1: 1.95 GB, the world group and the
point-to-point one)."""

SOURCES = MARGIN_SOURCES
"""How a part of the margin was read (the module doc says each): the self-replay's difference from the
recording, or none; outside the allocator: nothing under a memory-fraction cap, its growth after the room was read
from the device before the first optimizer step ended (:data:`OUTSIDE_GROWTH_BYTES`) or after
(:data:`OUTSIDE_GROWTH_AFTER_STEP_BYTES`), the planner's constants' shortfall (:data:`PLANNER_SHORTFALL_BYTES`),
unknown without the GPU's size; the spread of the reserved step peaks, or too few complete steps; the job's own
peak reserved above the trace's, within it, or not known."""


class MarginParts(TypedDict):
    """The margin of a claim about the recorded steps, by part, as the JSON writes it (:meth:`Margin.parts`;
    bytes). The docstring under each key is its description in the JSON schema (``oomdoctor schema diagnose``)."""

    model_error_bytes: int
    """the self-replay's largest reserved difference from the recording, 0: exact (bytes)"""
    outside_bytes: int
    """memory outside the caching allocator not already off the room: its growth after the room was read from the
    device, the planner constants' shortfall where the room is estimated from them, 0 under a fraction cap (bytes)"""


class ContinuationParts(TypedDict):
    """What the recorded steps do not cover, measured (:meth:`Margin.continuation_parts`; bytes)."""

    reserved_step_spread_bytes: int | None
    """max - min of the per-step peak reserved over the complete steps; null with fewer than two (bytes)"""
    unrecorded_bytes: int
    """the job's own peak reserved (PyTorch's counters) above the trace's (bytes)"""


for _shape in (MarginParts, ContinuationParts):
    _shape.__pydantic_config__ = {"use_attribute_docstrings": True}  # type: ignore[attr-defined]


@dataclass
class Margin:
    """The margins of one rank's predictions (bytes; see the module doc), and how each part was read
    (``sources``: part name -> the id of how, :data:`SOURCES`; their words: :mod:`oomdoctor.render.words.margin`)."""

    model_error_bytes: int = 0
    outside_bytes: int = 0
    reserved_step_spread_bytes: int | None = None
    unrecorded_bytes: int = 0
    sources: dict[str, MarginSource] = field(default_factory=dict[str, MarginSource])

    @property
    def bytes(self) -> int:
        """The margin of a claim about the recorded steps: the model's error plus the outside memory's part."""
        return self.model_error_bytes + self.outside_bytes

    @property
    def continuation_bytes(self) -> int | None:
        """The margin of what the recorded steps do not cover, where the job measured it: the spread of its
        reserved step peaks plus what the recording did not see; None without two complete steps (a condition
        only)."""
        if self.reserved_step_spread_bytes is None:
            return None
        return self.reserved_step_spread_bytes + self.unrecorded_bytes

    def parts(self) -> MarginParts:
        """The recorded steps' margin, by JSON name (bytes)."""
        return {"model_error_bytes": self.model_error_bytes, "outside_bytes": self.outside_bytes}

    def continuation_parts(self) -> ContinuationParts:
        """What the recorded steps do not cover, by JSON name (bytes)."""
        return {"reserved_step_spread_bytes": self.reserved_step_spread_bytes,
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


def reserved_step_spread(a: DeviceAnalysis) -> tuple[int | None, MarginSource]:
    """max - min of the per-step peak reserved over the complete steps (bytes) and how it was read; None with fewer
    than two complete steps."""
    _alloc, res = step_peaks(a)
    if len(res) < 2:
        return None, "fewer-than-two-steps"
    return max(res) - min(res), "reserved-step-spread"


def _room_read_from_device(a: DeviceAnalysis) -> bool:
    """Was the room read from the device: ``cudaMemGetInfo`` at the OOM, or the sidecar's free and reserved bytes
    at the dump (:func:`.fits.device_room` rules 2 and 3)?"""
    if a.oom_events.size and int(a.device.events["device_free"][int(a.oom_events[-1])]) >= 0:
        return True
    meta = a.trace.meta
    stats: dict[str, Any] = meta.get("memory_stats") or {}
    reserved = stats.get("reserved_bytes.all.current")
    return isinstance(meta.get("device_free_bytes"), int) and isinstance(reserved, int)


def step_ran_before(a: DeviceAnalysis, k: int | None = None) -> bool:
    """Had the job's work run once in full before event ``k`` (default: the last OOM, else the trace's end), so that
    its kernels are loaded and NCCL's buffers made: a step that ended before ``k`` (a later step began:
    ``analysis/phases.py`` steps), the window starting at a later step (``steps.first``), or, at an OOM inside
    generation or evaluation, two earlier passes of that loop? (A ``zero_grad`` before the first forward is no step.)"""
    from ..analysis.phases import EVALUATION_PHASE, GENERATION_PHASE

    if k is None:
        k = int(a.oom_events[-1]) if a.oom_events.size else a.num_events
    steps = a.phases.steps
    if steps is not None and (steps.first > 0 or bool(np.any(steps.starts[1:] <= k))):
        return True
    if k < a.num_events and a.phases.phase[k] in (GENERATION_PHASE, EVALUATION_PHASE):
        starts = a.phases.pass_starts[a.phases.pass_starts < k]
        return bool(np.count_nonzero(a.phases.phase[starts] == a.phases.phase[k]) >= 2)
    return False


def outside_allocator(a: DeviceAnalysis, outside_bytes: int | None = None) -> tuple[int, MarginSource]:
    """The part of the memory outside the caching allocator a claim about the recorded steps keeps free (bytes),
    and how it was read (module doc). ``outside_bytes``: the process's own count of it (:func:`margin_inputs`)."""
    from ..simulate.capacity import infer_capacity, sidecar_cap

    meta = a.trace.meta
    if sidecar_cap(meta)[0] is not None:
        return 0, "fraction-cap"
    if a.oom_events.size and infer_capacity(a.trace, a.device).kind == "fraction":
        return 0, "fraction-cap"  # the device still had the segment free at the OOM: a fraction cap failed it
    if _room_read_from_device(a) or outside_bytes is not None:
        if step_ran_before(a):
            return OUTSIDE_GROWTH_AFTER_STEP_BYTES, "outside-growth-after-a-step"
        return OUTSIDE_GROWTH_BYTES, "outside-growth"
    total = meta.get("gpu_total_memory_bytes")
    if not isinstance(total, int) or total <= 0:
        return 0, "gpu-size-unknown"
    return PLANNER_SHORTFALL_BYTES[1 if (meta.get("world_size") or 1) <= 1 else 2], "planner-constants"


class MarginInputs(TypedDict):
    """What a sidecar says that the margin needs (:func:`margin_inputs`; bytes, None where it says nothing): the
    keyword arguments of :func:`margin`, :class:`.predict.Predictor` and :func:`.fits.fits`."""

    outside_bytes: int | None
    job_peak_reserved_bytes: int | None


def margin_inputs(a: DeviceAnalysis) -> MarginInputs:
    """What a sidecar says that the margin needs and the trace does not hold (bytes; None where it says nothing):
    ``outside_bytes``, the process's memory outside the caching allocator (PyTorch's OOM message, "this process has
    X memory in use" less what PyTorch reserved, :mod:`oomdoctor.trace.oommessage`; else the counters' GPU total
    less ``cudaMemGetInfo``'s free bytes less the reserved bytes, at the dump); ``job_peak_reserved_bytes``, the
    job's own peak reserved from PyTorch's counters (:func:`oomdoctor.analysis.jobpeak.job_peak`). What production
    callers pass to :func:`margin`, :class:`.predict.Predictor` and :func:`.fits.fits` (``report/rank_predictions.py``,
    ``report/predict.py``)."""
    from ..analysis.jobpeak import counters

    out: MarginInputs = {"outside_bytes": None, "job_peak_reserved_bytes": None}
    msg = sidecar_oom_message(a.trace.meta)
    if msg is not None and msg.outside_bytes is not None:
        out["outside_bytes"] = msg.outside_bytes
    else:
        c, _src = counters(a.trace.meta, a.device.device)
        total, free, reserved = ((c or {}).get(k) for k in ("device_total_bytes", "device_free_bytes",
                                                              "reserved_bytes.all.current"))
        if isinstance(total, int) and isinstance(free, int) and isinstance(reserved, int):
            out["outside_bytes"] = max(total - free - reserved, 0)
    jp = a.job_peak
    if jp.source in ("sidecar", "memory_stats_file"):
        out["job_peak_reserved_bytes"] = jp.job_peak_reserved_bytes
    return out


def margin(a: DeviceAnalysis, *, model_error_bytes: int = 0, outside_bytes: int | None = None,
           job_peak_reserved_bytes: int | None = None) -> Margin:
    """The margins of ``a``'s predictions (see the module doc). ``model_error_bytes``: the self-replay's largest
    reserved difference (the caller replays); ``outside_bytes`` and ``job_peak_reserved_bytes``: what the sidecar
    says (:func:`margin_inputs`; production callers pass them). Pure."""
    m = Margin()
    m.model_error_bytes = max(int(model_error_bytes), 0)
    m.sources["model_error_bytes"] = "self-replay-difference" if m.model_error_bytes else "self-replay-exact"
    m.outside_bytes, m.sources["outside_bytes"] = outside_allocator(a, outside_bytes)
    m.reserved_step_spread_bytes, m.sources["reserved_step_spread_bytes"] = reserved_step_spread(a)
    if job_peak_reserved_bytes is None:
        m.sources["unrecorded_bytes"] = "job-peak-unknown"
    elif a.num_events:
        m.unrecorded_bytes = max(int(job_peak_reserved_bytes) - int(a.peak_reserved[0]), 0)
        m.sources["unrecorded_bytes"] = "job-peak-above-trace" if m.unrecorded_bytes else "job-peak-in-trace"
    return m


def at_edge(spare_bytes: int | None, margin_bytes: int | None) -> bool | None:
    """Is a claim with ``spare_bytes`` left (room - predicted peak) inside the margin? None when the room or the
    margin is unknown."""
    return None if spare_bytes is None or margin_bytes is None else spare_bytes < margin_bytes
