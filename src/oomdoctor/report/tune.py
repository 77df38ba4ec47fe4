"""``oomdoctor tune``'s decisions: the fastest configuration that fits, as data (ids and numbers; the words are in
:mod:`oomdoctor.render.tune`, the traces and runs in :mod:`oomdoctor.cli.tune_exec`).

1. **The space** (:class:`Space`, :func:`candidates`). A Hugging Face Trainer job: micro-batch × gradient
   accumulation keeping the global batch (``global_batch = micro_batch × grad_accum × GPUs``), activation
   checkpointing (``none``, ``full``, ``every-K``: every K-th decoder layer), AdamW's kernels (``fused``,
   ``foreach``, ``for-loop``: the same mathematics, different memory and speed), with ``allow_optimizer_change``
   also ``adamw8bit`` and ``sgd``; on N GPUs DDP; allocator settings. A script: its knobs (``--knob mb=1..512``),
   ``{ga}`` derived from the global batch, and the allocator settings.
2. **Memory, from preflight** (:func:`next_traces`, :func:`memory_of`). Candidates that differ only in the
   micro-batch and the allocator setting form a *memory class* (accumulation counted as ``1`` or ``≥ 2``: the
   second micro-batch of a step is the first with gradients alive, later ones allocate the same). Each class is
   traced at its smallest and largest micro-batch, then between the largest that fits and the smallest that does
   not until no untraced micro-batch is left between them (guided by the line through the two, else bisection),
   for every allocator setting (one trace replays under all of them). Peak reserved is taken to grow with the
   micro-batch inside a class (as preflight's largest micro-batch does); an untraced micro-batch below a traced
   one that fits fits, one above a traced one that does not does not, and its peak is the line between its traced
   neighbours (``memory_basis: interpolated``). A candidate fits when its replay does not run out and its peak
   reserved plus preflight's margin (:func:`oomdoctor.report.preflight.margin_bytes`, the one place it is read) is
   within the allocator's room. Only traced candidates are recommended or run.
3. **Throughput, a cost model** (:func:`predicted_step`). From the traced step's kernels (the tracer's
   :attr:`op_costs`: FLOPs by ``torch.utils.flop_counter``'s formulas, bytes each kernel reads and writes; the
   recomputation of checkpointed layers is in the trace), per kernel the roofline time
   ``max(FLOPs / (peak × MATMUL_EFFICIENCY), bytes / (bandwidth × MEMORY_EFFICIENCY), KERNEL_FLOOR_S)`` (Williams,
   Waterman, Patterson 2009, "Roofline"), summed; the host's time ``kernels × HOST_OP_S`` (eager PyTorch
   dispatches every op from Python); a micro-batch takes the larger of the two. A step is ``grad_accum``
   micro-batches, the optimizer's kernels, the collectives' time not hidden behind compute and
   ``STEP_OVERHEAD_S``. Collectives: ring all-reduce ``2(N−1)/N × bytes / link``, all-gather and reduce-scatter
   ``(N−1)/N × bytes / link`` (Patarasuk & Yuan 2009; NCCL's ``PERFORMANCE.md`` bus bandwidth), the bytes from
   the trace (FSDP2's all-gathers and reduce-scatters) or DDP's gradient buckets; :data:`DP_EXPOSED` of them
   at least is exposed (``oomdoctor plan``'s constant).
4. **Measured**: the top K (distinct, traced, fitting) candidates run for real (``oomdoctor fit``'s trials: K
   optimizer steps, warm-up excluded); the answer is the measured best. Without a GPU the ranking is the
   prediction (``measured: false``).

Bad input raises :class:`TuneError` (one line, exit 2).
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, cast

from ..ids import TUNE_NOTES, TuneNote
from ..plan.search import DP_EXPOSED
from .preflight import margin_bytes

#: the axes of a Hugging Face Trainer job, in the order a configuration is written
HF_AXES = ("micro_batch", "grad_accum", "checkpointing", "optimizer", "sharding", "allocator")
#: AdamW's kernels: the same mathematics (memory-equivalent changes)
OPTIMIZER_KERNELS = ("fused", "foreach", "for-loop")
#: optimizers whose mathematics differ from AdamW's: searched only with ``allow_optimizer_change``
OPTIMIZER_CHANGES = ("adamw8bit", "sgd")
DEFAULT_ALLOCATOR = "defaults"
#: allocator settings searched by default (``PYTORCH_ALLOC_CONF``); every trace replays under each
ALLOCATORS = (DEFAULT_ALLOCATOR, "expandable_segments:True", "max_split_size_mb:512")
#: what the output can say about the search, by id (render/tune.py words them)
NOTES = TUNE_NOTES
MEMORY_BASES = ("traced", "interpolated")
#: a run's outcome, as ``oomdoctor fit``'s trials say it (``ended-early``: exit code 0 before the steps asked)
TRIAL_OUTCOMES = ("ran", "oom", "failed", "ended-early")

MATMUL_EFFICIENCY = 0.7
"""Share of the dense bf16 peak a training step's FLOPs run at: 788 of 989 TFLOP/s measured for an 8192³ bf16 GEMM on
the lent H200 (KINDS.md: 0.80), less for a model's smaller GEMMs and attention."""
MEMORY_EFFICIENCY = 0.8
"""Share of HBM bandwidth elementwise kernels reach: a device-to-device copy moved 4.3 of 4.8 TB/s on the lent H200
(0.9), elementwise kernels with several inputs less."""
KERNEL_FLOOR_S = 3e-6
"""The shortest a kernel takes on the GPU, launch gaps included (a few µs on Hopper)."""
HOST_OP_S = 10e-6
"""The host's time to dispatch one op from Python in eager PyTorch (Python, the dispatcher, the launch: about 10 µs):
a step of small micro-batches is bound by it. Optimistic: on the lent H200 (round 14, docs/tune.md) the ViT script's
small micro-batches took 24 µs (no checkpointing) to 43 µs (checkpointing) a traced kernel; not refitted on the two
jobs the ranking was measured on (no held-out run yet)."""
STEP_OVERHEAD_S = 2e-3
"""Fixed per optimizer step outside the kernels: the loop's Python, the data loader, the LR scheduler."""
#: dense bf16 FLOP/s, HBM bytes/s and NVLink bus bytes/s per GPU (vendor data sheets: H100 SXM 989 TFLOP/s,
#: 3.35 TB/s; H200 989 TFLOP/s, 4.8 TB/s; A100 312 TFLOP/s, 2.0 / 1.6 TB/s; B200 2.25 PFLOP/s, 8 TB/s; NVLink 4
#: 450 GB/s a direction (A100's NVLink 3: 300), of which NCCL's bus bandwidth reaches about 80%)
GPU_SPECS: dict[str, tuple[float, float, float]] = {
    "H100-80GB": (989e12, 3.35e12, 360e9),
    "H200": (989e12, 4.8e12, 360e9),
    "A100-80GB": (312e12, 2.039e12, 240e9),
    "A100-40GB": (312e12, 1.555e12, 240e9),
    "B200": (2250e12, 8.0e12, 720e9),
}
#: fp32 without tensor cores: the FLOP/s of a --dtype fp32 job (H100/H200 SXM 67 TFLOP/s, A100 19.5, B200 80)
FP32_FLOPS = {"H100-80GB": 67e12, "H200": 67e12, "A100-80GB": 19.5e12, "A100-40GB": 19.5e12, "B200": 80e12}
#: the bus traffic of a collective on N ranks, as a multiple of ``(N - 1) / N × bytes`` (ring algorithms)
COLLECTIVE_FACTORS = {"allreduce": 2.0, "all_reduce": 2.0}
MAX_TRACES = 64
"""Traces one search may spend after each memory class's first two (``--max-traces``)."""


