"""Memory accounting: every allocated byte on one line.

Categories (:data:`CATEGORIES`), after the profiler's memory categories
(``torch/profiler/_memory_profiler.py`` ``Category``) and ``torch.distributed._tools.mem_tracker``'s
``_MemRefType``, with communication, kept outputs, KV caches and workspaces named because they decide
jobs: ``parameters`` (with the fp32 master copies a mixed-precision optimizer steps, as the planner
counts them), ``gradients``, ``optimizer_state``, ``activations`` (saved for a backward, including those
of micro-batches in flight), ``temporaries`` (short-lived tensors, one-off caches), ``communication``
(collective buffers), ``outputs`` (tensors of one micro-batch kept while later ones run, which no
backward frees: logits or predictions gathered across batches), ``kv_cache`` (keys and values kept for
generation), ``workspaces`` (the per-process buffers cuBLAS, cuBLASLt and cuDNN allocate through the
caching allocator), ``weight_copy`` (module state no gradient reaches in a training job: a frozen teacher's
or reference model's weights, BatchNorm's running statistics, a copy of the trained weights kept beside them (an
EMA or SWA copy); never gradients nor optimizer state) and
``unknown``. A breakdown counts each block's requested bytes (the tensor's) in its
category and the allocator's rounding of them apart, on the line ``rounding``: allocated = requested +
rounding.

Each block (a row of :class:`~.lifetimes.Lifetimes`) gets one category, from two sources:

1. ``recorded``: the sidecar's storages of parameters, gradients and optimizer state, noted by
   ``oomdoctor run`` at the end of the first optimizer steps and at every dump
   (:mod:`oomdoctor.capture.facts`), and the workspaces ``oomdoctor preflight``'s tracer made (cuBLAS's, one per
   thread, kept for good: :mod:`oomdoctor.preflight.snapshot`); the block that contained a storage then is that
   category.
2. ``trace``: the block's lifetime against the phases of :mod:`.phases` (born and freed where), and its
   allocation stack. A block born before the trace (a wrapped ring buffer) is placed by its allocation
   stack (the final segments keep it; a free event carries it under ``context="alloc"``) and by its
   lifetime across the steps the trace shows; one that no stack places and that lives through the training
   passes is a parameter where the gradients the engine's thread keeps at every torch optimizer step match
   such blocks one to one by size (recording begun after ``model.cuda()``: :func:`_params_of_gradients`);
   what none of these places is ``unknown``, never a guess.

   - born at setup and alive through the training passes: parameters when module construction, loading
     or moving made it (the ``setup`` frames, an installed package's constructor ``__init__``; a constructor
     of the job's own code only where a gradient of the block's size shows: a GPU dataset or a static KV
     cache made in ``__init__`` is unknown), ``weight_copy`` where no gradient of the autograd engine's
     matches them in a job whose other parameters get theirs, or where they copy every weight beside the
     parameters (an EMA copy: :func:`_frozen`), optimizer state when optimizer
     code did, communication when a collective's (DDP's buckets); any other such block is unknown (a
     batch preloaded on the GPU is not a parameter); freed at setup: temporaries;
   - born in the optimizer's work (an ``Optimizer.step#`` window, optimizer frames, or the main thread
     between a backward and the next pass when an update shows there): gradients when alive at a torch
     optimizer's ``step`` and freed after it, before the next pass (DeepSpeed's fp32 gradient partition,
     the optimizer's input); optimizer state when it outlives a later pass (Adam's moments made lazily at
     the first step, a hand-written optimizer's state); else temporaries;
   - born in backward (the autograd engine's threads): gradients when it outlives the backward run
     (``AccumulateGrad``, FSDP's reduce-scatter output), else temporaries or communication;
   - born in a forward, evaluation or generation pass: activations when a backward frees it (a pipeline's
     micro-batches in flight too); a KV cache when transformers' ``Cache`` code made it (a name rule), or
     when model code replaces it pass after pass by a larger one (a cache concatenated by hand); outputs
     when still allocated after the next pass began and no backward frees it (freed later, or one of
     several such blocks of the same stack, or of the same site and size from different call paths, as a
     pipeline schedule's warm-up and steady loops make them: accumulation); communication for a collective's
     buffer; else
     temporaries;
   - still allocated when the trace ends inside its own pass (an OOM): what the same allocation became
     in the last finished pass; in a first pass with none before it, an activation when its site recurs
     in the pass with every block still allocated (one per layer: saved for backward), else what most of
     its site's blocks became;
   - workspaces: a C++ stack naming a library's workspace getter (``stacks="all"``); with Python stacks, a
     block never freed that an op made on its first call beside its output (the first block of its stack,
     of a size none of that stack's freed blocks has), or one the engine thread kept whose size is no
     parameter's (a gradient has its parameter's shape: a parameter's, a block's that lived through the
     trace from before it or from setup, or a gradient's of another backward that the optimizer's work
     freed; recording begun after ``model.cuda()`` leaves no parameter block in the trace).

The byte identity: the lines at an event sum to the allocated bytes then (asserted by
:meth:`Breakdown.check` and in :func:`breakdown`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Iterable, Literal, get_args

import numpy as np

from ..frameworks import WORKSPACE_CPP, cpp_function
from ..ids import (
    BREAKDOWN_LINES,
    UNKNOWN_WHYS,
    BreakdownCategory,
    BreakdownLine,
    BreakdownPoint,
    PhaseSource,
    UnknownWhy,
)
from ..trace.model import DeviceTrace, Trace
from .arrays import distinct, distinct_columns, stable_argsort
from .lifetimes import IN_TRACE, Lifetimes
from .phases import (
    BACKWARD_PHASE,
    EVALUATION_PHASE,
    GENERATION_PHASE,
    INFERRED,
    OPTIMIZER_PHASE,
    OTHER_PHASE,
    PASS_PHASES,
    SETUP_PHASE,
    Phases,
    role_index,
)
from .sites import site_index

CATEGORIES: tuple[BreakdownCategory, ...] = get_args(BreakdownCategory)
"""The categories (:data:`oomdoctor.ids.BreakdownCategory`), indexed by the constants below."""
(PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, TEMPORARIES, COMMUNICATION, OUTPUTS, KV_CACHE, WORKSPACES,
 WEIGHT_COPY, BUFFERS, UNKNOWN) = range(12)
ROUNDING: Literal["rounding"] = "rounding"
LINES: tuple[BreakdownLine, ...] = BREAKDOWN_LINES
"""The lines of a breakdown: the categories' requested bytes, then the allocator's rounding of them."""
RECORDED, TRACE = 1, 0
UNKNOWN_WHY: tuple[UnknownWhy, ...] = UNKNOWN_WHYS
"""Why blocks are ``unknown`` (:attr:`Breakdown.unknown_why`). The first three are read off each block's birth and
stack; the last two are said by a rule (:attr:`Accounting.why`): module state of a size no trained parameter has
(``frozen_or_buffer``: frozen weights or registered buffers, which only the sidecar's modules tell apart), and
blocks of a trained parameter's size beyond its gradients that module construction made without copying every
weight (``copy_or_buffer``: BatchNorm's statistics, say, or a part of a model kept frozen)."""
(_BEFORE_NO_STACK, _BEFORE, _IN_TRACE, FROZEN_OR_BUFFER, COPY_OR_BUFFER) = range(5)
UNNAMED = "unnamed"
"""The maker of weight copies or buffers no module record or frame names (:attr:`Breakdown.weight_copy_by`)."""

#: Categories whose bytes grow with the micro-batch (used by what fits): tensors of the batch's passes.
BATCH_SCALED = (ACTIVATIONS, TEMPORARIES, OUTPUTS, KV_CACHE)


@dataclass
class Accounting:
    """Per lifetime row (arrays of length ``len(lifetimes)``): ``category`` (index into
    :data:`CATEGORIES`), ``source`` (:data:`RECORDED` or :data:`TRACE`), ``born_phase`` (index into
    :data:`~.phases.PHASE_NAMES`; the phase its stack says for a block born before the trace), and
    ``batch_scaled``: whether its size grows with the micro-batch."""

    category: np.ndarray
    source: np.ndarray
    born_phase: np.ndarray
    batch_scaled: np.ndarray
    why: np.ndarray | None = None
    """per row, why a rule left it ``unknown`` (an index into :data:`UNKNOWN_WHY`; -1: read off its birth)"""
    maker: np.ndarray | None = None
    """per row of ``weight_copy`` or ``buffers``, who made it (an index into ``makers``; -1: unnamed)"""
    makers: list[str] = field(default_factory=list[str])
    """the makers: ``module <class path>[.<child>]`` from the sidecar's modules, ``copy.deepcopy`` or
    ``<file>:<line> <function>`` from the block's stack"""


@dataclass
class Breakdown:
    """Allocated bytes after event ``event_index`` by line (:data:`LINES`: each category's requested bytes,
    then ``rounding``). ``at`` names the point (``oom``, ``peak_allocated``, ``peak_reserved``,
    ``optimizer_start``, ``backward_end``); ``sources`` says per category with bytes whether most of them
    came from recorded facts or from the trace; ``phase_source`` says what set the phase
    (:data:`~.phases.SOURCE_NAMES`). ``unknown_why``: the ``unknown`` line's requested bytes by why no signal
    placed them (:data:`UNKNOWN_WHY`; only reasons with bytes): the blocks were born before the trace and no
    allocation stack of theirs survives (``before_trace_no_stack``: the ring buffer dropped their allocation, and
    neither the final segments nor a free event keeps its frames), born before the trace with a stack that no rule
    places (``before_trace``), or born in the trace (``in_trace``: no lifetime, gradient or frame says what they
    are).

    The docstring under each field is its description in the JSON schema (``oomdoctor schema diagnose``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    at: BreakdownPoint
    """the moment: the OOM, the peaks, or where each optimizer step began (or each backward ended)"""
    event_index: int
    """the event after which the live blocks are counted"""
    step: int | None
    """the training step (from 0) of that event"""
    phase: str
    """the phase of that event (setup, forward, backward, optimizer, evaluation, generation, other)"""
    categories: dict[BreakdownLine, int]
    """requested bytes per category (parameters, gradients, optimizer_state, activations, temporaries,
    communication, outputs, kv_cache, workspaces, weight_copy, unknown) and the allocator's 'rounding'; they add
    up to allocated_bytes (bytes)"""
    sources: dict[BreakdownCategory, str]
    """per category: from what the job recorded (the sidecar's storages) or read from the trace"""
    allocated_bytes: int
    """allocated after that event: requested + rounding (bytes)"""
    counts: dict[BreakdownCategory, int] = field(default_factory=dict[BreakdownCategory, int])
    """live blocks per category"""
    phase_source: PhaseSource = "inferred"
    """what set the phase: markers, annotations, autograd engine thread, frames or inferred"""
    unknown_why: dict[UnknownWhy, int] = field(default_factory=dict[UnknownWhy, int])
    """the unknown bytes by why no signal placed them: before_trace_no_stack (born before the trace, no allocation
    stack survives), before_trace (born before it, its stack places nothing), in_trace, frozen_or_buffer (module
    state of a size no trained parameter has: frozen weights or registered buffers, which only a sidecar's modules
    tell apart), copy_or_buffer (module state of a trained parameter's size beyond its gradients that copies no
    whole model: buffers such as BatchNorm's statistics, or part of a model kept frozen); they add up to
    categories.unknown (bytes)"""
    weight_copy_by: dict[str, int] = field(default_factory=dict[str, int])
    """the weight_copy bytes by who made them: 'module <class path>[.<child>]' (the sidecar's modules: a frozen
    teacher, a reference model, a momentum encoder, LoRA's frozen base), 'copy.deepcopy' or '<file>:<line>
    <function>' (the frame that made the copy), 'unnamed'; they add up to categories.weight_copy (bytes)"""
    buffers_by: dict[str, int] = field(default_factory=dict[str, int])
    """the buffers bytes by the module that registered them ('module <class path>[.<child>]'), 'unnamed'; they add
    up to categories.buffers (bytes)"""

    def check(self) -> None:
        """Assert the identity: the lines add up to the allocated bytes."""
        assert sum(self.categories.values()) == self.allocated_bytes, (self.categories, self.allocated_bytes)


def _runs(phase: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each event (``phase`` non-empty), the first and last event index of its run of equal phase."""
    n = phase.shape[0]
    change = np.flatnonzero(np.diff(phase)) + 1
    starts = np.concatenate(([0], change))
    ends = np.concatenate((change - 1, [n - 1]))
    opens = np.zeros(n, dtype=np.int64)
    opens[change] = 1
    rid = np.cumsum(opens)  # the run of each event: runs opened at or before it, less the first (a count, not a search)
    return starts[rid], ends[rid]


def _stacks_with(trace: Trace, stacks: np.ndarray, names: tuple[str, ...], cpp: bool = False) -> np.ndarray:
    """Per row: does its stack have a frame whose function is one of ``names`` (exactly; ``cpp``: a C++ frame's
    qualified name, :func:`~oomdoctor.frameworks.cpp_function`)?"""
    frames = trace.stacks.frames
    used = set(chain.from_iterable(trace.stacks.stacks))  # each frame named once, not once per stack holding it
    named = {f for f in used if (cpp_function(frames[f][2]) if cpp else frames[f][2]) in names}
    return _rows_of(trace, stacks, [s for s, fids in enumerate(trace.stacks.stacks) if not named.isdisjoint(fids)])


_INSTALLED = ("site-packages/", "dist-packages/")
"""Path fragments of installed packages: a frame under them is a library's code, not the job's own."""


def _library_init(trace: Trace, stacks: np.ndarray) -> np.ndarray:
    """Per row: the innermost constructor (``__init__``) of its stack is an installed package's (a framework
    building the model's state: DeepSpeed's engine making its fp32 master copies); a constructor of the
    job's own code inside it made the tensor (a static KV cache made in a module's ``__init__`` that
    ``nn.ModuleList.__init__`` called) and needs a gradient of the block's size as well (see :func:`account`)."""
    frames = trace.stacks.frames

    def library(fids: Iterable[int]) -> bool:
        f = next((f for f in fids if frames[f][2] == "__init__"), None)
        return f is not None and any(x in frames[f][0].replace("\\", "/") for x in _INSTALLED)

    return _rows_of(trace, stacks, [s for s, fids in enumerate(trace.stacks.stacks) if library(fids)])


def _rows_of(trace: Trace, stacks: np.ndarray, ids: list[int]) -> np.ndarray:
    """Per row: is its stack id (``stacks``; -1 for none) one of ``ids``? A lookup in a table of the trace's
    stacks (the row-by-row set test took 30 ms of the 271,109 events of ``large``)."""
    n = len(trace.stacks.stacks)
    table = np.zeros(n + 1, dtype=bool)  # the last entry answers a row without a stack (-1)
    table[ids] = True
    return table[np.where(stacks >= 0, stacks, n)]


def account(trace: Trace, dt: DeviceTrace, lt: Lifetimes, ph: Phases, free_stacks: bool = False) -> Accounting:
    """Categorise every row of ``lt`` (see the module doc). ``free_stacks``: frees were recorded with
    stacks of their own (``context="all"``), so a dropped allocation's free event says where it was freed,
    not where it was made. Pure; O(rows log rows)."""
    n = dt.num_events
    rows = len(lt)
    ri = role_index(trace)
    b = lt.alloc
    d = np.where(lt.free_requested >= 0, lt.free_requested, lt.free_completed)
    pre = (b < 0) | (lt.start_state != IN_TRACE)
    persistent = d < 0
    comm = ri.lookup(ri.communication, lt.stack)
    optim = ri.lookup(ri.optimizer, lt.stack)
    model = ri.lookup(ri.model, lt.stack)
    engine = ri.engine(lt.stack, ph.python_stacks)
    own = ri.roles_of(lt.stack, ph.python_stacks)  # the block's own stack, before smoothing
    said = (lt.stack >= 0) & (own != OTHER_PHASE)
    bp = np.where(pre & said, own, -1).astype(np.int64)  # born before the trace: what its stack says, if anything
    dp = np.full(rows, -1, dtype=np.int64)
    b_end = np.full(rows, -1, dtype=np.int64)
    b_run = np.full(rows, -1, dtype=np.int64)  # the first event of the run each block was born in (-1: before)
    end_run = -1  # the first event of the run the trace ends in
    gap = np.zeros(rows, dtype=bool)
    if n:
        at = np.clip(b, 0, n - 1)
        bp = np.where(pre, bp, ph.phase[at])
        dp = np.where(d >= 0, ph.phase[np.clip(d, 0, n - 1)], -1)
        if free_stacks and lt.free_stack is not None:  # where a dropped allocation was freed, from its own stack
            fs = ri.roles_of(lt.free_stack, ph.python_stacks)
            dp = np.where(pre & (lt.free_stack >= 0) & (fs != OTHER_PHASE), fs, dp)
        # the start and end of the run each block was born in; born before the trace inside the backward the trace
        # begins in, that run's end (freed inside it, it did not outlive it)
        run_start, run_end = _runs(ph.phase)
        b_end = np.where(b >= 0, run_end[at], run_end[0] if ph.phase[0] == BACKWARD_PHASE else -1)
        b_run, end_run = np.where(b >= 0, run_start[at], -1), int(run_start[-1])
        if ph.after_backward is not None:
            gap = ~pre & ph.after_backward[at]
    starts = ph.pass_starts
    first_pass = int(starts[0]) if starts.size else n
    last_pass = int(starts[-1]) if starts.size else n
    bounds = np.append(starts, [n, n])
    # the pass each block was born in (-1: before the first, or before the trace), the first pass beginning after
    # it, and the one after that
    after = np.searchsorted(starts, np.maximum(b, 0), side="right")
    bpass = np.where(pre, -1, after - 1)
    nxt = np.where(pre, first_pass, bounds[after])
    nxt2 = bounds[np.searchsorted(starts, nxt, side="right")]
    cat = np.full(rows, UNKNOWN, dtype=np.int8)
    todo = np.ones(rows, dtype=bool)

    def put(mask: np.ndarray, category: int) -> None:
        nonlocal todo
        mask = mask & todo
        cat[mask] = category
        todo &= ~mask

    # the libraries' workspaces, where C++ frames name them
    if ph.stacks_recorded:
        put(_stacks_with(trace, lt.stack, WORKSPACE_CPP, cpp=True), WORKSPACES)
    # KV caches by name (transformers' Cache classes), in inference; in training a backward frees them
    cache = ri.lookup(ri.cache, lt.stack) & (dp != BACKWARD_PHASE)
    put(cache & (np.isin(bp, (GENERATION_PHASE, EVALUATION_PHASE)) | (not ph.has_backward)), KV_CACHE)

    # the first torch optimizer step beginning after each block was born (n: none in the trace)
    s_opt = ph.optimizer_starts if ph.optimizer_starts is not None else np.zeros(0, np.int64)
    s_opt = s_opt[s_opt >= 0]  # steps that began before the trace's first event say nothing of its blocks
    i = np.searchsorted(s_opt, b, side="left")
    s = np.where(i < s_opt.size, s_opt[np.minimum(i, max(s_opt.size - 1, 0))], n) if s_opt.size else np.full(rows, n)
    alive_at_step = (s < n) & (persistent | (d > s))

    # setup: what lives through the training passes (until the last one began, or to the end: teardown
    # frees the rest) is the model's state when module code made it: the setup frames (building, loading,
    # moving the model; a torch.nn module's constructor), or a constructor of the job's own code (an
    # ``__init__`` frame) where a gradient of its size shows (the autograd engine's thread made a block of
    # that size that outlived its backward): a dataset moved to the GPU in ``Dataset.__init__`` or a static
    # KV cache made in a module's ``__init__`` has none, and stays unknown
    setup = bp == SETUP_PHASE
    lives = persistent | (d >= last_pass)
    # the sizes of the parameters that are trained (the engine accumulates a gradient of each one's shape into its
    # .grad, AccumulateGrad): the sidecar's (what the optimizers step, their gradients, the modules' parameters with
    # a gradient), the optimizer's state (Adam's moments, SGD's momentum: one of each trained parameter's shape,
    # made by the optimizer and kept), and the engine's blocks a torch optimizer step found alive that the
    # optimizer's work then freed (zero_grad(set_to_none=True)). None of these (no torch optimizer step in the
    # trace, a plain SGD with set_to_none=False), or sizes no block a backward kept has: every size may be a
    # gradient's, as before
    outlives_pass = np.where(s < n, alive_at_step, persistent | (d >= nxt2))
    model_code = np.isin(own, PASS_PHASES) | model
    evidence = (own == OPTIMIZER_PHASE) | optim
    if n and ph.source is not None:
        evidence |= ~pre & (ph.source[np.clip(b, 0, n - 1)] != INFERRED)
    state_like = (bp == OPTIMIZER_PHASE) & evidence & outlives_pass & ~comm & (s_opt.size > 0)
    regrown = (bp == BACKWARD_PHASE) & engine & ~persistent & alive_at_step & (dp == OPTIMIZER_PHASE)
    # ... and a backward's block a step found alive that the next backward replaced (FSDP1's sharded gradient of a
    # flat parameter, whose optimizer state is per original parameter, of other sizes), or that never goes and
    # lived through two steps (zero_grad(set_to_none=False) keeps each .grad): a leaf's .grad that the next
    # forward replaces (LoRA) is neither
    replaced = (bp == BACKWARD_PHASE) & ~persistent & alive_at_step & (dp == BACKWARD_PHASE) & (d > s)
    kept_two = (bp == BACKWARD_PHASE) & engine & persistent & (s_opt.size >= 2) & (
        b < (s_opt[-2] if s_opt.size >= 2 else -1))
    # none of these three says a size where a block of it is a leaf's .grad that no parameter owns (the embeddings'
    # output made to require gradients for LoRA): the engine's block a step found alive that a later pass freed (the
    # next forward rebinds the leaf); the last step's one goes after the optimizer's work, when the job ends (regrown,
    # by its place), and the backward thread's cuBLAS workspace may have its size (kept_two): 32 MiB on Hopper, the
    # .grad of a 4 x 1024 x 2048 fp32 output (issue 54's LoRA run on an H200, docs/corpus/models-lora)
    leaf_grad = (bp == BACKWARD_PHASE) & engine & alive_at_step & np.isin(dp, PASS_PHASES)
    leaf_sized = np.isin(lt.requested, distinct(lt.requested[leaf_grad]))
    # (np.union1d would import numpy.ma: tests/unit/test_startup.py)
    trainable_sizes = distinct(np.concatenate([_recorded_trained_sizes(trace), lt.requested[
        state_like | ((regrown | replaced | kept_two) & ~leaf_sized)]]))
    trainable = np.isin(lt.requested, trainable_sizes) if trainable_sizes.size else np.ones(rows, bool)
    kept_past = (bp == BACKWARD_PHASE) & engine & np.where(s < n, alive_at_step, persistent | (d > b_end))
    if not (kept_past & trainable).any():  # the sizes match no block a backward kept: they say nothing here
        trainable = np.ones(rows, bool)
    trained = kept_past & trainable
    has_gradient = np.isin(lt.requested, distinct(lt.requested[trained]))
    construct = (own == SETUP_PHASE) | _library_init(trace, lt.stack) | (
        _stacks_with(trace, lt.stack, ("__init__",)) & has_gradient)
    put(setup & lives & comm, COMMUNICATION)
    put(setup & lives & optim, OPTIMIZER_STATE)
    # module state no gradient reaches (a frozen teacher, BatchNorm's running statistics, an EMA copy of the
    # weights: blocks of the gradients' sizes beyond one step's gradients), where every gradient is
    # the autograd engine's own: no collective ran in a backward (FSDP's and DeepSpeed's gradients are a
    # reduce-scatter's shards, DDP's may be views of its buckets)
    per_param = s_opt.size > 0 and not ((bp == BACKWARD_PHASE) & comm).any()
    copies, unsure = _frozen(setup & lives & todo, construct, lt.stack, lt.requested, b, trained, s, per_param)
    put(copies, WEIGHT_COPY)
    why = np.full(rows, -1, dtype=np.int8)
    why[unsure >= 0] = unsure[unsure >= 0]
    put(unsure >= 0, UNKNOWN)
    put(setup & lives & construct, PARAMETERS)
    put(setup & lives, UNKNOWN)
    put(setup, TEMPORARIES)


    # the optimizer's work: its input, its state, its temporaries
    opt = bp == OPTIMIZER_PHASE
    fed = alive_at_step & ~persistent & (s < nxt) & (d < bounds[np.searchsorted(starts, s, side="right")])
    put(opt & fed, GRADIENTS)
    # state is still there when the next torch optimizer step begins (where the trace shows one), else it
    # outlives the next whole pass (outlives_pass, above); state needs the optimizer's own evidence (above): its
    # frames or annotation window, or the update's place (the main thread between a backward and the next pass),
    # not a phase merely continued (the next batch's transfer after the step)
    put(((opt & evidence) | (gap & ~model_code)) & outlives_pass & ~comm, OPTIMIZER_STATE)
    put(opt & comm, COMMUNICATION)
    put(opt, TEMPORARIES)

    # backward: gradients outlive the backward run; a block the engine's thread keeps for good that no
    # parameter's shape matches is a workspace (cuBLAS's for that thread's handle)
    bw = bp == BACKWARD_PHASE
    # alive when the next torch optimizer step begins, where the trace shows one; else past its backward run
    outlives = np.where(s < n, alive_at_step, persistent | (d > b_end)) | (pre & (dp != BACKWARD_PHASE))
    # a gradient has its parameter's shape: the size of a parameter; where no parameter was born in the
    # trace (recording began after model.cuda()), of a block that lived through the trace from before it or
    # from setup (the model's state); for a block born after the last torch optimizer step began (the last
    # step's gradients, which no zero_grad freed yet), of a gradient the engine's thread made in an earlier
    # backward that lived to a step and that the optimizer's work freed (zero_grad(set_to_none=True))
    shapes = lt.requested[cat == PARAMETERS]
    if not shapes.size:
        shapes = lt.requested[(persistent | (d >= last_pass)) & ((bp == SETUP_PHASE) | (pre & (bp < 0)))]
    gradient_shaped = np.isin(lt.requested, distinct(shapes))
    gradient_shaped |= (s >= n) & np.isin(lt.requested, distinct(lt.requested[regrown]))
    kept_for_good = (persistent & (b_end < n - 1)) | ((b < last_pass) & (d >= last_pass))  # to the end, or teardown
    put(bw & engine & ~gradient_shaped & kept_for_good, WORKSPACES)
    if n and ph.phase[-1] == BACKWARD_PHASE:
        # the trace ends inside a backward (an OOM): whether a block outlives it is unknown; the same
        # allocation in the previous backward says, else most of that stack's, else a temporary (a
        # gradient only where FSDP's post-backward made it)
        op = bw & persistent & (b_run == end_run) & todo
        reduce = _stacks_with(trace, lt.stack, ("post_backward", "_post_backward_hook", "foreach_reduce"))
        finished = np.where(outlives & ~comm, GRADIENTS, np.where(comm, COMMUNICATION, TEMPORARIES)).astype(np.int8)
        fate = _fate_of_open(np.where(todo, finished, cat), bw & ~op & todo, op, b, b_run, lt.stack, TEMPORARIES)[0]
        fate = np.where(reduce[op] & (fate == TEMPORARIES), GRADIENTS, fate)
        cat[op] = fate
        todo &= ~op
    # a gradient is what the engine accumulates into a trained parameter's .grad: of a trained parameter's size
    # (above); anything else the backward made and kept past it (the .grad of a leaf that is no parameter, such as
    # the embeddings' output made to require gradients for LoRA) is a temporary of that backward, however long
    # it lives
    put(bw & outlives & ~trainable & ~comm, TEMPORARIES)
    put(bw & outlives, GRADIENTS)  # FSDP's reduce-scatter output, a collective's, is the sharded gradient
    put(bw & comm, COMMUNICATION)
    put(bw, TEMPORARIES)

    # forward, evaluation, generation and other code run by a pass
    fw = np.isin(bp, PASS_PHASES + (OTHER_PHASE,)) & todo
    _forward(cat, fw, b, d, dp, nxt, model, model_code, persistent, comm, lt, ph, n, pre, first_pass,
             trace, bpass)
    todo &= ~fw

    # born before the trace where no stack says how: only the lifetime speaks; what lives through a whole
    # step stays unknown (parameters or optimizer state? the trace cannot say)
    loose = todo & pre
    # ... except the model's parameters from before recording (``_record_memory_history`` called after
    # ``model.cuda()``): blocks that live through the trace whose sizes the gradients the engine's thread
    # keeps at every torch optimizer step match one to one
    grads = (cat == GRADIENTS) & (bp == BACKWARD_PHASE) & engine
    put(_params_of_gradients(loose & (bp < 0) & lives, grads, cat == PARAMETERS, lt.requested, b, d, s_opt),
        PARAMETERS)
    put(loose & (dp == BACKWARD_PHASE), ACTIVATIONS)
    # (a parameter's size only: where no parameter was placed, the blocks of the model's state would
    # match themselves, freed at teardown)
    param_shaped = np.isin(lt.requested, distinct(lt.requested[cat == PARAMETERS]))
    put(loose & ~persistent & (dp == OPTIMIZER_PHASE) & param_shaped, GRADIENTS)
    put(loose & ~persistent & (d < first_pass), TEMPORARIES)
    src = np.full(rows, TRACE, dtype=np.int8)
    makers: list[str] = []
    maker = np.full(rows, -1, dtype=np.int32)
    _name_copies(trace, lt, cat == WEIGHT_COPY, maker, makers)
    _apply_facts(trace, dt, lt, cat, src, maker, makers)
    why[cat != UNKNOWN] = -1
    scaled = np.isin(cat, BATCH_SCALED) & (np.isin(bp, PASS_PHASES + (BACKWARD_PHASE, OTHER_PHASE)))
    return Accounting(cat, src, np.where(bp >= 0, bp, SETUP_PHASE).astype(np.int8), scaled, why, maker, makers)


WHOLE_COPY = 0.9
"""The share of one step's trained gradient bytes that construction-made extras must copy to be a copy of the model
(:func:`_frozen`). A reference model or momentum encoder copies every trained weight but, at most, a small head the
copy leaves out (RL's value head, a classifier: a few per cent of the weights); what else construction makes of
trained sizes covers far less: BatchNorm's running statistics are 2 of the 4 per-channel tensors of each BatchNorm
(0.2 MiB of ResNet-50's 98 MiB, ``plain-record-resnet50``), and a teacher's weights whose sizes happen to equal the
student's covered 29% of the student's (``new-kinds-teacher-large``: 312.7 MiB against its 1,114,327,040 gradient bytes)."""


def _frozen(cand: np.ndarray, construct: np.ndarray, stack: np.ndarray, requested: np.ndarray, born: np.ndarray,
            trained: np.ndarray, step_of: np.ndarray, per_param: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per row: a copy of the trained weights kept beside them, in a training job whose other parameters get their
    gradients (issue 54's class: a persistent block of a trained parameter's size that is neither it nor its
    gradient or state), and which other module state the trace cannot name.

    ``cand``: the set-up blocks that live through the training passes and nothing placed yet; ``construct``: those
    module construction, loading or moving made; ``requested``: their sizes (bytes); ``born``: their birth (event
    index); ``trained``: the blocks the autograd engine's thread made in a backward, of a trained parameter's size,
    that lived to a step (``AccumulateGrad``, ``torch/csrc/autograd/functions/accumulate_grad.h``, makes each
    parameter's gradient of its shape there); ``step_of``: the step each row was born before; ``per_param``: a
    torch optimizer step was seen and the engine made every gradient (no collective in a backward).

    Per size, the blocks beyond the most gradients of that size one step had are not all parameters. Of a size some
    gradients have, the extras are taken first among the blocks construction did not make where their stack (one
    line copying every weight) made at least two such blocks (a model has more than one parameter; one block of a
    weight's size, a batch preloaded, is no copy: unknown), then those born nearest the blocks no gradient matches
    at all (module construction runs one module at a time), else the last born (a copy is made from the model,
    after it). They are copies (``weight_copy``) where the job's code made them (``p.detach().clone()``, an EMA
    helper's shadow parameters, ``copy.deepcopy``) or where construction made a copy of the trained weights (the
    extras, at most one per gradient, hold :data:`WHOLE_COPY` of one step's gradient bytes: a reference model
    without the policy's value head, a momentum encoder); else ``unknown``
    (``copy_or_buffer``: buffers of a parameter's size, BatchNorm's running statistics, or part of a model kept
    frozen). A block construction made of a size no gradient has is ``unknown`` (``frozen_or_buffer``): a frozen
    teacher's weight or a registered buffer (a memory bank), which the trace cannot tell apart; the sidecar's
    modules name both (:func:`_apply_facts`). No step, a collective in a backward, or no such block with a
    gradient (inference): none. Returns ``(copies, why)``: ``why`` per row is :data:`FROZEN_OR_BUFFER`,
    :data:`COPY_OR_BUFFER` or -1. Pure; O(rows log rows)."""
    out = np.zeros(cand.shape, bool)
    why = np.full(cand.shape, -1, dtype=np.int8)
    if not per_param or not cand.any() or not trained.any():
        return out, why
    grads: dict[int, int] = {}
    pairs, counts = np.unique(np.stack([requested[trained], step_of[trained]]), axis=1, return_counts=True)
    for size, k in zip(pairs[0].tolist(), counts.tolist()):
        grads[size] = max(grads.get(size, 0), k)
    rows = np.flatnonzero(cand)
    if not any(int(requested[r]) in grads for r in rows):
        return out, why
    shaped = np.isin(requested[rows], np.array(list(grads), dtype=np.int64))
    own = rows[shaped & ~construct[rows]]
    site, n = np.unique(stack[own], return_counts=True)
    lone = own[np.isin(stack[own], site[n < 2]) | (stack[own] < 0)]
    rows = rows[~np.isin(rows, lone)]
    sure = np.array([r for r in rows if int(requested[r]) not in grads and construct[r]], dtype=np.int64)
    why[sure] = FROZEN_OR_BUFFER
    lo, hi = (int(born[sure].min()), int(born[sure].max())) if sure.size else (0, -1)
    extras: list[np.ndarray] = []
    copied = trained_bytes = 0
    for size, k in grads.items():
        same = rows[requested[rows] == size]
        extra = same.size - k
        copied += min(max(extra, 0), k) * size
        trained_bytes += k * size
        if extra > 0:
            near = np.maximum(lo - born[same], born[same] - hi).clip(min=0) if sure.size else -born[same]
            order = np.lexsort((near, construct[same]))  # not made by construction first, then nearest / last born
            extras.append(same[order[:extra]])
    picked = np.concatenate(extras) if extras else np.zeros(0, np.int64)
    whole = copied >= WHOLE_COPY * trained_bytes
    copy = picked[~construct[picked] | whole]
    out[copy] = True
    why[picked[construct[picked] & (not whole)]] = COPY_OR_BUFFER
    return out, why


def _recorded_trained_sizes(trace: Trace) -> np.ndarray:
    """The sizes (bytes) of what the sidecar says is trained: the optimizers' parameters and gradients
    (``tensors``), the modules' parameters that had a gradient and those gradients (``modules``). Empty without."""
    sizes: set[int] = set()
    for rec in trace.meta.get("tensors") or ():
        for kind in ("parameters", "gradients"):
            sizes.update(int(p[1]) for p in rec.get(kind, ()))
    for rec in trace.meta.get("modules") or ():
        for root in rec.get("roots", ()):
            for kind in ("parameters", "gradients"):
                sizes.update(int(p[1]) for p in root.get(kind, ()))
    return np.array(sorted(sizes), dtype=np.int64)


def _frame_maker(trace: Trace, sid: int) -> str:
    """Who made a block, from its stack ``sid``: ``copy.deepcopy`` where a frame is the standard library's
    ``deepcopy`` (``copy.py``, by file name and function: exact names), else the innermost Python frame outside
    torch's own code (``<file>:<line> <function>``, the file's last two path parts), else :data:`UNNAMED`."""
    if sid < 0:
        return UNNAMED
    frames = trace.stacks.frames
    fids = trace.stacks.stacks[sid]
    for f in fids:
        file, _line, name = frames[f][:3]
        if name == "deepcopy" and file.replace("\\", "/").rsplit("/", 1)[-1] == "copy.py":
            return "copy.deepcopy"
    for f in fids:
        file, line, name = frames[f][:3]
        path = file.replace("\\", "/")
        if path and "/torch/" not in path and path.endswith(".py"):
            return f"{'/'.join(path.split('/')[-2:])}:{line} {name}"
    return UNNAMED


def _name_copies(trace: Trace, lt: Lifetimes, rows: np.ndarray, maker: np.ndarray, makers: list[str]) -> None:
    """``maker`` of each of ``rows`` (weight copies the trace found) from its stack (:func:`_frame_maker`)."""
    for sid in distinct(lt.stack[rows]).tolist():
        label = _frame_maker(trace, int(sid))
        if label == UNNAMED:
            continue
        if label not in makers:
            makers.append(label)
        maker[rows & (lt.stack == sid)] = makers.index(label)


def _forward(cat: np.ndarray, fw: np.ndarray, b: np.ndarray, d: np.ndarray, dp: np.ndarray, nxt: np.ndarray,
             model: np.ndarray, model_code: np.ndarray, persistent: np.ndarray, comm: np.ndarray, lt: Lifetimes,
             ph: Phases, n: int, pre: np.ndarray, first_pass: int, trace: Trace, bpass: np.ndarray) -> None:
    """Categories of the rows ``fw`` (born in a pass, or before the trace by pass code; ``nxt``: the first
    pass beginning after each row was born; ``bpass``: the pass each row was born in, -1 before the first or
    before the trace). Mutates ``cat``."""
    if not fw.any():
        return
    stack = lt.stack
    alive_next = (nxt < n) & (persistent | (d > nxt))
    freed_bw = ~persistent & (dp == BACKWARD_PHASE)
    # a backward frees it: saved for that backward (in flight while later micro-batches ran forward)
    cat[fw & freed_bw] = ACTIVATIONS
    rest = fw & ~freed_bw
    # never freed, in a pass the trace saw end (a later pass began, or it went on into a backward or the
    # optimizer): maybe a workspace an op made on its first call
    closed = (nxt < n) | (n > 0 and int(ph.phase[-1]) not in PASS_PHASES + (OTHER_PHASE,))
    ws = _lazy_workspaces(rest & persistent & closed, stack, persistent, lt.requested, bpass)
    cat[ws] = WORKSPACES
    rest &= ~ws
    # born before the trace by pass code: its lifetime says what it was; a collective's buffer is communication
    # (DDP's buckets, rebuilt in _pre_forward before the ring buffer wrapped); one never freed is an output only
    # where its site keeps outputs across the passes the trace shows (decided below), else unknown (a cuBLAS
    # workspace made by the forward's first matmul is no output)
    pr = rest & pre
    pre_kept = pr & persistent & ~comm
    cat[pr & persistent] = np.where(comm[pr & persistent], COMMUNICATION, UNKNOWN)
    early = pr & ~persistent & (d < first_pass)
    cat[early] = TEMPORARIES
    late = pr & ~persistent & ~early
    cat[late] = np.where(comm[late], COMMUNICATION, np.where(model_code[late], OUTPUTS, TEMPORARIES))
    rest &= ~pre
    # a cache written by hand: model code whose block of each pass is replaced by a larger one in the next
    grown = _grown(rest & model & alive_next & ~persistent, stack, bpass, lt.requested)
    cat[grown] = KV_CACHE
    rest &= ~grown
    # kept past the next pass: accumulation (blocks of one site from several passes) or a one-off cache;
    # only model code makes outputs (the next batch's inputs, prefetched, do not)
    kept = rest & alive_next
    cat[kept & ~model_code] = TEMPORARIES
    kept &= model_code
    out = kept & ~persistent  # freed in a later pass: kept across batches
    pk = kept & persistent
    if pk.any():
        # still allocated at the trace's end, born in an earlier pass: where the same allocation (stack, rank
        # in its pass) of an earlier pass was freed by its backward, it awaits its own backward (a pipeline
        # schedule's micro-batch in flight at an OOM or a dump): an activation
        fate, matched = _fate_of_open(cat, fw & freed_bw & ~pre, pk, b, bpass, stack, UNKNOWN)
        ids = np.flatnonzero(pk)[matched & (fate == ACTIVATIONS)]
        cat[ids] = ACTIVATIONS
        pk[ids] = False
        kept[ids] = False
    if pk.any():
        idx = np.flatnonzero(pk)
        k_idx = np.flatnonzero(kept)
        pairs = distinct_columns(np.stack([stack[k_idx], bpass[k_idx]]))
        kept_stack, count = np.unique(pairs[0], return_counts=True)
        repeated = np.isin(stack[idx], kept_stack[count >= 2])
        # or one line of model code keeping blocks of one size from several passes, reached from different call
        # paths (a pipeline schedule's warm-up and steady loops append every micro-batch's output to one list):
        # the key of pipeline-output-cache's signature, a site (:mod:`.sites`) and a requested size
        key = _row_ids(site_index(trace).sites_of(stack), lt.requested)
        pairs = distinct_columns(np.stack([key[k_idx], bpass[k_idx]]))
        kept_key, count = np.unique(pairs[0], return_counts=True)
        repeated |= np.isin(key[idx], kept_key[count >= 2])
        out[idx[repeated]] = True
        one = idx[~repeated]
        cat[one] = np.where(comm[one], COMMUNICATION, TEMPORARIES)
    cat[out] = OUTPUTS
    # a collective's buffer kept across passes in training is communication (DDP rebuilding its buckets
    # in _pre_forward); in evaluation or generation, gathered predictions are outputs
    inference = np.zeros(fw.shape, bool)
    if n:
        inference = np.isin(ph.phase[np.clip(b, 0, n - 1)], (EVALUATION_PHASE, GENERATION_PHASE))
    cat[out & comm & ~inference] = COMMUNICATION
    # a block born before the trace by model code and never freed: an output where the trace shows its site
    # keeping outputs across passes
    pre_out = pre_kept & model_code & np.isin(stack, distinct(stack[cat == OUTPUTS]))
    cat[pre_out] = OUTPUTS
    open_ = rest & persistent & ~alive_next
    here = rest & ~alive_next & ~open_
    cat[here] = np.where(comm[here], COMMUNICATION, TEMPORARIES)
    # open at the end of the trace, inside their own pass (an OOM, or a dump mid-step): what the same
    # allocation (same stack, same rank among that stack's allocations in the pass) became in the last
    # finished pass, else (a first pass) an activation where its site recurs with every block alive,
    # else what most of that stack's finished blocks became, else activations
    if open_.any():
        fate, matched = _fate_of_open(cat, fw & ~open_ & ~pre, open_, b, bpass, stack, ACTIVATIONS)
        ops = np.flatnonzero(open_)
        cat[open_] = fate
        cat[ops[~matched & _recurs_after(open_, fw & ~pre, b, bpass, stack)[ops]]] = ACTIVATIONS
        # no earlier pass to learn from, but the trace went on into this pass's backward and the block
        # was still there: saved for it
        bpos = np.flatnonzero(ph.phase == BACKWARD_PHASE)
        if bpos.size:
            nb = np.searchsorted(bpos, b[open_], side="right")
            entered = (nb < bpos.size) & (bpos[np.minimum(nb, bpos.size - 1)] < nxt[open_]) & ~matched
            cat[ops[entered]] = ACTIVATIONS
        cat[open_ & comm] = COMMUNICATION


def _params_of_gradients(cand: np.ndarray, grads: np.ndarray, params: np.ndarray, requested: np.ndarray,
                         b: np.ndarray, d: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Per row: a candidate (``cand``: alive from before the trace through its training passes, placed by no
    stack) that is a parameter because gradients match it one to one. A gradient has its parameter's shape
    (``AccumulateGrad``, ``torch/csrc/autograd/functions/accumulate_grad.h``: ``param.grad`` is made like
    ``param``); at every torch optimizer step the trace shows (``steps``: the event after which each
    ``Optimizer.step#`` began, ``>= 0``), the gradients alive (``grads``: kept by the engine's thread) of each
    size must number at least the candidates of that size plus the parameters already placed (``params``)
    of that size. A size with more candidates (an optimizer that stepped before the trace keeps two moments
    of each parameter's shape; a frozen copy of the weights has no gradient) keeps none: unknown. No step in
    the trace: none. ``b``/``d``: birth and free event per row (-1: before the trace / never). Pure."""
    if not steps.size or not cand.any():
        return np.zeros(cand.shape, dtype=bool)
    sizes, wanted = np.unique(requested[cand], return_counts=True)

    def count(rows: np.ndarray) -> np.ndarray:  # per size in ``sizes``: how many of ``rows`` have it
        idx = np.searchsorted(sizes, requested[rows])
        hit = idx < sizes.size
        hit[hit] = sizes[idx[hit]] == requested[rows][hit]
        return np.bincount(idx[hit], minlength=sizes.size)

    g = np.flatnonzero(grads)
    have = np.full(sizes.shape, np.iinfo(np.int64).max, dtype=np.int64)
    for st in steps.tolist():
        have = np.minimum(have, count(g[(b[g] <= st) & ((d[g] < 0) | (d[g] > st))]))
    return cand & np.isin(requested, sizes[wanted + count(np.flatnonzero(params)) <= have])


def _grown(rows: np.ndarray, stack: np.ndarray, bpass: np.ndarray, requested: np.ndarray) -> np.ndarray:
    """Rows of a stack whose blocks (``rows``: kept into the next pass, then freed) come from at least three
    passes with sizes that never shrink and do grow: each pass's keys and values ``torch.cat``-ed onto the
    last, a KV cache."""
    out = np.zeros(rows.shape, bool)
    idx = np.flatnonzero(rows)
    if idx.size < 3:
        return out
    idx = idx[np.lexsort((bpass[idx], stack[idx]))]
    s = stack[idx]
    bounds = np.flatnonzero(np.diff(s)) + 1
    for grp in np.split(idx, bounds):
        if grp.size < 3 or distinct(bpass[grp]).size < 3:
            continue
        sizes = requested[grp]
        if np.all(np.diff(sizes) >= 0) and sizes[-1] > sizes[0]:
            out[grp] = True
    return out


def _lazy_workspaces(cand: np.ndarray, stack: np.ndarray, persistent: np.ndarray, requested: np.ndarray,
                     bpass: np.ndarray) -> np.ndarray:
    """Of the rows ``cand`` (never freed): those made in the first pass their stack ran in (or before the
    trace) by a stack that made freed blocks in a later pass too, of a size no other block of that stack
    has: a buffer an op made once, on its first call, beside the outputs it makes every call (cuBLAS's
    workspace for a handle, cuBLASLt's); not a kept output (its size repeats) nor a buffer re-allocated
    larger (its live instance is the latest)."""
    out = np.zeros(cand.shape, bool)
    idx = np.flatnonzero(cand & (stack >= 0))
    if idx.size == 0:
        return out
    size = int(stack.max()) + 1
    known = stack >= 0
    first = np.full(size, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, stack[known], bpass[known])
    later_freed = np.zeros(size, bool)
    fr = ~persistent & known
    later_freed[stack[fr & (bpass > first[np.maximum(stack, 0)])]] = True
    idx = idx[later_freed[stack[idx]] & (bpass[idx] <= first[stack[idx]])]
    if idx.size == 0:
        return out
    mine = np.isin(stack, distinct(stack[idx]))
    uniq, count = np.unique(np.stack([stack[mine], requested[mine]]), axis=1, return_counts=True)
    single = {(int(x), int(y)) for (x, y), c in zip(uniq.T, count) if c == 1}
    ok = np.array([(s, q) in single for s, q in zip(stack[idx].tolist(), requested[idx].tolist())], dtype=bool)
    out[idx[ok]] = True
    return out


def _recurs_after(op: np.ndarray, fw: np.ndarray, b: np.ndarray, bpass: np.ndarray, stack: np.ndarray) -> np.ndarray:
    """Per row of ``op`` (open at the trace's end): its stack allocated again later in the same pass while it
    stayed allocated: the code ran on past it (the next layer) and kept it, as autograd keeps what a
    backward needs."""
    out = np.zeros(op.shape, bool)
    idx = np.flatnonzero(fw | op)
    if idx.size == 0:
        return out
    inv = _row_ids(bpass[idx], stack[idx])  # one id per (pass, stack)
    last = np.full(int(inv.max()) + 1, -1, dtype=np.int64)
    np.maximum.at(last, inv, b[idx])
    out[idx] = op[idx] & (b[idx] < last[inv])
    return out


def _row_ids(*cols: np.ndarray) -> np.ndarray:
    """Dense ids of the rows of equal-length integer columns: equal rows get equal ids, in lexicographic
    order of the rows. One integer key per row (mixed radix) where the columns' ranges allow it, else
    ``np.unique(axis=1)`` (several times slower)."""
    if not cols[0].size:
        return np.zeros(0, dtype=np.int64)
    lows = [int(c.min()) for c in cols]
    spans = [int(c.max()) - lo + 1 for c, lo in zip(cols, lows)]
    if math.prod(spans) >= 1 << 62:
        return np.unique(np.stack(cols), axis=1, return_inverse=True)[1].reshape(-1)  # 2-D on NumPy 2.0.0
    key = np.zeros(cols[0].size, dtype=np.int64)
    for c, lo, span in zip(cols, lows, spans):
        key = key * span + (c.astype(np.int64) - lo)
    return np.unique(key, return_inverse=True)[1]


def _fate_of_open(cat: np.ndarray, done: np.ndarray, op: np.ndarray, b: np.ndarray, bpass: np.ndarray,
                  stack: np.ndarray, default: int) -> tuple[np.ndarray, np.ndarray]:
    """Categories for the rows of ``op``, still allocated when the trace ends inside their own group
    (``bpass``: a pass, or a backward run). Allocations are matched by (stack, rank among that stack's
    allocations in the group), counted over every row of the group, to the last finished group; else
    the category most of that stack's finished rows got; else ``default``. Also returns which rows were
    matched to an allocation of an earlier group."""
    # rank of each row among the rows of its (group, stack), in allocation order
    rows = np.flatnonzero(done | op)
    rows = rows[stable_argsort(b[rows])]
    pair = _row_ids(bpass[rows], stack[rows])
    by_pair = stable_argsort(pair)
    starts = np.flatnonzero(np.r_[True, pair[by_pair][1:] != pair[by_pair][:-1]])
    sizes = np.diff(np.r_[starts, rows.size])
    rank = np.full(cat.size, -1, dtype=np.int64)
    rank[rows[by_pair]] = np.arange(rows.size) - np.repeat(starts, sizes)
    useful = done & np.isin(cat, (ACTIVATIONS, TEMPORARIES, OUTPUTS, COMMUNICATION, GRADIENTS, KV_CACHE))
    fin = np.flatnonzero(useful)
    passes_done = distinct(bpass[fin])
    # the category most of each stack's finished rows got (the smallest category on a tie)
    majority = np.full(int(stack.max(initial=-1)) + 2, default, dtype=np.int64)  # indexed by stack + 1
    if fin.size:
        _, at, counts = np.unique(_row_ids(stack[fin], cat[fin]), return_index=True, return_counts=True)
        s_of, c_of = stack[fin][at], cat[fin][at]  # each distinct (stack, category), with its row count
        best = np.lexsort((c_of, -counts, s_of))  # per stack: most rows first, then the smallest category
        first = best[np.r_[True, s_of[best][1:] != s_of[best][:-1]]]
        majority[s_of[first] + 1] = c_of[first]
    # an open row takes the category of the row of the same (stack, rank) in the last finished group before its own
    ops = np.flatnonzero(op)
    prev_at = np.searchsorted(passes_done, bpass[ops], side="left") - 1
    has_prev = prev_at >= 0
    want = np.stack([passes_done[np.maximum(prev_at, 0)] if passes_done.size else bpass[ops], stack[ops], rank[ops]])
    have = np.stack([bpass[fin], stack[fin], rank[fin]])
    ids = _row_ids(*np.concatenate([have, want], axis=1))
    row_of = np.full(fin.size + ops.size, -1, dtype=np.int64)
    row_of[ids[:fin.size]] = fin
    m = np.where(has_prev, row_of[ids[fin.size:]], -1)
    matched = m >= 0
    fate = np.where(matched, cat[np.maximum(m, 0)], majority[stack[ops] + 1])
    return fate.astype(np.int8), matched


_FACT_CATEGORY = {"workspaces": WORKSPACES, "parameters": PARAMETERS, "gradients": GRADIENTS,
                  "optimizer_state": OPTIMIZER_STATE}


def _when(rec: dict[str, Any], t: np.ndarray, n: int) -> int | None:
    """The event after which a sidecar record (noted at ``rec["time_us"]``) holds, or None when it lies outside the
    trace: a record noted before its first event (ring buffer) or after its last may name reused addresses; a dump's
    record (``"at": "dump"``), noted right after the snapshot, holds at its final state. (:func:`_apply_facts` still
    reads a module record noted before the first event, for the blocks of the noted sizes allocated when it begins.)"""
    when: int = rec["time_us"]
    if rec.get("at") == "dump" and when >= t[-1]:
        return n - 1
    if when < t[0] or when > t[-1]:
        return None
    return int(np.searchsorted(t, when, side="right")) - 1


def _holders(lt: Lifetimes, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows allocated after event ``k``, by address, with their address ranges."""
    alive = np.flatnonzero(lt.allocated_mask(k))
    order = alive[np.argsort(lt.addr[alive], kind="stable")]
    return order, lt.addr[order], lt.addr[order] + lt.size[order]


def _hits(order: np.ndarray, lo: np.ndarray, hi: np.ndarray, ptrs: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """The rows (of ``order``) whose block contains each pointer, and which of ``ptrs`` hit one."""
    arr = np.array(ptrs, dtype=object)
    keep = (arr >= 0) & (arr < 1 << 63) if arr.size else np.zeros(0, bool)
    p = arr[keep].astype(np.int64) if arr.size else np.zeros(0, np.int64)
    j = np.searchsorted(lo, p, side="right") - 1
    ok = (j >= 0) & (p < hi[np.maximum(j, 0)]) if p.size else np.zeros(0, bool)
    idx = np.flatnonzero(keep)[ok]
    return order[j[ok]], idx


def _apply_facts(trace: Trace, dt: DeviceTrace, lt: Lifetimes, cat: np.ndarray, src: np.ndarray,
                 maker: np.ndarray | None = None, makers: list[str] | None = None) -> None:
    """Recorded storages -> the rows that held them at the time they were noted (``cat``, ``src`` and ``maker`` in
    place). First the modules (``modules``, :mod:`oomdoctor.capture.facts`): a registered buffer is ``buffers``; a
    parameter no optimizer steps is ``weight_copy``, named by its module (a frozen one, ``requires_grad=False``: a
    teacher, a reference model, a momentum encoder, LoRA's base; one that requires gradients but had none and is
    in no optimizer: a ``deepcopy`` EMA); a parameter with a gradient and that gradient are ``parameters`` and
    ``gradients``. A module record noted before the trace's first event (a ring buffer that wrapped) names the blocks
    allocated when the trace begins at its addresses that have the noted storages' sizes, and no gradient. Then the
    optimizers' storages (``tensors``), which win a block both name: parameters, gradients, optimizer state."""
    # the sidecar's JSON records, their shape checked at load (trace/load.py _drop_malformed)
    records: list[dict[str, Any]] = trace.meta.get("tensors") or []
    modules: list[dict[str, Any]] = trace.meta.get("modules") or []
    if (not records and not modules) or dt.num_events == 0:
        return
    t = dt.events["time_us"]
    n = dt.num_events
    makers = [] if makers is None else makers
    by_optimizer = {(int(p[0]), int(p[1])) for rec in records for p in rec.get("parameters", ())}
    stepped = set(by_optimizer)
    held: set[tuple[int, int]] = set()
    for rec in modules:
        for root in rec.get("roots", ()):
            stepped.update((int(p[0]), int(p[1])) for p in root.get("parameters", ()))
            for kind in ("parameters", "untouched", "frozen"):
                held.update((int(p[0]), int(p[1])) for p in root.get(kind, ()))
    # a parameter that requires gradients, had none and no optimizer steps is a copy (a deepcopy EMA) only where the
    # optimizers step the modules' own parameters: DeepSpeed's torch optimizer steps fp32 master copies that no
    # module holds, and its engine moves each bf16 parameter's gradient into its partition (none is left at the
    # step's end): those parameters are the trace's to place
    copies_untouched = bool(by_optimizer & held)
    for rec in modules:
        k = _when(rec, t, n)
        before = k is None and rec.get("at") != "dump" and rec["time_us"] < t[0]
        if k is None and not before:
            continue
        # noted before the window (the modules are noted once, at the first optimizer step, and a ring buffer that
        # wraps drops it): what it names holds for a block allocated when the trace begins, born before it, of the
        # noted storage's size (an address reused since by another tensor would need its size too); a gradient is
        # not module state and is freed each step, so only the module's own storages
        order, lo, hi = _holders(lt, k if k is not None else -1)  # None: noted before the window
        if order.size == 0:
            continue
        for root in rec.get("roots", ()):
            parts: list[Any] = root.get("parts") or []
            for kind, category in (("buffers", BUFFERS), ("frozen", WEIGHT_COPY), ("untouched", WEIGHT_COPY),
                                   ("gradients", GRADIENTS), ("parameters", PARAMETERS)):
                if before and kind == "gradients":
                    continue
                items = root.get(kind, [])
                if kind == "untouched":  # requires_grad, no gradient when noted: a copy unless an optimizer steps it
                    items = [p for p in items if copies_untouched and (int(p[0]), int(p[1])) not in stepped]
                hit, idx = _hits(order, lo, hi, [p[0] for p in items])
                if before:
                    same = lt.requested[hit] == np.array([int(items[i][1]) for i in idx.tolist()], dtype=np.int64)
                    hit, idx = hit[same], idx[same]
                cat[hit] = category
                src[hit] = RECORDED
                if maker is None or category not in (BUFFERS, WEIGHT_COPY):
                    continue
                for r, i in zip(hit.tolist(), idx.tolist()):
                    part = int(items[i][2])
                    name = parts[part][0] if 0 <= part < len(parts) and parts[part] else None
                    label = f"module {root.get('class', '?')}" + (f".{name}" if name else "")
                    if label not in makers:
                        makers.append(label)
                    maker[r] = makers.index(label)
    for rec in records:
        k = _when(rec, t, n)
        if k is None:
            continue
        order, lo, hi = _holders(lt, k)
        if order.size == 0:
            continue
        for kind in ("workspaces", "gradients", "optimizer_state", "parameters"):  # later kinds win a shared block
            hit, _ = _hits(order, lo, hi, [p[0] for p in rec.get(kind, [])])
            cat[hit] = _FACT_CATEGORY[kind]
            src[hit] = RECORDED
            if maker is not None:
                maker[hit] = -1


def breakdown(acc: Accounting, lt: Lifetimes, ph: Phases, k: int, at: BreakdownPoint, allocated_bytes: int
              ) -> Breakdown:
    """The lines of the blocks allocated after event ``k``: each category's requested bytes, and the
    rounding of them; asserts they sum to ``allocated_bytes`` (the timeline's allocated bytes then)."""
    rows = np.flatnonzero(lt.allocated_mask(k))
    cats = acc.category[rows]
    sizes = lt.size[rows]
    req = np.minimum(lt.requested[rows], sizes)
    total = np.bincount(cats, weights=req, minlength=len(CATEGORIES)).astype(np.int64)
    count = np.bincount(cats, minlength=len(CATEGORIES))
    rec = np.bincount(cats[acc.source[rows] == RECORDED], weights=sizes[acc.source[rows] == RECORDED],
                      minlength=len(CATEGORIES))
    whole = np.bincount(cats, weights=sizes, minlength=len(CATEGORIES))
    categories: dict[BreakdownLine, int] = {c: int(total[i]) for i, c in enumerate(CATEGORIES)}
    categories[ROUNDING] = int(sizes.sum() - req.sum())
    sources: dict[BreakdownCategory, str] = {c: ("recorded" if rec[i] * 2 > whole[i] else "trace") for i, c in enumerate(CATEGORIES) if total[i]}
    unk = rows[cats == UNKNOWN]
    born_before = (lt.alloc[unk] < 0) | (lt.start_state[unk] != IN_TRACE)
    why = np.where(born_before, np.where(lt.stack[unk] < 0, _BEFORE_NO_STACK, _BEFORE), _IN_TRACE)
    if acc.why is not None:
        why = np.where(acc.why[unk] >= 0, acc.why[unk], why)
    per_why = np.bincount(why, weights=np.minimum(lt.requested[unk], lt.size[unk]),
                          minlength=len(UNKNOWN_WHY)).astype(np.int64)

    def by_maker(category: int) -> dict[str, int]:
        sel = rows[cats == category]
        got: dict[str, int] = {}
        for r, q in zip(sel.tolist(), np.minimum(lt.requested[sel], lt.size[sel]).tolist()):
            m = int(acc.maker[r]) if acc.maker is not None else -1
            label = acc.makers[m] if m >= 0 else UNNAMED
            got[label] = got.get(label, 0) + int(q)
        return dict(sorted(got.items(), key=lambda kv: (-kv[1], kv[0])))

    counts: dict[BreakdownCategory, int] = {c: int(count[i]) for i, c in enumerate(CATEGORIES) if count[i]}
    unknown_why: dict[UnknownWhy, int] = {w: int(per_why[i]) for i, w in enumerate(UNKNOWN_WHY) if per_why[i]}
    weight_copy_by, buffers_by = by_maker(WEIGHT_COPY), by_maker(BUFFERS)
    assert sum(unknown_why.values()) == categories["unknown"]
    assert sum(weight_copy_by.values()) == categories["weight_copy"]
    assert sum(buffers_by.values()) == categories["buffers"]
    out = Breakdown(at, int(k), ph.step_of(k), ph.phase_name(k), categories, sources, int(allocated_bytes), counts,
                    ph.source_name(k), unknown_why, weight_copy_by, buffers_by)
    out.check()
    return out
