"""Phases, steps and passes of a trace: which part of training every event belongs to.

Every allocation gets a phase from the strongest evidence there is, and keeps the source that set it
(:data:`SOURCE_NAMES`), strongest first:

1. ``markers``: phases a framework callback marked in the sidecar (``phase_markers``: evaluation,
   optimizer) override an allocation that no stronger evidence places (a forward stack, or none).
2. ``annotations``: what PyTorch itself records around an allocation (``_record_memory_history`` keeps
   ``record_function`` scopes as ``external_annotations`` since PyTorch 2.5, ``memory_snapshot.cpp``
   ``_initRecordAnnotations``). ``Optimizer.step#<Class>.step`` wraps the ``step`` of every
   ``torch.optim.Optimizer`` subclass, whoever wrote it (``torch/optim/optimizer.py``
   ``profile_hook_step``): what it allocates is the optimizer's.
3. ``autograd engine thread``: CUDA backward ops run on the engine's device threads
   (``torch/csrc/autograd/engine.cpp`` ``Engine::thread_init``). With Python stacks their allocations
   carry no Python frame, or only the frames of a Python hook the engine called (FSDP's and DeepSpeed's
   gradient hooks): the outermost frame of a stack on the main thread is the entry module's
   ``<module>`` (or ``runpy``), of a Python thread ``threading.py``'s bootstrap; anything else was called
   from C++ (when the trace has main-thread stacks at all: stacks cut short say nothing of threads). With
   C++ stacks the engine's frames say so.
4. ``frames``: the innermost frame that is ``setup``, ``optimizer``, ``forward`` (``evaluation`` under an
   evaluation loop, ``generation`` under ``generate()``) code, by the path table of
   :mod:`oomdoctor.frameworks` (a name rule, the last resort). Functions of ``torch.nn``'s ``Module`` and of
   its containers (``ModuleList``, ``Sequential``) that run no forward are skipped, exact names
   (``frameworks.MODULE_CALL_NAMES``): ``ModuleList.__init__`` adding blocks the caller builds is no pass.
5. ``inferred``: an allocation none of these places continues the phase before it, except after a
   backward: the main thread cannot be inside one, so there it is ``optimizer`` work when an update is
   seen before the next forward pass (an optimizer annotation, step marker or frame), else ``other``.

**Steps** are optimizer updates, found only from evidence that means one, in order of trust: the
sidecar's step markers (``oomdoctor.record``'s global optimizer step hook), ``ProfilerStep#`` or
``Optimizer.step#...`` annotations, or runs of optimizer allocations. Layers that repeat inside a forward
pass are never steps: a trace with no update is a forward pass (or a forward and backward pass) and is
said to be so.

**Passes** are forward passes (one micro-batch each): a pass begins at the first forward, evaluation or
generation allocation after a backward or optimizer one, and inside a run of forward passes (an
evaluation loop, a pipeline schedule's warm-up) where the run's first forward allocation, preceded by an
allocation that is not forward code (the next batch's transfer), repeats.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np

from ..frameworks import (
    BACKWARD,
    BACKWARD_NAME_PATHS,
    COMMUNICATION,
    COMMUNICATION_SITE,
    COMPILED,
    CONTAINER_FILE,
    ENGINE_CPP,
    EVALUATION,
    EVALUATION_NAMES,
    FORWARD,
    FORWARD_NAMES,
    GENERATION,
    KV_CACHE,
    MODULE_CALL_NAMES,
    MODULE_FILE,
    OPTIMIZER,
    OPTIMIZER_EXCLUDED,
    SETUP,
    SETUP_NAMES,
    matches,
    normalize_path,
)
from ..ids import PHASE_SOURCES, PhaseSource
from ..trace.model import ALLOC, OOM, Annotation, DeviceTrace, StackTable, Trace
from ..trace.stackmatch import unmatched_allocations
from .arrays import distinct

# role / phase codes
SETUP_PHASE = 0
FORWARD_PHASE = 1
BACKWARD_PHASE = 2
OPTIMIZER_PHASE = 3
EVALUATION_PHASE = 4
OTHER_PHASE = 5
GENERATION_PHASE = 6
PHASE_NAMES: tuple[str, ...] = ("setup", "forward", "backward", "optimizer", "evaluation", "other", "generation")
PASS_PHASES = (FORWARD_PHASE, EVALUATION_PHASE, GENERATION_PHASE)
"""Phases whose allocations belong to a forward pass (training, evaluation or generation)."""
NO_FRAMES = 7  # a stack without any frame (role decided per trace)
UNRECORDED = 8  # stack id -1

# threads a stack was recorded on
MAIN_THREAD, ENGINE_THREAD, PYTHON_THREAD, NO_PYTHON = range(4)

# sources of a phase, strongest first (per event: ``Phases.source``)
MARKERS, ANNOTATIONS, THREAD, FRAMES, INFERRED = range(5)
SOURCE_NAMES: tuple[PhaseSource, ...] = PHASE_SOURCES
"""What set a phase, indexed by the source constants (the ids: :data:`oomdoctor.ids.PHASE_SOURCES`)."""


@dataclass(frozen=True)
class StackRole:
    """What one stack says: its ``role`` (a phase code, :data:`NO_FRAMES` or :data:`UNRECORDED`), whether
    it allocates a collective's buffer (``communication``), whether it is optimizer code, whether model
    code made the allocation (``model``: the innermost known frame is forward code), the ``thread`` it was
    recorded on (:data:`MAIN_THREAD`, :data:`ENGINE_THREAD`, :data:`PYTHON_THREAD`, :data:`NO_PYTHON`),
    whether a KV cache's code made it (``cache``) and whether compiled code ran (``compiled``)."""

    role: int
    communication: bool
    optimizer: bool
    model: bool = False
    thread: int = NO_PYTHON
    cache: bool = False
    compiled: bool = False