class TuneError(ValueError):
    """A search that cannot be made as asked: one line naming what is wrong (the CLI exits 2)."""


# ------------------------------------------------------------------------------------------------- the space

_RANGE = re.compile(r"^(\d+)\.\.(\d+)$")


@dataclass(frozen=True)
class Knob:
    """A script's knob: its ``name`` (``{name}`` in the command) and its values, as text, in order."""

    name: str
    values: tuple[str, ...]


def parse_knob(text: str) -> Knob:
    """``NAME=V1,V2,...`` or ``NAME=A..B`` (the powers of two from A to B, and B). Raises :class:`TuneError`: no
    ``=``, an empty name, no values, an empty value, a range whose end is below its start."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise TuneError(f"--knob {text!r}: write NAME=V1,V2 or NAME=A..B (NAME a word, as in {{NAME}})")
    rest = rest.strip()
    if not rest:
        raise TuneError(f"--knob {text!r}: no values")
    m = _RANGE.match(rest)
    if m:
        a, b = int(m.group(1)), int(m.group(2))
        if a < 1 or b < a:
            raise TuneError(f"--knob {text!r}: the range {a}..{b} is empty (write A..B with 1 <= A <= B)")
        return Knob(name, tuple(str(v) for v in powers_of_two(a, b)))
    values = tuple(v.strip() for v in rest.split(","))
    if any(not v for v in values):
        raise TuneError(f"--knob {text!r}: an empty value")
    return Knob(name, tuple(dict.fromkeys(values)))


def powers_of_two(a: int, b: int) -> list[int]:
    """``a``, the powers of two above it up to ``b``, and ``b``: ``1..12`` -> 1, 2, 4, 8, 12."""
    out = [a]
    p = 1 << max(a.bit_length(), 0)
    while p < b:
        if p > a:
            out.append(p)
        p <<= 1
    if b != a:
        out.append(b)
    return out


def parse_checkpointing(text: str) -> str:
    """``none``, ``full`` (or ``1``), ``every-K`` (or ``K``, K ≥ 2): the id. Raises :class:`TuneError`."""
    t = text.strip().lower()
    if t in ("none", "full"):
        return t
    if t == "1":
        return "full"
    k = t.removeprefix("every-")
    if k.isdigit() and int(k) >= 2:
        return f"every-{int(k)}"
    raise TuneError(f"--checkpointing {text!r}: none, full or every-K (K >= 2, every K-th decoder layer)")


def checkpoint_every(value: str) -> int:
    """Every how many layers ``value`` checkpoints: 0 (none), 1 (full), K."""
    return 0 if value == "none" else 1 if value == "full" else int(value.removeprefix("every-"))


@dataclass(frozen=True)
class Space:
    """What is searched. ``mode``: ``hf`` (a Trainer job) or ``script`` (a command with knobs); ``axes``: name ->
    values, in order (``hf``: :data:`HF_AXES` but ``grad_accum``, which the global batch decides; ``script``: the
    knobs); ``batch_axis``: the axis that is the micro-batch (None: a script without one); ``accum_axis``: the
    derived accumulation's name (``grad_accum``; a script's ``{ga}``), None when not derived; ``world_size``: GPUs;
    ``global_batch``: samples per optimizer step over all GPUs, None when not kept."""

    mode: str
    axes: tuple[tuple[str, tuple[Any, ...]], ...]
    batch_axis: str | None
    accum_axis: str | None
    world_size: int
    global_batch: int | None
    allocators: tuple[str, ...] = ALLOCATORS

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "axes": {k: list(v) for k, v in self.axes}, "batch_axis": self.batch_axis,
                "accum_axis": self.accum_axis, "world_size": self.world_size, "global_batch": self.global_batch,
                "allocators": list(self.allocators)}


def hf_space(*, micro_batches: Iterable[int], checkpointing: Iterable[str], optimizers: Iterable[str],
             world_size: int, global_batch: int, allocators: Iterable[str] = ALLOCATORS,
             allow_optimizer_change: bool = False) -> Space:
    """The space of a Trainer job. Raises :class:`TuneError`: an empty axis, an optimizer that changes the
    mathematics without ``allow_optimizer_change``, an unknown one."""
    mbs = tuple(sorted(set(int(m) for m in micro_batches)))
    ck = tuple(dict.fromkeys(parse_checkpointing(c) for c in checkpointing))
    opts = tuple(dict.fromkeys(o.strip() for o in optimizers))
    allocs = tuple(dict.fromkeys(a.strip() for a in allocators))
    for name, vals in (("--micro-batch", mbs), ("--checkpointing", ck), ("--optimizer", opts),
                       ("--allocator", allocs)):
        if not vals or any(v in ("", None) for v in vals):
            raise TuneError(f"{name}: no values")
    if any(m < 1 for m in mbs):
        raise TuneError("--micro-batch: values must be at least 1")
    for o in opts:
        if o in OPTIMIZER_CHANGES and not allow_optimizer_change:
            raise TuneError(f"--optimizer {o}: changes the optimizer's mathematics; add --allow-optimizer-change")
        if o not in OPTIMIZER_KERNELS + OPTIMIZER_CHANGES:
            raise TuneError(f"--optimizer {o!r}: one of {', '.join(OPTIMIZER_KERNELS + OPTIMIZER_CHANGES)}")
    if global_batch < 1:
        raise TuneError("--global-batch: must be at least 1")
    sharding = ("ddp",) if world_size > 1 else ("none",)
    axes = (("micro_batch", mbs), ("checkpointing", ck), ("optimizer", opts), ("sharding", sharding))
    return Space("hf", axes, "micro_batch", "grad_accum", world_size, global_batch, allocs)


def script_space(knobs: list[Knob], command: list[str], *, world_size: int, global_batch: int | None,
                 batch_knob: str | None, accum_name: str = "ga", allocators: Iterable[str] = ALLOCATORS) -> Space:
    """The space of a command with ``{knob}`` placeholders. ``batch_knob``: the knob that is the micro-batch (its
    values integers); ``accum_name``: the placeholder the derived accumulation fills (``{ga}``), derived only with a
    global batch. Raises :class:`TuneError`: a knob twice, a knob the command does not use, a placeholder no knob
    fills, a micro-batch knob whose values are not positive integers, ``{ga}`` without a global batch."""
    names = [k.name for k in knobs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise TuneError(f"--knob {dup[0]}: given twice")
    text = " ".join(command)
    used = set(re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", text))
    for k in knobs:
        if k.name not in used:
            raise TuneError(f"--knob {k.name}: the command has no {{{k.name}}}")
    derived = accum_name if accum_name in used and accum_name not in names else None
    if derived and global_batch is None:
        raise TuneError(f"the command's {{{accum_name}}} is the gradient accumulation derived from --global-batch: "
                        "give --global-batch (or a --knob for it)")
    missing = sorted(used - set(names) - ({derived} if derived else set()))
    if missing:
        raise TuneError(f"the command's {{{missing[0]}}} has no --knob {missing[0]}=...")
    if batch_knob is not None and batch_knob not in names:
        raise TuneError(f"--batch-knob {batch_knob}: no such --knob")
    axes: list[tuple[str, tuple[Any, ...]]] = []
    for k in knobs:
        if k.name == batch_knob:
            try:
                vals: tuple[Any, ...] = tuple(sorted(set(int(v) for v in k.values)))
            except ValueError:
                raise TuneError(f"--knob {k.name}: the micro-batch's values must be integers") from None
            if any(v < 1 for v in vals):
                raise TuneError(f"--knob {k.name}: the micro-batch's values must be at least 1")
            axes.insert(0, (k.name, vals))
        else:
            axes.append((k.name, k.values))
    if global_batch is not None and batch_knob is None:
        raise TuneError("--global-batch needs the micro-batch's knob (--knob mb=..., or --batch-knob NAME)")
    allocs = tuple(dict.fromkeys(a.strip() for a in allocators))
    if not allocs or any(not a for a in allocs):
        raise TuneError("--allocator: no values")
    return Space("script", tuple(axes), batch_knob, derived, world_size, global_batch, allocs)


@dataclass(frozen=True)
class Config:
    """One candidate configuration: ``values`` (axis -> value, the derived accumulation and ``allocator`` included)
    in the space's order."""

    values: tuple[tuple[str, Any], ...]

    def get(self, name: str, default: Any = None) -> Any:
        return next((v for k, v in self.values if k == name), default)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def replace(self, **kw: Any) -> "Config":
        return Config(tuple((k, kw.get(k, v)) for k, v in self.values))


