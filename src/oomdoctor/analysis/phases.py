"""Phases, steps and passes of a trace: which part of training every event belongs to.

Each allocation's stack says what ran it (:mod:`oomdoctor.frameworks`): a ``backward`` frame anywhere
(or no Python frame at all: the autograd engine's device threads), else the innermost frame that is
``setup``, ``optimizer`` or ``forward`` code; ``forward`` becomes ``evaluation`` under an evaluation loop.
Allocations of no known role take the phase of the allocation before them; frees and segment events
belong to the phase of the allocation before them.

**Steps** are optimizer updates, found only from evidence that means one, in order of trust: the
sidecar's step markers (``oomdoctor.record``'s global optimizer step hook), ``Optimizer.step#...``
``record_function`` annotations (recorded by ``_record_memory_history`` since PyTorch 2.5,
``memory_snapshot.cpp`` ``_initRecordAnnotations``), or runs of optimizer allocations. Layers that
repeat inside a forward pass are never steps: a trace with no update is a forward pass (or a
forward and backward pass) and is said to be so.

Phases a framework callback marked (sidecar ``phase_markers``: evaluation, optimizer) override a
stack that says only ``forward`` or nothing (:func:`_marked`).

**Passes** are forward passes (one micro-batch each): a pass begins at the first forward or evaluation
allocation after a backward or optimizer one, and inside a run of forward passes (an evaluation loop)
where the run's first forward allocation, preceded by an allocation that is not forward code (the next
batch's transfer), repeats.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

import numpy as np

from ..frameworks import (
    BACKWARD,
    BACKWARD_NAME_PATHS,
    COMMUNICATION,
    ENGINE_CPP,
    EVALUATION,
    EVALUATION_NAMES,
    FORWARD,
    FORWARD_NAMES,
    MODULE_CALL_NAMES,
    MODULE_FILE,
    OPTIMIZER,
    OPTIMIZER_EXCLUDED,
    SETUP,
    SETUP_NAMES,
    matches,
    normalize_path,
)
from ..trace.model import ALLOC, DeviceTrace, StackTable, Trace
from .sites import per_table

# role / phase codes
SETUP_PHASE = 0
FORWARD_PHASE = 1
BACKWARD_PHASE = 2
OPTIMIZER_PHASE = 3
EVALUATION_PHASE = 4
OTHER_PHASE = 5
PHASE_NAMES: tuple[str, ...] = ("setup", "forward", "backward", "optimizer", "evaluation", "other")
NO_FRAMES = 6  # a stack without any frame (role decided per trace)
UNRECORDED = 7  # stack id -1


@dataclass(frozen=True)
class StackRole:
    """What one stack says: its ``role`` (a phase code, :data:`NO_FRAMES` or :data:`UNRECORDED`), whether
    it allocates a collective's buffer (``communication``), whether it is optimizer code, and whether
    model code made the allocation (``model``: the innermost known frame is forward code)."""

    role: int
    communication: bool
    optimizer: bool
    model: bool = False


def classify_frames(frames: list[tuple[str, int, str]]) -> StackRole:
    """The role of one stack (frames innermost first). Pure; see the module doc for the rules."""
    if not frames:
        return StackRole(NO_FRAMES, False, False)
    norm = [(normalize_path(f), n) for f, _line, n in frames]
    py = [(f, n) for f, n in norm if f.endswith(".py")]
    comm = any(matches(f, n, COMMUNICATION) for f, n in py)
    optim = any(matches(f, n, OPTIMIZER) and not any(x in f for x in OPTIMIZER_EXCLUDED) for f, n in py)
    if not py:  # C++ frames only (stacks="all"): the engine thread, or native code
        engine = any(any(e in n for e in ENGINE_CPP) for _f, n in norm)
        return StackRole(BACKWARD_PHASE if engine else NO_FRAMES, comm, False)
    for f, n in py:
        if matches(f, n, BACKWARD) or n == "backward" or ("backward" in n and any(p in f for p in BACKWARD_NAME_PATHS)):
            return StackRole(BACKWARD_PHASE, comm, optim)
    role = OTHER_PHASE
    for f, n in py:
        if any(x in f for x in OPTIMIZER_EXCLUDED) or (f.endswith(MODULE_FILE) and n not in MODULE_CALL_NAMES
                                                        and not matches(f, n, SETUP)):
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
    if role in (FORWARD_PHASE, OTHER_PHASE) and any(matches(f, n, EVALUATION) or n in EVALUATION_NAMES
                                                     for f, n in py):
        role = EVALUATION_PHASE
    return StackRole(role, comm, optim, model)


class RoleIndex:
    """Stack id -> :class:`StackRole`, as arrays (computed once per stack table)."""

    def __init__(self, stacks: StackTable) -> None:
        roles = [classify_frames(stacks.stack_frames(s)) for s in range(len(stacks))]
        # last slot: stack id -1
        self.role = np.array([r.role for r in roles] + [UNRECORDED], dtype=np.int8)
        self.communication = np.array([r.communication for r in roles] + [False], dtype=bool)
        self.optimizer = np.array([r.optimizer for r in roles] + [False], dtype=bool)
        self.model = np.array([r.model for r in roles] + [False], dtype=bool)

    def lookup(self, arr: np.ndarray, stack_ids: np.ndarray) -> np.ndarray:
        return arr[np.where(stack_ids >= 0, stack_ids, arr.shape[0] - 1)]

    def roles_of(self, stack_ids: np.ndarray, python_stacks: bool) -> np.ndarray:
        """Each stack's role as a phase code: no frames (or no stack) is backward when Python stacks
        were recorded (the autograd engine's threads), else ``other``."""
        r = self.lookup(self.role, stack_ids)
        return np.where((r == NO_FRAMES) | (r == UNRECORDED), BACKWARD_PHASE if python_stacks else OTHER_PHASE,
                        r).astype(np.int8)


_ROLES: "weakref.WeakKeyDictionary[StackTable, RoleIndex]" = weakref.WeakKeyDictionary()


def role_index(trace: Trace) -> RoleIndex:
    """The :class:`RoleIndex` of a trace's stack table (one per table, kept while the table lives)."""
    return per_table(_ROLES, trace.stacks, RoleIndex)


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
    """The phase of every event (``phase``: codes of :data:`PHASE_NAMES`, shape ``(num_events,)``), the
    forward passes (``pass_starts``: event indices, increasing) and the steps (None without any
    optimizer update or marker). ``kind`` says what the trace holds, in words."""

    phase: np.ndarray
    pass_starts: np.ndarray
    steps: Steps | None
    kind: str
    stacks_recorded: bool
    python_stacks: bool
    has_backward: bool

    def phase_name(self, k: int) -> str:
        """The phase after event ``k`` (``setup`` before the first event)."""
        if k < 0 or self.phase.size == 0:
            return PHASE_NAMES[SETUP_PHASE]
        return PHASE_NAMES[int(self.phase[min(k, self.phase.size - 1)])]

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


def find_phases(trace: Trace, dt: DeviceTrace) -> Phases:
    """Label every event of ``dt`` with its phase, and find passes and steps. Pure; O(events)."""
    n = dt.num_events
    action, stack = dt.events["action"], dt.events["stack"]
    ri = role_index(trace)
    allocs = np.flatnonzero(action == ALLOC)
    raw = ri.lookup(ri.role, stack[allocs])
    recorded = (trace.meta.get("recording") or {}).get("stacks") != "none" and bool(
        np.any((raw != NO_FRAMES) & (raw != UNRECORDED)))
    python = recorded and bool(np.any(raw <= OTHER_PHASE))
    roles = _marked(ri.roles_of(stack[allocs], python), dt.events["time_us"][allocs], trace.meta.get("phase_markers"))
    # allocations of no known role continue the phase before them; before any, setup
    known = roles != OTHER_PHASE
    pos = np.where(known, np.arange(roles.size), -1)
    last = np.maximum.accumulate(pos) if roles.size else pos
    smoothed = np.where(last >= 0, roles[np.maximum(last, 0)], SETUP_PHASE).astype(np.int8)
    pass_starts = _passes(allocs, ri.lookup(ri.model, stack[allocs]), smoothed, stack)
    smoothed = _trailing_evaluation(smoothed, allocs, pass_starts)
    phase = np.full(n, SETUP_PHASE, dtype=np.int8)
    if allocs.size:
        idx = np.searchsorted(allocs, np.arange(n), side="right") - 1
        phase = np.where(idx >= 0, smoothed[np.maximum(idx, 0)], SETUP_PHASE).astype(np.int8)
    has_b = bool(np.any(smoothed == BACKWARD_PHASE))
    steps = _steps(trace, dt, allocs, smoothed)
    model_allocs = allocs[np.isin(smoothed, (FORWARD_PHASE, BACKWARD_PHASE, EVALUATION_PHASE))]
    if steps is not None and len(steps) > 1 and model_allocs.size and not np.any(model_allocs >= steps.starts[-1]):
        # after the last update only teardown ran: not a step
        steps = Steps(steps.starts[:-1], steps.source, steps.updates)
    if not recorded:
        kind = "no stacks recorded: phases unknown"
    elif steps is not None and steps.updates:
        kind = "one optimizer step" if steps.updates == 1 else f"{steps.updates} optimizer steps"
    elif has_b:
        kind = "forward and backward, no optimizer step"
    elif np.any(smoothed == EVALUATION_PHASE):
        kind = "evaluation only"
    elif np.any(smoothed == FORWARD_PHASE):
        kind = "forward only" if pass_starts.size <= 1 else f"{pass_starts.size} forward passes, no backward"
    else:
        kind = "setup only"
    return Phases(phase, pass_starts, steps, kind, recorded, python, has_b)


_MARKED = {"evaluation": EVALUATION_PHASE, "optimizer": OPTIMIZER_PHASE}


def _marked(roles: np.ndarray, times_us: np.ndarray, marks: list[dict] | None) -> np.ndarray:
    """Allocations made while a framework callback said the job evaluates or steps the optimizer
    (sidecar ``phase_markers``: from each mark's ``time_us`` on, its ``phase``) take that phase when
    their stack says only ``forward`` or nothing (an evaluation forward, an optimizer kernel's
    workspace, any allocation when no stacks were recorded). Backward and setup stacks keep theirs."""
    if not marks or roles.size == 0:
        return roles
    try:
        ordered = sorted(((int(m["time_us"]), m["phase"]) for m in marks), key=lambda x: x[0])
        t = np.array([x[0] for x in ordered], dtype=np.int64)
    except (OverflowError, KeyError, TypeError):
        return roles
    code = np.array([_MARKED.get(p, -1) for _t, p in ordered], dtype=np.int8)
    i = np.searchsorted(t, times_us, side="right") - 1
    said = np.where(i >= 0, code[np.maximum(i, 0)], -1)
    weak = (roles == FORWARD_PHASE) | (roles == OTHER_PHASE)
    return np.where(weak & (said >= 0), said, roles).astype(np.int8)


def _trailing_evaluation(smoothed: np.ndarray, allocs: np.ndarray, pass_starts: np.ndarray) -> np.ndarray:
    """Forward passes after the last backward of a trace that trains are evaluation (a validation loop
    after training), when no evaluation frame said so and there are at least two of them (one forward
    after the last update is the next step's, cut short by an OOM or the dump)."""
    b = np.flatnonzero((smoothed == BACKWARD_PHASE) | (smoothed == OPTIMIZER_PHASE))
    if b.size == 0 or np.count_nonzero(pass_starts > allocs[int(b[-1])]) < 2:
        return smoothed
    tail = slice(int(b[-1]) + 1, None)
    out = smoothed.copy()
    out[tail] = np.where(out[tail] == FORWARD_PHASE, EVALUATION_PHASE, out[tail])
    return out


def _passes(allocs: np.ndarray, model: np.ndarray, smoothed: np.ndarray, stack: np.ndarray) -> np.ndarray:
    """Pass starts (event indices): each run of forward/evaluation phase begins one; inside a run, the
    run's first *entry* (model code allocating right after code that is not: the batch's transfer)
    repeating with the same stack begins the next one."""
    if allocs.size == 0:
        return np.zeros(0, np.int64)
    fwd = (smoothed == FORWARD_PHASE) | (smoothed == EVALUATION_PHASE)
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
        starts.extend(same[same > rs].tolist())
    return np.unique(allocs[np.array(starts, dtype=np.int64)])


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
            starts = np.unique(at)
            starts = starts[starts < n]
            if starts.size:
                ends_in_trace = int(np.count_nonzero((times > t[0]) & (times <= t[-1])))
                number = ordered[int(np.flatnonzero(at == starts[0])[-1])].get("step")
                first = number if isinstance(number, int) and not isinstance(number, bool) and number >= 0 else 0
                return Steps(starts, "markers", ends_in_trace, first)
    if dt.annotations and n:
        prof = sorted(a.time_us for a in dt.annotations if a.stage == "START" and _PROFILER_STEP.match(a.name))
        if len(prof) >= 2:
            s = np.unique(np.searchsorted(t, np.array(prof), side="left"))
            return Steps(s[s < n], "annotations", len(s) - 1)
        opt_end = sorted(a.time_us for a in dt.annotations if a.stage == "END" and a.name.startswith("Optimizer.step#"))
        if opt_end:
            ends = np.searchsorted(t, np.array(opt_end), side="right")
            s = np.unique(np.concatenate(([0], ends)))
            return Steps(s[s < n], "annotations", len(opt_end))
    if allocs.size == 0:
        return None
    o = smoothed == OPTIMIZER_PHASE
    prev = np.concatenate(([False], o[:-1]))
    ends = np.flatnonzero(prev & ~o)  # first allocation after each optimizer run
    last_open = bool(o[-1])
    if ends.size == 0 and not last_open:
        return None
    starts = np.unique(np.concatenate(([0], allocs[ends])))
    return Steps(starts[starts < n], "optimizer frames", int(ends.size + last_open))