def stack_thread(py: list[tuple[str, str]]) -> int:
    """The thread a stack's Python frames (``(file, function)``, innermost first) ran on, from its
    outermost frame: the main thread's is the entry module's ``<module>`` (``runpy`` under ``python -m``),
    a Python thread's ``threading.py``'s bootstrap; a stack rooted anywhere else is a Python function
    called from C++: a hook the autograd engine's threads ran."""
    if not py:
        return NO_PYTHON
    f, n = py[-1]
    if n == "<module>" or f.endswith("/runpy.py"):
        return MAIN_THREAD
    if f.endswith("/threading.py"):
        return PYTHON_THREAD
    return ENGINE_THREAD


def classify_frames(frames: list[tuple[str, int, str]]) -> StackRole:
    """The role of one stack (frames innermost first). Pure; see the module doc for the rules."""
    if not frames:
        return StackRole(NO_FRAMES, False, False)
    norm = [(normalize_path(f), n) for f, _line, n in frames]
    py = [(f, n) for f, n in norm if f.endswith(".py")]
    comm = any(matches(f, n, COMMUNICATION) for f, n in py) or matches(*py[0], COMMUNICATION_SITE) if py else False
    optim = any(matches(f, n, OPTIMIZER) and not any(x in f for x in OPTIMIZER_EXCLUDED) for f, n in py)
    cache = any(matches(f, n, KV_CACHE) for f, n in py)
    compiled = any(matches(f, n, COMPILED) for f, n in norm)
    thread = stack_thread(py)
    if not py:  # C++ frames only (stacks="all"): the engine thread, or native code
        engine = any(any(e in n for e in ENGINE_CPP) for _f, n in norm)
        return StackRole(BACKWARD_PHASE if engine else NO_FRAMES, comm, False, thread=NO_PYTHON, compiled=compiled)
    for f, n in py:
        if matches(f, n, BACKWARD) or n == "backward" or ("backward" in n and any(p in f for p in BACKWARD_NAME_PATHS)):
            return StackRole(BACKWARD_PHASE, comm, optim, thread=thread, cache=cache, compiled=compiled)
    role = OTHER_PHASE
    for f, n in py:
        if any(x in f for x in OPTIMIZER_EXCLUDED) or (f.endswith(MODULE_FILE) and n not in MODULE_CALL_NAMES
                                                        and not matches(f, n, SETUP)):
            continue
        if f.endswith(CONTAINER_FILE) and n not in MODULE_CALL_NAMES:  # a container adding the caller's modules
            continue
        if matches(f, n, SETUP) or n in SETUP_NAMES:
            role = SETUP_PHASE
            break
        if matches(f, n, OPTIMIZER):
            role = OPTIMIZER_PHASE
            break
        if matches(f, n, FORWARD) or n in FORWARD_NAMES:
            role = SETUP_PHASE if n == "__init__" else FORWARD_PHASE
            break
    model = role == FORWARD_PHASE
    if role in (FORWARD_PHASE, OTHER_PHASE):
        if any(matches(f, n, GENERATION) for f, n in py):
            role = GENERATION_PHASE
        elif any(matches(f, n, EVALUATION) or n in EVALUATION_NAMES for f, n in py):
            role = EVALUATION_PHASE
    return StackRole(role, comm, optim, model, thread, cache, compiled)