def candidates(space: Space) -> tuple[list[Config], list[Any]]:
    """Every configuration of ``space`` (each with every allocator setting), and the micro-batches dropped because
    they do not divide the global batch. Raises :class:`TuneError` when none does."""
    names = [k for k, _ in space.axes]
    out: list[Config] = []
    dropped: list[Any] = []
    for combo in itertools.product(*(v for _, v in space.axes)):
        d = dict(zip(names, combo))
        ga = None
        if space.global_batch is not None and space.batch_axis is not None:
            per = int(d[space.batch_axis]) * space.world_size
            if space.global_batch % per:
                if d[space.batch_axis] not in dropped:
                    dropped.append(d[space.batch_axis])
                continue
            ga = space.global_batch // per
        for alloc in space.allocators:
            vals: list[tuple[str, Any]] = []
            for k in names:
                vals.append((k, d[k]))
                if k == space.batch_axis and space.accum_axis is not None and ga is not None:
                    vals.append((space.accum_axis, ga))
            vals.append(("allocator", alloc))
            out.append(Config(tuple(vals)))
    if not out:
        mbs = ", ".join(str(v) for v in dict(space.axes).get(space.batch_axis or "", ()))
        raise TuneError(f"--global-batch {space.global_batch}: no micro-batch among {mbs} divides it on "
                        f"{space.world_size} GPU{'s' if space.world_size > 1 else ''} (global batch = micro-batch x "
                        "gradient accumulation x GPUs)")
    return out, sorted(dropped, key=lambda v: (str(type(cast(object, v))), v))  # type() of an Any: partly unknown


def check_budget(room_bytes: int, parameter_bytes: int, what: str) -> None:
    """Raises :class:`TuneError` when the parameters alone (``parameter_bytes`` on one GPU, the least any
    configuration of the space holds) do not fit in the allocator's room: no configuration can."""
    if parameter_bytes > room_bytes:
        def size(n: int) -> str:  # an error message's numbers (render/ formats outputs; errors are written here)
            return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"

        raise TuneError(f"{what}: the parameters alone take {size(parameter_bytes)} ({parameter_bytes} bytes) of a "
                        f"GPU, more than the {size(room_bytes)} ({room_bytes} bytes) the caching allocator has: "
                        "nothing in the space can fit (more GPUs with a sharding stage, or a smaller model)")


# --------------------------------------------------------------------------------------------------- memory

ClassKey = tuple[tuple[str, Any], ...]
#: A configuration but its allocator setting: (axis, value) pairs (:func:`_same_run`).
_RunKey = tuple[tuple[str, Any], ...]


def class_key(space: Space, c: Config) -> ClassKey:
    """The memory class of ``c``: its values but the micro-batch and the allocator, accumulation as 1 or 2."""
    out: list[tuple[str, Any]] = []
    for k, v in c.values:
        if k in (space.batch_axis, "allocator"):
            continue
        if k == space.accum_axis:
            v = min(int(v), 2)
        out.append((k, v))
    return tuple(out)


def micro_batch_of(space: Space, c: Config) -> int:
    return int(c.get(space.batch_axis)) if space.batch_axis else 0


@dataclass(frozen=True)
class TracePoint:
    """One trace to make: the class, the micro-batch, and the configuration traced (accumulation at most 2)."""

    key: ClassKey
    micro_batch: int
    config: Config


@dataclass
class Cost:
    """The kernels of one traced optimizer step (the trace's last), in two parts: each micro-batch's forward and
    backward (recomputation included) and the optimizer's (clipping, step, zero_grad); bytes and FLOPs per kernel
    (lists, in order), the collectives' bus bytes (ring factor applied, for the world size), and the number of
    micro-batches the step held."""

    micro_batches: int
    train_flops: list[int]
    train_bytes: list[int]
    optimizer_flops: list[int]
    optimizer_bytes: list[int]
    train_collective_bytes: float = 0.0
    optimizer_collective_bytes: float = 0.0
    ddp_allreduce_bytes: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"micro_batches": self.micro_batches, "train_kernels": len(self.train_flops),
                "train_flops": int(sum(self.train_flops)), "train_bytes": int(sum(self.train_bytes)),
                "optimizer_kernels": len(self.optimizer_flops), "optimizer_flops": int(sum(self.optimizer_flops)),
                "optimizer_bytes": int(sum(self.optimizer_bytes)),
                "collective_bus_bytes": int(self.train_collective_bytes + self.optimizer_collective_bytes
                                            + self.ddp_allreduce_bytes)}