class RoleIndex:
    """Stack id -> :class:`StackRole`, as arrays (computed once per stack table)."""

    def __init__(self, stacks: StackTable) -> None:
        frames = stacks.frames
        roles = [classify_frames([frames[f] for f in fids]) for fids in stacks.stacks]  # by stack id
        # last slot: stack id -1
        self.role = np.array([r.role for r in roles] + [UNRECORDED], dtype=np.int8)
        thread = np.array([r.thread for r in roles] + [NO_PYTHON], dtype=np.int8)
        if not np.any(thread == MAIN_THREAD):  # no stack reaches a main module: roots say nothing of threads
            thread[thread == ENGINE_THREAD] = MAIN_THREAD
        self.thread = thread
        self.communication = np.array([r.communication for r in roles] + [False], dtype=bool)
        self.optimizer = np.array([r.optimizer for r in roles] + [False], dtype=bool)
        self.model = np.array([r.model for r in roles] + [False], dtype=bool)
        self.cache = np.array([r.cache for r in roles] + [False], dtype=bool)
        self.compiled = np.array([r.compiled for r in roles] + [False], dtype=bool)

    def lookup(self, arr: np.ndarray, stack_ids: np.ndarray) -> np.ndarray:
        return arr[np.where(stack_ids >= 0, stack_ids, arr.shape[0] - 1)]

    def engine(self, stack_ids: np.ndarray, python_stacks: bool) -> np.ndarray:
        """Per stack: recorded on the autograd engine's threads (a hook called from C++, or no Python frame
        at all while Python stacks were recorded: the snapshot gives such an event an empty stack, id -1)."""
        t = self.lookup(self.thread, stack_ids)
        return (t == ENGINE_THREAD) | ((t == NO_PYTHON) & python_stacks)

    def roles_of(self, stack_ids: np.ndarray, python_stacks: bool) -> np.ndarray:
        """Each stack's own role as a phase code: the engine's threads are backward, no stack at all is
        ``other``."""
        r = self.lookup(self.role, stack_ids)
        r = np.where(self.engine(stack_ids, python_stacks) & (r != OPTIMIZER_PHASE), BACKWARD_PHASE, r)
        return np.where((r == NO_FRAMES) | (r == UNRECORDED), OTHER_PHASE, r).astype(np.int8)


_ROLES: "weakref.WeakKeyDictionary[StackTable, RoleIndex]" = weakref.WeakKeyDictionary()


def role_index(trace: Trace) -> RoleIndex:
    """The :class:`RoleIndex` of a trace's stack table (one per table, kept while the table lives)."""
    return table_roles(trace.stacks)


def table_roles(stacks: StackTable) -> RoleIndex:
    """The :class:`RoleIndex` of a stack table (one per table, kept while the table lives)."""
    got = _ROLES.get(stacks)
    if got is None:
        got = _ROLES[stacks] = RoleIndex(stacks)
    return got


@dataclass
class Steps:
    """Optimizer steps. ``starts[i]`` is the event index where step i begins (``starts[0]`` is the
    trace's start or the first step boundary seen); ``updates`` counts the optimizer updates the trace
    shows (a last step still running, at an OOM say, has none yet); ``source`` is ``"markers"``,
    ``"annotations"`` or ``"optimizer frames"``."""

    starts: np.ndarray
    source: str
    updates: int
    first: int = 0
    """The number of the step ``starts[0]`` begins (the job's own count from 0, when step markers give
    it: a step window's trace begins at step A, not 0)."""

    def __len__(self) -> int:
        return int(self.starts.shape[0])