def cost_of(op_costs: list[tuple[int, int, int]], collectives: list[tuple[int, str, int]],
            step_markers: list[dict[str, Any]], phase_markers: list[dict[str, Any]], *, micro_batches: int,
            world_size: int, ddp_bucket_bytes: int = 0) -> Cost:
    """:class:`Cost` of a trace's last optimizer step (from its last step marker), each kernel in the phase of the
    last phase marker before it (``optimizer`` or else the micro-batches'). ``ddp_bucket_bytes``: DDP's gradient
    buckets, all-reduced once a step (not traced: DDP is modelled). Collectives' bytes times
    :func:`collective_factor`."""
    start = max((m["time_us"] for m in step_markers), default=0)
    marks = sorted((m["time_us"], m["phase"]) for m in phase_markers)

    def phase(t: int) -> str:
        p = "train"
        for mt, name in marks:
            if mt > t:
                break
            p = name
        return p

    tf: list[int] = []
    tb: list[int] = []
    of: list[int] = []
    ob: list[int] = []
    for t, fl, by in op_costs:
        if t < start:
            continue
        if phase(t) == "optimizer":
            of.append(fl)
            ob.append(by)
        else:
            tf.append(fl)
            tb.append(by)
    tc = oc = 0.0
    for t, name, size in collectives:
        if t < start:
            continue
        bus = collective_factor(name, world_size) * size
        if phase(t) == "optimizer":
            oc += bus
        else:
            tc += bus
    ddp = collective_factor("allreduce", world_size) * ddp_bucket_bytes if world_size > 1 else 0.0
    return Cost(max(micro_batches, 1), tf, tb, of, ob, tc, oc, ddp)


def collective_factor(op_name: str, world_size: int) -> float:
    """Bytes on the bus per byte of a collective on ``world_size`` ranks (ring): ``2(N−1)/N`` for an all-reduce,
    ``(N−1)/N`` for an all-gather or a reduce-scatter (the largest tensor: the gathered output, the scattered
    input), 0 on one rank."""
    n = max(world_size, 1)
    base = (n - 1) / n
    name = op_name.lower()
    return base * next((f for k, f in COLLECTIVE_FACTORS.items() if k in name), 1.0)


@dataclass
class Traced:
    """One trace's facts: its point, per allocator setting the replay's ``(peak_reserved_bytes,
    peak_allocated_bytes, oom)`` (where it ran out, the peaks of its replay without a limit: what it needs), the model state the trace recorded (bytes), the cost, and its wall time (s)."""

    point: TracePoint
    settings: dict[str, tuple[int, int, bool]]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    cost: Cost
    wall_s: float
    events: int = 0


@dataclass
class Memory:
    """A candidate's memory: peak reserved and allocated (bytes), the replay ran out (``oom``), fits (with the
    margin), and how it is known (:data:`MEMORY_BASES`); ``between``: the traced micro-batches an interpolated one
    lies between."""

    peak_reserved_bytes: int
    peak_allocated_bytes: int
    oom: bool
    fits: bool
    basis: str
    between: tuple[int, int] | None = None


def fits_in(peak_reserved: int, oom: bool, room_bytes: int, margin: int) -> bool:
    """Fits: the replay does not run out, and its peak reserved plus the margin is within the room."""
    return not oom and peak_reserved + margin <= room_bytes


def memory_of(space: Space, c: Config, traced: dict[tuple[ClassKey, int], Traced], room_bytes: int,
              margin: int) -> Memory | None:
    """``c``'s memory from the traces of its class (see the module doc); None when its class has no trace."""
    key, mb, alloc = class_key(space, c), micro_batch_of(space, c), c.get("allocator")
    mine = sorted((m, t) for (k, m), t in traced.items() if k == key and alloc in t.settings)
    if not mine:
        return None
    at = dict(mine)
    if mb in at:
        r, a, oom = at[mb].settings[alloc]
        return Memory(r, a, oom, fits_in(r, oom, room_bytes, margin), "traced")
    below = [(m, t) for m, t in mine if m < mb]
    above = [(m, t) for m, t in mine if m > mb]
    if not below or not above:  # outside the traced range: the nearest trace bounds it (never recommended)
        m, t = (above[0] if above else below[-1])
        r, a, oom = t.settings[alloc]
        fit_up = bool(above) and fits_in(r, oom, room_bytes, margin)
        return Memory(r, a, oom, fit_up, "interpolated", (m, m))
    (m0, t0), (m1, t1) = below[-1], above[0]
    r0, a0, o0 = t0.settings[alloc]
    r1, a1, o1 = t1.settings[alloc]
    w = (mb - m0) / (m1 - m0)
    r, a = int(round(r0 + w * (r1 - r0))), int(round(a0 + w * (a1 - a0)))
    fit1 = fits_in(r1, o1, room_bytes, margin)
    fit0 = fits_in(r0, o0, room_bytes, margin)
    # monotone in the micro-batch: a larger traced one fits -> this fits; a smaller one does not -> this does not
    fits = True if fit1 else False if not fit0 else fits_in(r, o1 and o0, room_bytes, margin)
    oom = o0 or (o1 and not fits)
    return Memory(r, a, oom, fits, "interpolated", (m0, m1))


def first_traces(space: Space, configs: list[Config]) -> list[TracePoint]:
    """Each memory class at its smallest and largest micro-batch."""
    out: dict[tuple[ClassKey, int], TracePoint] = {}
    by_key = _classes(space, configs)
    for key, pts in by_key.items():
        mbs = sorted(pts)
        for m in {mbs[0], mbs[-1]}:
            out[(key, m)] = pts[m]
    return list(out.values())


def _classes(space: Space, configs: list[Config]) -> dict[ClassKey, dict[int, TracePoint]]:
    by_key: dict[ClassKey, dict[int, TracePoint]] = {}
    for c in configs:
        if c.get("allocator") != space.allocators[0]:
            continue
        key, mb = class_key(space, c), micro_batch_of(space, c)
        traced_cfg = c
        if space.accum_axis is not None and c.get(space.accum_axis) is not None:
            traced_cfg = c.replace(**{space.accum_axis: min(int(c.get(space.accum_axis)), 2)})
        by_key.setdefault(key, {})[mb] = TracePoint(key, mb, traced_cfg)
    return by_key


def next_traces(space: Space, configs: list[Config], traced: dict[tuple[ClassKey, int], Traced], room_bytes: int,
                margin: int) -> list[TracePoint]:
    """The traces that settle which micro-batches fit, for every class and allocator setting: where untraced
    micro-batches lie between the largest traced one that fits and the smallest traced one above it that does
    not, the one the line through those two puts just below the room (else the middle one)."""
    out: dict[tuple[ClassKey, int], TracePoint] = {}
    for key, pts in _classes(space, configs).items():
        mine = {m: t for (k, m), t in traced.items() if k == key}
        for alloc in space.allocators:
            ok = [m for m, t in mine.items() if alloc in t.settings and fits_in(t.settings[alloc][0],
                                                                               t.settings[alloc][2], room_bytes, margin)]
            lo = max(ok, default=None)
            bad = [m for m, t in mine.items() if alloc in t.settings and m not in ok and (lo is None or m > lo)]
            hi = min(bad, default=None)
            if hi is None:
                continue
            gap = sorted(m for m in pts if (lo is None or m > lo) and m < hi and m not in mine)
            if not gap:
                continue
            pick = gap[len(gap) // 2]
            if lo is not None:
                r0, r1 = mine[lo].settings[alloc][0], mine[hi].settings[alloc][0]
                if r1 > r0:  # the line through lo and hi: the largest untraced size it says fits
                    guess = lo + (room_bytes - margin - r0) * (hi - lo) / (r1 - r0)
                    under = [m for m in gap if m <= guess]
                    pick = under[-1] if under else gap[0]
            out[(key, pick)] = pts[pick]
    return list(out.values())


# ------------------------------------------------------------------------------------------------- the cost


@dataclass(frozen=True)
class GpuSpec:
    """The GPU the cost model assumes: dense FLOP/s (bf16, or fp32 for an fp32 job), HBM bytes/s, NVLink bus bytes/s;
    ``name`` None: the figures of an H100 taken for a GPU given by its memory only."""

    name: str | None
    flops: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def gpu_spec(name: str | None, dtype: str = "bf16") -> GpuSpec:
    """:data:`GPU_SPECS` of ``name`` (case-insensitive), H100's for an unknown or unnamed GPU."""
    key = next((k for k in GPU_SPECS if name and k.lower() == name.lower()), None)
    f, b, link = GPU_SPECS[key or "H100-80GB"]
    if dtype == "fp32":
        f = FP32_FLOPS[key or "H100-80GB"]
    return GpuSpec(key, f, b, link)


def _roofline(flops: list[int], moved: list[int], spec: GpuSpec) -> float:
    f = spec.flops * MATMUL_EFFICIENCY
    b = spec.hbm_bytes_per_s * MEMORY_EFFICIENCY
    return sum(max(fl / f, by / b, KERNEL_FLOOR_S) for fl, by in zip(flops, moved))


@dataclass
class StepTime:
    """A predicted optimizer step (s): ``micro_batch_s`` each of ``grad_accum`` micro-batches (the larger of its
    device and host time), ``optimizer_s``, ``communication_s`` (exposed), ``overhead_s``; ``total_s``."""

    micro_batch_s: float
    micro_batch_device_s: float
    micro_batch_host_s: float
    grad_accum: int
    optimizer_s: float
    communication_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return self.grad_accum * self.micro_batch_s + self.optimizer_s + self.communication_s + self.overhead_s


def step_of_cost(cost: Cost, grad_accum: int, spec: GpuSpec) -> StepTime:
    """The step time of a traced cost, with ``grad_accum`` micro-batches (module doc, 3)."""
    n = cost.micro_batches
    dev = _roofline(cost.train_flops, cost.train_bytes, spec) / n
    host = len(cost.train_flops) * HOST_OP_S / n
    mb = max(dev, host)
    opt = max(_roofline(cost.optimizer_flops, cost.optimizer_bytes, spec), len(cost.optimizer_flops) * HOST_OP_S)
    link = spec.link_bytes_per_s
    per_mb = cost.train_collective_bytes / n / link  # FSDP's all-gathers and reduce-scatters, each micro-batch
    exposed = grad_accum * max(DP_EXPOSED * per_mb, per_mb - mb)
    step_comm = (cost.optimizer_collective_bytes + cost.ddp_allreduce_bytes) / link  # DDP: the last backward hides it
    exposed += max(DP_EXPOSED * step_comm, step_comm - mb * 2 / 3) if step_comm else 0.0
    return StepTime(mb, dev, host, grad_accum, opt, exposed, STEP_OVERHEAD_S)


def predicted_step(space: Space, c: Config, traced: dict[tuple[ClassKey, int], Traced], spec: GpuSpec
                   ) -> StepTime | None:
    """``c``'s step time: from its own trace, else the line between its class's traced neighbours (None: none)."""
    key, mb = class_key(space, c), micro_batch_of(space, c)
    ga = int(c.get(space.accum_axis) or 1) if space.accum_axis else 1
    mine = sorted((m, t) for (k, m), t in traced.items() if k == key)
    if not mine:
        return None
    at = dict(mine)
    if mb in at:
        return step_of_cost(at[mb].cost, ga, spec)
    below = [(m, t) for m, t in mine if m < mb]
    above = [(m, t) for m, t in mine if m > mb]
    if not below or not above:
        m, t = (above[0] if above else below[-1])
        s = step_of_cost(t.cost, ga, spec)
        scale = mb / m if m else 1.0  # device time per micro-batch grows with it; the host's does not
        dev = s.micro_batch_device_s * scale
        return StepTime(max(dev, s.micro_batch_host_s), dev, s.micro_batch_host_s, ga, s.optimizer_s,
                        s.communication_s, s.overhead_s)
    (m0, t0), (m1, t1) = below[-1], above[0]
    s0, s1 = step_of_cost(t0.cost, ga, spec), step_of_cost(t1.cost, ga, spec)
    w = (mb - m0) / (m1 - m0)

    def lerp(a: float, b: float) -> float:
        return a + w * (b - a)

    dev, host = lerp(s0.micro_batch_device_s, s1.micro_batch_device_s), lerp(s0.micro_batch_host_s,
                                                                             s1.micro_batch_host_s)
    return StepTime(max(dev, host), dev, host, ga, lerp(s0.optimizer_s, s1.optimizer_s),
                    lerp(s0.communication_s, s1.communication_s), s0.overhead_s)


def samples_per_step(space: Space, c: Config) -> int:
    """Samples one optimizer step takes over all GPUs: the global batch, or micro-batch × accumulation × GPUs; a
    script without a micro-batch knob counts optimizer steps (1)."""
    if space.global_batch is not None:
        return space.global_batch
    if space.batch_axis is None:
        return 1
    ga = int(c.get(space.accum_axis) or 1) if space.accum_axis else 1
    return micro_batch_of(space, c) * ga * space.world_size


# ------------------------------------------------------------------------------------------- the outcome


@dataclass
class TuneTrial:
    """A candidate run for real on the GPU: ``outcome`` (:data:`TRIAL_OUTCOMES`), wall ``seconds`` (GPU time, start
    included), the optimizer steps timed after the warm-up and their ``timed_seconds``, ``measured_samples_per_s``,
    PyTorch's peak reserved on rank 0 (bytes), ``unpredicted_oom`` (ran out of memory though predicted to fit), the
    ``log``.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema tune``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    config: dict[str, Any]
    """the configuration run (axis -> value, allocator included)"""
    outcome: str
    """'ran', 'oom' (PyTorch's out-of-memory message), 'failed', or 'ended-early' (exit code 0 before the steps
    asked)"""
    seconds: float
    """wall time of the run, its start included: the GPU time it took (s)"""
    steps_timed: int
    """optimizer steps timed, after the warm-up ones"""
    timed_seconds: float | None
    """wall time of the timed steps, the GPU waited for at both ends (s); null: not reached"""
    measured_samples_per_s: float | None
    """over the timed steps (samples/s; null: not reached)"""
    measured_peak_reserved_bytes: int | None
    """torch.cuda.max_memory_reserved() on rank 0 at the stop (bytes)"""
    predicted_peak_reserved_bytes: int
    """the traced peak reserved of this configuration (bytes)"""
    unpredicted_oom: bool
    """ran out of memory though predicted to fit"""
    log: str
    """the file holding the run's output"""
    within_margin: bool | None = None
    """the measured peak reserved is at most the predicted one plus the margin: the prediction held (null: no peak
    measured)"""


@dataclass
class Candidate:
    """One configuration: its memory (from preflight's traces), its predicted and measured throughput.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema tune``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    config: dict[str, Any]
    """axis -> value: hf: micro_batch, grad_accum, checkpointing (none, full, every-K), optimizer (fused, foreach,
    for-loop; adamw8bit, sgd), sharding (none, ddp), allocator (defaults or a PYTORCH_ALLOC_CONF value); a
    script: its knobs, the derived accumulation, allocator"""
    predicted_peak_reserved_bytes: int
    """the replay's peak reserved under this allocator setting (where it runs out: its replay's without a limit,
    what it needs): traced, or the line between the traced micro-batches of its class (bytes)"""
    predicted_peak_allocated_bytes: int
    """the replay's peak allocated (bytes)"""
    margin_bytes: int
    """what must stay free of the room: preflight's margin (bytes)"""
    room_bytes: int
    """the caching allocator's room on the GPU (bytes)"""
    fits: bool
    """the replay does not run out and peak reserved + margin <= room"""
    oom: bool
    """the replay runs out of memory"""
    memory_basis: str
    """'traced' (this configuration was traced) or 'interpolated' (from the traced micro-batches of its class)"""
    interpolated_between: list[int] | None
    """the traced micro-batches an interpolated one lies between"""
    predicted_step_s: float
    """the cost model's optimizer step (s)"""
    predicted_samples_per_s: float
    """what the cost model predicts (samples/s)"""
    measured_samples_per_s: float | None
    """measured on the GPU over the timed steps (samples/s; null: not run)"""
    samples_per_step: int
    """samples an optimizer step takes over all GPUs"""
    step: dict[str, float]
    """the predicted step's parts (s): micro_batch, micro_batch_device, micro_batch_host, grad_accum, optimizer,
    communication, overhead"""
    predicted_rank: int
    """1 = the fastest predicted configuration among those that fit (its allocator settings share the rank); 0: does
    not fit"""