@dataclass
class Phases:
    """The phase of every event (``phase``: codes of :data:`PHASE_NAMES`, shape ``(num_events,)``) and the
    source that set it (``source``: codes of :data:`SOURCE_NAMES`), the forward passes (``pass_starts``:
    event indices, increasing), the steps (None without any optimizer update or marker) and the events
    where a torch optimizer's ``step`` began (``optimizer_starts``: the event before each
    ``Optimizer.step#`` START annotation, -1 for one before the trace's first event). ``kind`` says what
    the trace holds, in words."""

    phase: np.ndarray
    pass_starts: np.ndarray
    steps: Steps | None
    kind: str
    stacks_recorded: bool
    python_stacks: bool
    has_backward: bool
    source: np.ndarray | None = None
    optimizer_starts: np.ndarray | None = None
    compiled: bool = False
    after_backward: np.ndarray | None = None
    """Per event: a main-thread allocation between a backward and the next forward pass whose phase no
    stack or annotation set (the update of an optimizer that is no torch optimizer, a batch's transfer)."""

    def phase_name(self, k: int) -> str:
        """The phase after event ``k`` (``setup`` before the first event)."""
        if k < 0 or self.phase.size == 0:
            return PHASE_NAMES[SETUP_PHASE]
        return PHASE_NAMES[int(self.phase[min(k, self.phase.size - 1)])]

    def source_name(self, k: int) -> PhaseSource:
        """What set the phase after event ``k`` (:data:`SOURCE_NAMES`; ``inferred`` before the first event)."""
        if k < 0 or self.source is None or self.source.size == 0:
            return SOURCE_NAMES[INFERRED]
        return SOURCE_NAMES[int(self.source[min(k, self.source.size - 1)])]

    def pass_of(self, k: np.ndarray | int) -> np.ndarray:
        """Index of the pass that event(s) ``k`` belong to (-1: before the first pass)."""
        return np.searchsorted(self.pass_starts, k, side="right") - 1

    def run_starts(self, code: int) -> np.ndarray:
        """Event indices where a run of phase ``code`` begins."""
        m = (self.phase == code).astype(np.int8)
        return np.flatnonzero(np.diff(np.concatenate(([0], m))) == 1)

    def run_number(self, code: int) -> np.ndarray:
        """Per event, how many runs of phase ``code`` have begun up to it (shape ``(num_events,)``)."""
        m = (self.phase == code).astype(np.int8)
        return np.cumsum(np.diff(np.concatenate(([0], m))) == 1)

    def step_of(self, k: int) -> int | None:
        if self.steps is None or k < 0:
            return None
        return int(np.searchsorted(self.steps.starts, k, side="right") - 1) + self.steps.first if len(self.steps) else None


_PROFILER_STEP = re.compile(r"^ProfilerStep#\d+$")
OPTIMIZER_STEP = "Optimizer.step#"
"""Prefix of the ``record_function`` scope every ``torch.optim.Optimizer.step`` runs in."""
OPTIMIZER_ZERO_GRAD = "Optimizer.zero_grad#"
"""Prefix of the scope of every ``torch.optim.Optimizer.zero_grad`` (``_zero_grad_profile_name``)."""


def annotations_named(dt: DeviceTrace, prefix: str | tuple[str, ...]) -> list[Annotation]:
    """The annotations of ``dt`` whose name starts with ``prefix``, in their order. A trace holds tens of
    thousands (23,520 on ``large``) under a few hundred names, and the phases, steps and detectors ask for a few
    prefixes each: the names are tested once each (:func:`_positions_by_name`), not once per record per call
    (four calls took 15-18 ms each on ``large`` under load; docs/benchmarks.md)."""
    anns = dt.annotations
    by_name = _positions_by_name(dt)
    hits = [p for name, p in by_name.items() if name.startswith(prefix)]
    if not hits:
        return []
    rows = hits[0] if len(hits) == 1 else sorted(chain.from_iterable(hits))
    return list(map(anns.__getitem__, rows))


def _positions_by_name(dt: DeviceTrace) -> dict[str, list[int]]:
    """Each annotation name of ``dt`` -> the positions of its records in ``dt.annotations`` (ascending). Kept on
    ``dt`` while its annotations list is the same object of the same length (the trace layer only appends while
    it builds)."""
    anns = dt.annotations
    kept = dt.__dict__.get("_annotation_positions")
    if kept is not None and kept[0] is anns and kept[1] == len(anns):
        return kept[2]
    by_name: dict[str, list[int]] = {}
    for i, name in enumerate(map(_NAME, anns)):
        by_name.setdefault(name, []).append(i)
    dt.__dict__["_annotation_positions"] = (anns, len(anns), by_name)
    return by_name


_NAME = attrgetter("name")


def annotation_windows(dt: DeviceTrace, prefix: str | tuple[str, ...]) -> np.ndarray:
    """``(start_us, end_us)`` rows of the annotated scopes whose name starts with ``prefix``, START and END
    paired in order per name (a scope still open at the end closes at the last event). Shape ``(n, 2)``."""
    opened: dict[str, list[int]] = {}
    out: list[tuple[int, int]] = []
    # filtered, then sorted (stable: the same order as sorting all of them first), so the sort sees only the
    # scopes asked for, not every annotation of the trace (23,520 on `large`, docs/benchmarks.md)
    for a in sorted(annotations_named(dt, prefix), key=lambda x: x.time_us):
        if a.stage == "START":
            opened.setdefault(a.name, []).append(a.time_us)
        elif a.stage == "END" and opened.get(a.name):
            out.append((opened[a.name].pop(), a.time_us))
    last = int(dt.events["time_us"][-1]) if dt.num_events else 0
    out += [(t, max(t, last)) for ts in opened.values() for t in ts]
    return np.array(sorted(out), dtype=np.int64).reshape(-1, 2)


def find_phases(trace: Trace, dt: DeviceTrace) -> Phases:
    """Label every event of ``dt`` with its phase and the source of it, and find passes and steps.
    Pure; O(events)."""
    n = dt.num_events
    action, stack, times = dt.events["action"], dt.events["stack"], dt.events["time_us"]
    ri = role_index(trace)
    allocs = np.flatnonzero(action == ALLOC)
    raw = ri.lookup(ri.role, stack[allocs])
    recording: dict[str, Any] = trace.meta.get("recording") or {}
    recorded = recording.get("stacks") != "none" and bool(
        np.any((raw != NO_FRAMES) & (raw != UNRECORDED)))
    python = recorded and bool(np.any(ri.lookup(ri.thread, stack[allocs]) != NO_PYTHON))
    at = times[allocs]
    roles = ri.roles_of(stack[allocs], python)
    src = np.where(ri.engine(stack[allocs], python) & (roles == BACKWARD_PHASE), THREAD, FRAMES).astype(np.int8)
    unknown = unmatched_allocations(trace)
    if unknown is not None and trace.meta["stack_matches"]["device"] == dt.device and unknown.shape[0] == n:
        # recorded without a stack by --stack-steps and matched to no stacked step: an empty stack here
        # says nothing of the engine's threads; the phase is inferred from the allocations around it
        roles[unknown[allocs]] = OTHER_PHASE
    src[roles == OTHER_PHASE] = INFERRED
    # annotations: what a torch optimizer's step allocates is the optimizer's, whatever its frames say
    # (a compiled step's Inductor and Dynamo frames read as forward code), except the forward and backward
    # of a closure it runs (Lightning's automatic optimization: optimizer.step(closure)), known by the
    # backward the closure runs inside the same window
    windows = annotation_windows(dt, OPTIMIZER_STEP) if n else np.zeros((0, 2), np.int64)
    if windows.shape[0]:
        w = np.searchsorted(windows[:, 0], at, side="right") - 1
        inside = (w >= 0) & (at <= windows[np.maximum(w, 0), 1])
        closure = np.zeros(windows.shape[0], dtype=bool)
        closure[w[inside & (roles == BACKWARD_PHASE)]] = True
        inside &= ~(np.isin(roles, PASS_PHASES + (BACKWARD_PHASE,)) & closure[np.maximum(w, 0)])
        roles[inside] = OPTIMIZER_PHASE
        src[inside] = ANNOTATIONS
    roles, marked = _marked(roles, at, trace.meta.get("phase_markers"))
    src[marked] = MARKERS
    smoothed, gap = _smooth(roles, ri.lookup(ri.thread, stack[allocs]), at, windows, trace.meta.get("step_markers"))
    pass_starts = _passes(allocs, ri.lookup(ri.model, stack[allocs]), smoothed, stack)
    smoothed = _trailing_evaluation(smoothed, allocs, pass_starts)
    phase = np.full(n, SETUP_PHASE, dtype=np.int8)
    source = np.full(n, INFERRED, dtype=np.int8)
    if allocs.size:
        idx = np.cumsum(action == ALLOC) - 1  # the last alloc at or before each event (a count, not a search)
        phase = np.where(idx >= 0, smoothed[np.maximum(idx, 0)], SETUP_PHASE).astype(np.int8)
        source = np.where(idx >= 0, src[np.maximum(idx, 0)], INFERRED).astype(np.int8)
    # every event inside a torch optimizer's step or zero_grad is the optimizer's, frees too (a fused
    # optimizer allocates nothing, and zero_grad(set_to_none=True) only frees the gradients)
    both = annotation_windows(dt, (OPTIMIZER_STEP, OPTIMIZER_ZERO_GRAD)) if n else np.zeros((0, 2), np.int64)
    if both.shape[0]:
        w = np.searchsorted(both[:, 0], times, side="right") - 1
        inside = (w >= 0) & (times <= both[np.maximum(w, 0), 1])
        inside &= ~np.isin(phase, PASS_PHASES + (BACKWARD_PHASE,))  # a closure's forward and backward
        phase[inside] = OPTIMIZER_PHASE
        source[inside] = ANNOTATIONS
    has_b = bool(np.any(smoothed == BACKWARD_PHASE))
    steps = _steps(trace, dt, allocs, smoothed)
    if steps is not None and steps.source == "markers":
        seen = _updates_seen(steps.starts, allocs[np.isin(smoothed, (FORWARD_PHASE, BACKWARD_PHASE))],
                             allocs[smoothed == OPTIMIZER_PHASE], bool(np.any(action == OOM)))
        if seen > steps.updates:
            steps = Steps(steps.starts, steps.source, seen, steps.first)
    model_allocs = allocs[np.isin(smoothed, (FORWARD_PHASE, BACKWARD_PHASE, EVALUATION_PHASE, GENERATION_PHASE))]
    if steps is not None and len(steps) > 1 and model_allocs.size and not np.any(model_allocs >= steps.starts[-1]):
        # after the last update only teardown ran: not a step
        steps = Steps(steps.starts[:-1], steps.source, steps.updates, steps.first)
    opt_starts = _optimizer_starts(times, phase, windows)
    after_backward = np.zeros(n, dtype=bool)
    after_backward[allocs[gap]] = True
    compiled = bool(np.any(ri.lookup(ri.compiled, stack[allocs]))) or bool(np.any(dt.events["compile_context"] >= 0))
    if not recorded:
        kind = "no stacks recorded: phases unknown"
    elif steps is not None and steps.updates:
        kind = "one optimizer step" if steps.updates == 1 else f"{steps.updates} optimizer steps"
    elif has_b:
        kind = "forward and backward, no torch.optim step"
    elif np.any(smoothed == GENERATION_PHASE):
        kind = "generation (inference)"
    elif np.any(smoothed == EVALUATION_PHASE):
        kind = "evaluation only"
    elif np.any(smoothed == FORWARD_PHASE):
        kind = "forward only" if pass_starts.size <= 1 else f"{pass_starts.size} forward passes, no backward"
    elif (comms := annotation_windows(dt, "nccl:")).shape[0]:
        # PyTorch's own nccl:* scopes (ProcessGroupNCCL's record_function) over a job with no model pass: its
        # collectives are its work, not its setup (issue 37: a loop of 20 all-gathers read "setup only")
        names = sorted({x.name[len("nccl:"):] for x in dt.annotations if x.name.startswith("nccl:")})
        kind = (f"{comms.shape[0]} collective{'s' if comms.shape[0] > 1 else ''} ({', '.join(names[:3])}), "
                "no forward or backward")
    else:
        kind = "setup only"
    return Phases(phase, pass_starts, steps, kind, recorded, python, has_b, source, opt_starts.astype(np.int64),
                  compiled, after_backward)