@dataclass
class Suggestion:
    """What would make the job fit when nothing in the space does (numbers, estimated from the traces: model state
    divided by the shard count, the rest as traced): ``id`` (``fsdp2-full-shard``, ``more-gpus``,
    ``activation-checkpointing``, ``adamw8bit``, ``activations-exceed``), ``gpus``, ``per_gpu_bytes``."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    id: str
    """'fsdp2-full-shard', 'more-gpus', 'activation-checkpointing', 'adamw8bit' or 'activations-exceed'"""
    gpus: int | None
    """GPUs it needs"""
    per_gpu_bytes: int
    """the estimated peak on one GPU with it, the margin included (bytes)"""
    model_state_bytes: int
    """parameters, gradients and optimizer state of the whole model (bytes, traced)"""
    other_bytes: int
    """the rest of the smallest traced configuration's peak reserved (bytes)"""


@dataclass
class TraceInfo:
    """A trace made: its configuration, peak reserved under the default allocator settings (bytes), OOM, wall
    time (s)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    config: dict[str, Any]
    """the configuration traced (the accumulation at most 2)"""
    peak_reserved_bytes: dict[str, int]
    """allocator setting -> peak reserved (bytes)"""
    oom: dict[str, bool]
    """allocator setting -> the replay ran out"""
    model_state_bytes: int
    """parameters + gradients + optimizer state recorded (bytes)"""
    cost: dict[str, Any]
    """the traced step's kernels: micro_batches, train_kernels, train_flops, train_bytes, optimizer_kernels,
    optimizer_flops, optimizer_bytes, collective_bus_bytes"""
    wall_s: float
    """wall time of the trace and its replays (s)"""


@dataclass
class TuneOutcome:
    """``oomdoctor tune``'s answer.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema tune``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    job: dict[str, Any]
    """the job: hf_config, seq_len, dtype (hf), or command (a script)"""
    space: dict[str, Any]
    """what was searched: mode, axes, batch_axis, accum_axis, world_size, global_batch, allocators"""
    dropped_micro_batches: list[Any]
    """micro-batches left out: they do not divide the global batch"""
    gpu_name: str | None
    """the GPU assumed"""
    gpu_total_bytes: int
    """its memory (bytes)"""
    room_bytes: int
    """the caching allocator's room: total less the CUDA context (and NCCL's communicator on several GPUs; bytes)"""
    margin_bytes: int
    """preflight's margin kept free of the room (bytes)"""
    cost_model: dict[str, Any]
    """the constants of the cost model: the GPU's figures and the efficiencies"""
    candidates: list[Candidate]
    """every configuration, fastest predicted first among those that fit, then those that do not"""
    best: Candidate | None
    """the answer: the measured fastest of the trials that ran, else the predicted fastest that fits (null: none
    fits)"""
    measured: bool
    """best was measured on the GPU (false: the ranking is the cost model's)"""
    trials: list[TuneTrial]
    """the real runs made, in order"""
    traces: list[TraceInfo]
    """the traces made, in order"""
    nothing_fits: list[Suggestion]
    """when no candidate fits: what would, with numbers"""
    notes: list[TuneNote]
    """ids: accumulation-traced-at-2, trace-budget-reached, no-gpu, not-run, deepspeed-not-installed, fsdp2-needs-a-script,
    interpolated-not-run, samples-are-steps, top-not-measured, measured-peak-over-margin"""
    trace_seconds: float
    """wall time spent tracing on the CPU (s)"""
    gpu_seconds: float
    """wall time of the real runs (s)"""
    seconds: float
    """wall time of the whole search (s)"""
    best_peak_reserved_bytes: int | None = None
    """the peak reserved the answer rests on: the larger of its predicted peak and, where it ran, PyTorch's measured
    one (bytes; null: no answer)"""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------- the search