def _optimizer_starts(times: np.ndarray, phase: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """Per ``Optimizer.step#`` window, the event after which the update begins: the last event before the
    window, or, when the step runs a closure (its forward and backward inside the window), the closure's
    last event. -1 for a window that began before the trace's first event."""
    if times.size == 0 or windows.shape[0] == 0:
        return np.zeros(0, np.int64)
    lo = np.searchsorted(times, windows[:, 0], side="left")
    hi = np.searchsorted(times, windows[:, 1], side="right")
    work = np.isin(phase, PASS_PHASES + (BACKWARD_PHASE,))
    out = lo - 1
    for j in range(windows.shape[0]):
        inner = np.flatnonzero(work[lo[j]:hi[j]])
        if inner.size:
            out[j] = lo[j] + int(inner[-1])
    return out.astype(np.int64)


_MARKED = {"evaluation": EVALUATION_PHASE, "optimizer": OPTIMIZER_PHASE}


def _marked(roles: np.ndarray, times_us: np.ndarray, marks: list[dict[str, Any]] | None) -> tuple[np.ndarray, np.ndarray]:
    """Allocations made while a framework callback said the job evaluates or steps the optimizer
    (sidecar ``phase_markers``: from each mark's ``time_us`` on, its ``phase``) take that phase when
    their stack says only ``forward`` or nothing (an evaluation forward, an optimizer kernel's
    workspace, any allocation when no stacks were recorded). Backward and setup stacks keep theirs.
    Also returns which allocations the markers placed."""
    none = np.zeros(roles.shape, dtype=bool)
    if not marks or roles.size == 0:
        return roles, none
    try:
        ordered: list[tuple[int, Any]] = sorted(((int(m["time_us"]), m["phase"]) for m in marks), key=lambda x: x[0])
        t = np.array([x[0] for x in ordered], dtype=np.int64)
    except (OverflowError, KeyError, TypeError):
        return roles, none
    code = np.array([_MARKED.get(p, -1) for _t, p in ordered], dtype=np.int8)
    i = np.searchsorted(t, times_us, side="right") - 1
    said = np.where(i >= 0, code[np.maximum(i, 0)], -1)
    weak = (roles == FORWARD_PHASE) | (roles == OTHER_PHASE)
    placed = weak & (said >= 0)
    return np.where(placed, said, roles).astype(np.int8), placed


def _smooth(roles: np.ndarray, thread: np.ndarray, times_us: np.ndarray, windows: np.ndarray,
            step_markers: list[dict[str, Any]] | None) -> tuple[np.ndarray, np.ndarray]:
    """Allocations of no known role (``other``) continue the phase before them (``setup`` before any); a
    main-thread one after a backward cannot be part of it: it is ``optimizer`` work when an update shows
    before the next forward pass (an optimizer role, an ``Optimizer.step#`` window, a step marker), else
    ``other``. Also returns which allocations that gap rule placed."""
    if roles.size == 0:
        return roles, np.zeros(0, dtype=bool)
    known = roles != OTHER_PHASE
    pos = np.where(known, np.arange(roles.size), -1)
    last = np.maximum.accumulate(pos)
    out = np.where(last >= 0, roles[np.maximum(last, 0)], SETUP_PHASE).astype(np.int8)
    after_bw = ~known & (out == BACKWARD_PHASE) & (thread != ENGINE_THREAD) & (thread != NO_PYTHON)
    if after_bw.any():
        # the next allocation with a known role, and whether an update shows between here and there
        nxt_pos = np.where(known, np.arange(roles.size), roles.size)
        nxt = np.minimum.accumulate(nxt_pos[::-1])[::-1]
        nxt_role = np.where(nxt < roles.size, roles[np.minimum(nxt, roles.size - 1)], OTHER_PHASE)
        end_t = np.where(nxt < roles.size, times_us[np.minimum(nxt, roles.size - 1)], np.iinfo(np.int64).max)
        marks = np.array(sorted(int(m["time_us"]) for m in step_markers or [] if isinstance(m.get("time_us"), int)),
                         dtype=np.int64)
        starts = windows[:, 0] if windows.shape[0] else np.zeros(0, np.int64)

        def seen(ts: np.ndarray) -> np.ndarray:
            if ts.size == 0:
                return np.zeros(roles.shape, dtype=bool)
            return np.searchsorted(ts, end_t, side="right") > np.searchsorted(ts, times_us, side="left")

        update = (nxt_role == OPTIMIZER_PHASE) | seen(starts) | seen(marks)
        out[after_bw] = np.where(update[after_bw], OPTIMIZER_PHASE, OTHER_PHASE)
    return out, after_bw


def _trailing_evaluation(smoothed: np.ndarray, allocs: np.ndarray, pass_starts: np.ndarray) -> np.ndarray:
    """Forward passes after the last backward of a trace that trains are evaluation (a validation loop
    after training), when no evaluation frame said so and there are more of them than the next step's own
    forwards before its first backward can be: one in a plain loop (one forward after the last update is the
    next step's, cut short by an OOM or the dump); in a pipeline schedule, as many as the trace's steps ran
    before a backward (1F1B's warm-up, GPipe's every micro-batch: the largest count of passes between two
    backwards, or before the first). Issue 35: a 1F1B stage that ran out in its second warm-up forward was
    read as evaluation, and what fits was not sized."""
    b = np.flatnonzero((smoothed == BACKWARD_PHASE) | (smoothed == OPTIMIZER_PHASE))
    if b.size == 0:
        return smoothed
    bw = allocs[b]
    # passes between consecutive backward/optimizer allocations (and before the first): the warm-up depth
    cuts = np.searchsorted(pass_starts, bw)
    depth = int(max(np.max(np.diff(cuts)) if cuts.size > 1 else 0, cuts[0]))
    if np.count_nonzero(pass_starts > allocs[int(b[-1])]) < max(2, depth + 1):
        return smoothed
    tail = slice(int(b[-1]) + 1, None)
    out = smoothed.copy()
    out[tail] = np.where(out[tail] == FORWARD_PHASE, EVALUATION_PHASE, out[tail])
    return out


def _passes(allocs: np.ndarray, model: np.ndarray, smoothed: np.ndarray, stack: np.ndarray) -> np.ndarray:
    """Pass starts (event indices): each run of forward/evaluation/generation phase begins one; inside a
    run, the run's first *entry* (model code allocating right after code that is not: the batch's
    transfer) repeating with the same stack begins the next one. A run that opens with model code (the trace
    begins inside a batch, its transfer unrecorded) has its first entry in the next batch, which it begins."""
    if allocs.size == 0:
        return np.zeros(0, np.int64)
    fwd = np.isin(smoothed, PASS_PHASES)
    prev_fwd = np.concatenate(([False], fwd[:-1]))
    run_start = np.flatnonzero(fwd & ~prev_fwd)  # positions in allocs
    entry = model & np.concatenate(([False], ~model[:-1]))
    starts: list[int] = []
    run_end = np.append(run_start[1:], allocs.size)
    for rs, re_ in zip(run_start.tolist(), run_end.tolist()):
        starts.append(rs)
        hits = rs + np.flatnonzero(entry[rs:re_])
        if hits.size < 2:
            continue
        anchor = stack[allocs[hits[0]]]
        same = hits[stack[allocs[hits]] == anchor]
        # a run opening with the batch's transfer: its first entry is that pass's, and its repeats begin the next
        # ones; a run opening with model code (a trace that begins mid-batch): the first entry is the next batch's
        starts.extend((same[same > rs] if model[rs] else same[1:]).tolist())
    return distinct(allocs[np.array(starts, dtype=np.int64)])


def _updates_seen(starts: np.ndarray, pass_events: np.ndarray, optimizer_events: np.ndarray, ends_in_oom: bool) -> int:
    """The optimizer updates a trace shows between its step markers (``starts``: the event each marked step begins
    at): the stretches between markers, and before the first and after the last, in which a training pass allocated
    (``pass_events``: forward, backward) and then the optimizer's work (``optimizer_events``). A marker starts each
    step, and none need follow the last update (preflight marks each step's start), so the markers alone can count
    one update too few; optimizer work with no pass before it in its stretch (a job's teardown after its last
    marker) is no update. The last stretch of a trace that ends in an OOM is a step that did not finish: it has no
    update yet."""
    n = starts.size + 1
    first_pass = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(first_pass, np.searchsorted(starts, pass_events, side="right"), pass_events)
    last_update = np.full(n, -1)
    np.maximum.at(last_update, np.searchsorted(starts, optimizer_events, side="right"), optimizer_events)
    updated = first_pass < last_update
    if ends_in_oom:
        updated[-1] = False
    return int(np.count_nonzero(updated))


def _steps(trace: Trace, dt: DeviceTrace, allocs: np.ndarray, smoothed: np.ndarray) -> Steps | None:
    n = dt.num_events
    t = dt.events["time_us"]
    markers = trace.meta.get("step_markers")
    if markers and n:
        ordered = sorted(markers, key=lambda m: m["time_us"])
        try:  # integers (checked at load), but maybe beyond int64
            times = np.array([m["time_us"] for m in ordered], dtype=np.int64)
        except OverflowError:
            times = np.zeros(0, np.int64)
        if times.size:
            at = np.searchsorted(t, times, side="left")
            starts = distinct(at)
            starts = starts[starts < n]
            if starts.size:
                ends_in_trace = int(np.count_nonzero((times > t[0]) & (times <= t[-1])))
                number = ordered[int(np.flatnonzero(at == starts[0])[-1])].get("step")
                first = number if isinstance(number, int) and not isinstance(number, bool) and number >= 0 else 0
                return Steps(starts, "markers", ends_in_trace, first)
    if dt.annotations and n:
        prof = sorted(a.time_us for a in annotations_named(dt, "ProfilerStep#")
                      if a.stage == "START" and _PROFILER_STEP.match(a.name))
        if len(prof) >= 2:
            s = distinct(np.searchsorted(t, np.array(prof), side="left"))
            return Steps(s[s < n], "annotations", len(s) - 1)
        # each Optimizer.step# scope ends a step; without any (a torch.compile-d step() runs without it, PyTorch's
        # recipe), zero_grad's scopes do: one per iteration, before or after the update
        scope_end = (sorted(a.time_us for a in annotations_named(dt, OPTIMIZER_STEP) if a.stage == "END")
                     or sorted(a.time_us for a in annotations_named(dt, OPTIMIZER_ZERO_GRAD) if a.stage == "END"))
        if scope_end:
            ends = np.searchsorted(t, np.array(scope_end), side="right")
            s = distinct(np.concatenate(([0], ends)))
            return Steps(s[s < n], "annotations", len(scope_end))
    if allocs.size == 0:
        return None
    o = smoothed == OPTIMIZER_PHASE
    prev = np.concatenate(([False], o[:-1]))
    ends = np.flatnonzero(prev & ~o)  # first allocation after each optimizer run
    last_open = bool(o[-1])
    if ends.size == 0 and not last_open:
        return None
    starts = distinct(np.concatenate(([0], allocs[ends])))
    return Steps(starts[starts < n], "optimizer frames", int(ends.size + last_open))