def evaluate(space: Space, configs: list[Config], traced: dict[tuple[ClassKey, int], Traced], room_bytes: int,
             margin: int, spec: GpuSpec) -> list[Candidate]:
    """Every configuration with its memory and predicted throughput, ranked: those that fit by predicted samples/s
    (ties: the default allocator first, then the larger micro-batch), then those that do not."""
    out: list[Candidate] = []
    for c in configs:
        mem = memory_of(space, c, traced, room_bytes, margin)
        st = predicted_step(space, c, traced, spec)
        if mem is None or st is None:
            continue
        sps = samples_per_step(space, c)
        out.append(Candidate(
            config=c.as_dict(), predicted_peak_reserved_bytes=mem.peak_reserved_bytes,
            predicted_peak_allocated_bytes=mem.peak_allocated_bytes, margin_bytes=margin, room_bytes=room_bytes,
            fits=mem.fits, oom=mem.oom, memory_basis=mem.basis,
            interpolated_between=list(mem.between) if mem.between else None, predicted_step_s=st.total_s,
            predicted_samples_per_s=sps / st.total_s if st.total_s > 0 else 0.0, measured_samples_per_s=None,
            samples_per_step=sps,
            step={"micro_batch": st.micro_batch_s, "micro_batch_device": st.micro_batch_device_s,
                  "micro_batch_host": st.micro_batch_host_s, "grad_accum": st.grad_accum,
                  "optimizer": st.optimizer_s, "communication": st.communication_s, "overhead": st.overhead_s},
            predicted_rank=0))
    order = {a: i for i, a in enumerate(space.allocators)}
    out.sort(key=lambda c: (not c.fits, -round(c.predicted_samples_per_s, 6), order.get(c.config["allocator"], 99),
                            -(int(c.config.get(space.batch_axis, 0)) if space.batch_axis else 0)))
    ranks: dict[_RunKey, int] = {}
    for c in (x for x in out if x.fits):  # allocator settings of one configuration share its rank
        c.predicted_rank = ranks.setdefault(_same_run(space, c), len(ranks) + 1)
    return out


def _same_run(space: Space, c: Candidate) -> _RunKey:
    return tuple((k, v) for k, v in c.config.items() if k != "allocator")


def top(space: Space, ranked: list[Candidate], k: int) -> list[Candidate]:
    """The first ``k`` candidates that fit, one per configuration (the allocator setting ranked first: the
    default where it fits)."""
    out: list[Candidate] = []
    seen: set[_RunKey] = set()
    for c in ranked:
        if not c.fits:
            continue
        key = _same_run(space, c)
        if key in seen:
            continue
        seen.add(key)
        out.append(c)
        if len(out) >= k:
            break
    return out


def config_of(c: Candidate) -> Config:
    return Config(tuple(c.config.items()))


def suggestions(space: Space, traced: dict[tuple[ClassKey, int], Traced], room_bytes: int, margin: int
                ) -> list[Suggestion]:
    """When nothing fits: what would, from the trace with the smallest peak (module doc of :class:`Suggestion`)."""
    if not traced:
        return []
    t = min(traced.values(), key=lambda x: x.settings[min(x.settings, key=lambda a: x.settings[a][0])][0])
    peak = min(v[0] for v in t.settings.values())
    state = t.parameter_bytes + t.gradient_bytes + t.optimizer_state_bytes

    def whole_of(x: Traced) -> int:  # a trace records its rank's state: a sharded one holds its share of it
        shards = space.world_size if dict(x.point.key).get("sharding") in ("fsdp2-full", "fsdp2-full-shard") else 1
        return (x.parameter_bytes + x.gradient_bytes + x.optimizer_state_bytes) * shards

    # the largest any trace holds: a script's classes name their sharding in its own words (shard=ddp,full), and the
    # smallest peak is often the sharded one's (its rank's share); where every class is sharded this is that share
    whole = max(whole_of(x) for x in traced.values())
    other = max(peak - state, 0)
    out: list[Suggestion] = []
    free = room_bytes - margin - other
    if free <= 0:
        return [Suggestion("activations-exceed", None, other + margin, whole, other)]
    need = max(math.ceil(whole / free), 1)
    if need > 1:
        sid = "fsdp2-full-shard" if need <= space.world_size else "more-gpus"
        out.append(Suggestion(sid, need, math.ceil(whole / need) + other + margin, whole, other))
    ck = dict(space.axes).get("checkpointing")
    if ck is not None and "full" not in ck:
        out.append(Suggestion("activation-checkpointing", None, peak + margin, whole, other))
    opts = dict(space.axes).get("optimizer")
    if opts is not None and "adamw8bit" not in opts and t.optimizer_state_bytes:
        # 8-bit states: 2 bytes a parameter where AdamW keeps 8 (two fp32 moments)
        saved = t.optimizer_state_bytes - t.optimizer_state_bytes // 4
        per_gpu = max(peak - saved, other) + margin
        if per_gpu <= room_bytes:  # said only where it would fit
            out.append(Suggestion("adamw8bit", None, per_gpu, whole, other))
    return out


TraceMany = Callable[[list[TracePoint]], list[Traced]]
RunTrials = Callable[[list[Candidate]], list[TuneTrial]]


@dataclass
class Search:
    """The state of one search (:func:`search`): the traces made and the notes."""

    traced: dict[tuple[ClassKey, int], Traced] = field(default_factory=dict[tuple[ClassKey, int], Traced])
    order: list[Traced] = field(default_factory=list[Traced])
    notes: list[TuneNote] = field(default_factory=list[TuneNote])

    def add(self, results: list[Traced]) -> None:
        for r in results:
            self.traced[(r.point.key, r.point.micro_batch)] = r
            self.order.append(r)


def search(space: Space, configs: list[Config], trace_many: TraceMany, *, room_bytes: int, spec: GpuSpec,
           top_k: int = 3, max_traces: int = MAX_TRACES, state: Search | None = None, what: str = "the job"
           ) -> tuple[list[Candidate], Search]:
    """Trace what settles the memory of every candidate, then what the top ``top_k`` need to be traced
    themselves (module doc, 2); return the ranked candidates. ``trace_many(points)`` traces a batch (in parallel,
    where the caller can). ``max_traces``: traces after the first two of each class.

    Raises:
        TuneError: the parameters the first traces recorded do not fit the room in any class
            (:func:`check_budget`; ``what`` names the job)."""
    margin = margin_bytes(room_bytes)
    st = state or Search()
    todo = [p for p in first_traces(space, configs) if (p.key, p.micro_batch) not in st.traced]
    st.add(trace_many(todo))
    if st.traced:
        check_budget(room_bytes, min(t.parameter_bytes for t in st.traced.values()), what)
    spent = 0
    while True:
        nxt = [p for p in next_traces(space, configs, st.traced, room_bytes, margin)
               if (p.key, p.micro_batch) not in st.traced]
        if not nxt:
            break
        if spent + len(nxt) > max_traces:
            nxt = nxt[: max(max_traces - spent, 0)]
            if "trace-budget-reached" not in st.notes:
                st.notes.append("trace-budget-reached")
            if not nxt:
                break
        st.add(trace_many(nxt))
        spent += len(nxt)
    while True:  # the top candidates are traced themselves before they are recommended or run
        ranked = evaluate(space, configs, st.traced, room_bytes, margin, spec)
        want: list[TracePoint] = []
        for c in top(space, ranked, top_k):
            if c.memory_basis != "traced":
                cfg = config_of(c)
                key = class_key(space, cfg)
                pts = _classes(space, configs).get(key, {})
                p = pts.get(micro_batch_of(space, cfg))
                if p is not None and (p.key, p.micro_batch) not in st.traced:
                    want.append(p)
        want = list({(p.key, p.micro_batch): p for p in want}.values())
        if not want:
            break
        if spent + len(want) > max_traces:
            if "trace-budget-reached" not in st.notes:
                st.notes.append("trace-budget-reached")
            break
        st.add(trace_many(want))
        spent += len(want)
    if space.accum_axis is not None and any(int(c.get(space.accum_axis) or 1) > 2 for c in configs):
        st.notes.append("accumulation-traced-at-2")
    return ranked, st


def recommendable(ranked: list[Candidate]) -> list[Candidate]:
    """Those that may be recommended or run: they fit, and were traced themselves."""
    return [c for c in ranked if c.fits and c.memory_basis == "traced"]


def within_margin(measured_peak_reserved: int | None, predicted_peak_reserved: int, margin: int) -> bool | None:
    """Did the prediction hold: the measured peak reserved at most the predicted one plus the margin (None: nothing
    measured)."""
    return None if measured_peak_reserved is None else measured_peak_reserved <= predicted_peak_reserved + margin


def answer_peak(c: Candidate, t: TuneTrial | None) -> int:
    """The peak reserved an answer rests on (bytes): the larger of the predicted one and, where the configuration
    ran, the one PyTorch measured; never a prediction the GPU contradicted upward."""
    measured = t.measured_peak_reserved_bytes if t is not None else None
    return max(c.predicted_peak_reserved_bytes, measured or 0)


def choose(space: Space, ranked: list[Candidate], trials: list[TuneTrial], top_k: int) -> tuple[Candidate | None, bool]:
    """The answer: the trial with the highest measured samples/s whose peak (:func:`answer_peak`) plus the margin
    is within the room (its candidate, measured), else the predicted fastest that may be recommended and that no
    run refuted (not measured)."""
    by = {_config_key(c.config): c for c in ranked}

    def refuted(t: TuneTrial) -> bool:  # it ran out of memory, or its measured peak plus the margin left the room
        c = by.get(_config_key(t.config))
        return t.outcome == "oom" or (c is not None and answer_peak(c, t) + c.margin_bytes > c.room_bytes)

    ran = [t for t in trials if t.outcome == "ran" and t.measured_samples_per_s and not refuted(t)
           and _config_key(t.config) in by]
    if ran:
        best_t = max(ran, key=lambda t: t.measured_samples_per_s or 0.0)
        return by[_config_key(best_t.config)], True
    gone = {_config_key(t.config) for t in trials if refuted(t)}  # never one the GPU refuted
    ok = [c for c in recommendable(ranked) if _config_key(c.config) not in gone]
    return (ok[0] if ok else None), False


def _config_key(cfg: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(cfg.items(), key=lambda kv: kv[0]))


def attach_trials(ranked: list[Candidate], trials: list[TuneTrial]) -> None:
    """Each candidate run gets its measured samples/s."""
    by = {tuple(sorted(t.config.items(), key=lambda kv: kv[0])): t for t in trials}
    for c in ranked:
        t = by.get(tuple(sorted(c.config.items(), key=lambda kv: kv[0])))
        if t is not None:
            c.measured_samples_per_s = t.measured_samples_per_s


def trace_info(t: Traced) -> TraceInfo:
    return TraceInfo(config=t.point.config.as_dict(), peak_reserved_bytes={a: v[0] for a, v in t.settings.items()},
                     oom={a: v[2] for a, v in t.settings.items()},
                     model_state_bytes=t.parameter_bytes + t.gradient_bytes + t.optimizer_state_bytes,
                     cost=t.cost.summary(), wall_s=round(t.wall_s, 2))


def cost_model_facts(spec: GpuSpec) -> dict[str, Any]:
    return {**spec.as_dict(), "matmul_efficiency": MATMUL_EFFICIENCY, "memory_efficiency": MEMORY_EFFICIENCY,
            "kernel_floor_s": KERNEL_FLOOR_S, "host_op_s": HOST_OP_S, "step_overhead_s": STEP_OVERHEAD_S,
            "dp_exposed": DP_EXPOSED}


def tune(space: Space, configs: list[Config], trace_many: TraceMany, *, run_trials: RunTrials | None,
         job: dict[str, Any],
         dropped: list[Any], gpu_name: str | None, gpu_total_bytes: int, room_bytes: int, spec: GpuSpec,
         top_k: int = 3, max_traces: int = MAX_TRACES, notes: Iterable[TuneNote] = (),
         clock: Callable[[], float] | None = None, what: str = "the job") -> TuneOutcome:
    """The whole search: memory and cost (:func:`search`), the top ``top_k`` run by ``run_trials`` (None: no GPU),
    the answer (:func:`choose`); the nothing-fits suggestions when nothing fits."""
    import time

    now = clock or time.monotonic
    t0 = now()
    ranked, st = search(space, configs, trace_many, room_bytes=room_bytes, spec=spec, top_k=top_k,
                        max_traces=max_traces, what=what)
    trace_s = now() - t0
    margin = margin_bytes(room_bytes)
    all_notes: list[TuneNote] = list(dict.fromkeys([*notes, *st.notes]))
    trials: list[TuneTrial] = []
    chosen = [c for c in top(space, ranked, top_k) if c.memory_basis == "traced"]
    if len(chosen) < len(top(space, ranked, top_k)):
        all_notes.append("interpolated-not-run")
    if run_trials is not None and chosen:
        trials = run_trials(chosen)
        attach_trials(ranked, trials)
    elif run_trials is None and "no-gpu" not in all_notes and "not-run" not in all_notes:
        all_notes.append("no-gpu")
    best, measured = choose(space, ranked, trials, top_k)
    if space.batch_axis is None:
        all_notes.append("samples-are-steps")
    if trials and not measured:
        all_notes.append("top-not-measured")
    if any(t.within_margin is False for t in trials):
        all_notes.append("measured-peak-over-margin")
    nothing = [] if any(c.fits for c in ranked) else suggestions(space, st.traced, room_bytes, margin)
    best_trial = next((t for t in trials if best is not None and _config_key(t.config) == _config_key(best.config)
                       and t.outcome == "ran"), None)
    return TuneOutcome(job=job, space=space.as_dict(), dropped_micro_batches=dropped, gpu_name=gpu_name,
                       gpu_total_bytes=gpu_total_bytes, room_bytes=room_bytes, margin_bytes=margin,
                       cost_model=cost_model_facts(spec), candidates=ranked, best=best, measured=measured,
                       trials=trials, traces=[trace_info(t) for t in st.order], nothing_fits=nothing,
                       notes=list(dict.fromkeys(all_notes)), trace_seconds=round(trace_s, 2),
                       gpu_seconds=round(sum(t.seconds for t in trials), 2), seconds=round(now() - t0, 2),
                       best_peak_reserved_bytes=answer_peak(best, best_trial) if best is not None else None)
