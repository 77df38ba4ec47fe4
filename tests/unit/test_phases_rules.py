"""The phase of every event of a trace, its source, passes and steps, pinned rule by rule.

- ``analysis/phases.py`` helpers, called directly with exact outputs: ``stack_thread`` (the outermost frame:
  ``<module>`` or ``runpy`` is the main thread, ``threading.py`` a Python thread, anything else the autograd
  engine), ``classify_frames`` (each role rule of the module doc: C++ engine frames, backward frames and
  ``*backward*`` hooks, ``Module`` plumbing and LR schedulers skipped, setup / optimizer / forward names,
  ``__init__`` of model code is setup, generation over evaluation, and the communication / optimizer / cache /
  compiled / model / thread flags), ``RoleIndex`` (the arrays per stack, the last slot for stack -1, engine
  threads read as main when no stack reaches a main module), the ``Phases`` accessors at every edge (k < 0,
  empty arrays, k past the end), ``annotation_windows`` (START/END paired per name, innermost first, a scope
  still open closing at the last event), ``_marked`` (a mark holds from its ``time_us`` on, only over forward
  or unknown stacks), ``_smooth`` (unknown allocations continue the phase before; after a backward a main
  thread one is ``optimizer`` when an update shows before the next known allocation, else ``other``),
  ``_optimizer_starts`` (the event before each window, or a closure's last event), ``_passes``,
  ``_trailing_evaluation`` and ``_steps`` (markers, ``ProfilerStep#``, ``Optimizer.step#`` ENDs, optimizer runs).
- ``find_phases`` on traces built with :class:`builder.SnapBuilder` (frames as PyTorch records them): the
  sources per event, ``Optimizer.step#`` and ``Optimizer.zero_grad#`` windows at their exact START and END
  times, a closure's forward and backward, the gap after a backward and ``after_backward``, step markers, a
  last step of teardown only, the compiled flag and every ``kind`` sentence.

Every expected array is read off the events placed here by the rule the module doc states.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from builder import MiB, SnapBuilder, frames, stack_table

from oomdoctor import load
from oomdoctor.analysis.phases import (
    ANNOTATIONS,
    BACKWARD_PHASE,
    ENGINE_THREAD,
    EVALUATION_PHASE,
    FORWARD_PHASE,
    FRAMES,
    GENERATION_PHASE,
    INFERRED,
    MAIN_THREAD,
    MARKERS,
    NO_FRAMES,
    NO_PYTHON,
    OPTIMIZER_PHASE,
    OTHER_PHASE,
    PYTHON_THREAD,
    SETUP_PHASE,
    THREAD,
    UNRECORDED,
    Phases,
    RoleIndex,
    StackRole,
    Steps,
    _marked,
    _optimizer_starts,
    _passes,
    _smooth,
    _steps,
    _trailing_evaluation,
    annotation_windows,
    classify_frames,
    find_phases,
    stack_thread,
)
from oomdoctor.trace.model import Annotation, StackTable

S, F, B, OP, E, X, G = (SETUP_PHASE, FORWARD_PHASE, BACKWARD_PHASE, OPTIMIZER_PHASE, EVALUATION_PHASE, OTHER_PHASE,
                       GENERATION_PHASE)
TORCH = "/venv/lib/python3.12/site-packages/torch"
TF = "/venv/lib/python3.12/site-packages/transformers"
ROOT = ("/w/train.py", 1, "<module>")
MODULE = f"{TORCH}/nn/modules/module.py"
STEP = "Optimizer.step#SGD.step"
ZERO = "Optimizer.zero_grad#SGD.zero_grad"


# ---------------------------------------------------------------------------------------------- stack_thread


@pytest.mark.parametrize("py, thread", [
    ([], NO_PYTHON),
    ([("/w/train.py", "<module>")], MAIN_THREAD),
    ([("/w/lib.py", "f"), ("/w/train.py", "<module>")], MAIN_THREAD),
    ([("/w/lib.py", "f"), ("/usr/lib/python3.12/runpy.py", "_run_code")], MAIN_THREAD),
    ([("/w/lib.py", "f"), ("/usr/lib/python3.12/threading.py", "_bootstrap")], PYTHON_THREAD),
    ([("/w/lib.py", "<module>"), ("/w/hooks.py", "hook")], ENGINE_THREAD),  # only the outermost frame counts
    ([("/w/runpy.py.bak", "f")], ENGINE_THREAD),
])
def test_stack_thread_is_read_from_the_outermost_frame(py, thread):
    assert stack_thread(py) == thread


# ------------------------------------------------------------------------------------------- classify_frames

CASES = [
    # no frame at all
    ([], StackRole(NO_FRAMES, False, False, False, NO_PYTHON, False, False)),
    # C++ frames only: the engine's threads are backward, other native code has no role
    ([("??", 0, "torch::autograd::Engine::thread_main(std::shared_ptr<GraphTask>)")],
     StackRole(B, False, False, False, NO_PYTHON, False, False)),
    ([("??", 0, "at::native::empty_cuda"), ("/tmp/torchinductor_me/ab/cab.cpp", 0, "kernel")],
     StackRole(NO_FRAMES, False, False, False, NO_PYTHON, False, True)),
    # backward frames, with every flag raised and the thread of the outermost frame
    ([(f"{TORCH}/distributed/distributed_c10d.py", 1, "all_reduce"), (f"{TF}/cache_utils.py", 1, "update"),
      (f"{TORCH}/optim/adam.py", 1, "step"), ("/tmp/torchinductor_me/xy/cxy.py", 1, "call"),
      (f"{TORCH}/_tensor.py", 1, "backward"), ROOT],
     StackRole(B, True, True, False, MAIN_THREAD, True, True)),
    ([(f"{TORCH}/autograd/__init__.py", 1, "_make_grads"), ROOT], StackRole(B, False, False, False, MAIN_THREAD)),
    ([("/w/model.py", 1, "backward"), ROOT], StackRole(B, False, False, False, MAIN_THREAD)),
    ([(f"{TORCH}/distributed/fsdp/_runtime_utils.py", 1, "_post_backward_hook"), ("/w/hooks.py", 1, "run")],
     StackRole(B, False, False, False, ENGINE_THREAD)),
    # a name with "backward" outside the hook paths is not backward; functorch code is forward
    ([("/w/model.py", 1, "my_backward_fn"), ROOT], StackRole(X, False, False, False, MAIN_THREAD)),
    ([(f"{TORCH}/_functorch/aot_autograd.py", 1, "forward_fn"), ROOT], StackRole(F, False, False, True, MAIN_THREAD)),
    # optimizer: a named pattern, the LR scheduler excluded (skipped, its callers decide)
    ([(f"{TF}/optimization.py", 1, "step"), ROOT], StackRole(OP, False, True, False, MAIN_THREAD)),
    ([(f"{TORCH}/optim/adam.py", 1, "_init_group"), ROOT], StackRole(OP, False, True, False, MAIN_THREAD)),
    ([(f"{TORCH}/optim/lr_scheduler.py", 1, "step"), ("/w/train.py", 1, "main"), ROOT],
     StackRole(X, False, False, False, MAIN_THREAD)),
    ([(f"{TORCH}/optim/lr_scheduler.py", 1, "step"), ("/w/model.py", 1, "forward"), ROOT],
     StackRole(F, False, False, True, MAIN_THREAD)),
    # Module plumbing that is not a call is skipped; its call functions are forward
    ([(MODULE, 1, "_call_hooks"), ("/w/train.py", 1, "main"), ROOT], StackRole(X, False, False, False, MAIN_THREAD)),
    ([(MODULE, 1, "_call_impl"), ("/w/train.py", 1, "main"), ROOT], StackRole(F, False, False, True, MAIN_THREAD)),
    ([(MODULE, 1, "_apply"), ROOT], StackRole(S, False, False, False, MAIN_THREAD)),
    # a container adding the caller's modules (nn.ModuleList(Block() for ...)) is skipped, its forward is forward
    ([("/w/model.py", 1, "__init__"), (f"{TORCH}/nn/modules/container.py", 1, "extend"),
      (f"{TORCH}/nn/modules/container.py", 1, "__init__"), ("/w/train.py", 1, "main"), ROOT],
     StackRole(X, False, False, False, MAIN_THREAD)),
    ([(f"{TORCH}/nn/modules/container.py", 1, "forward"), ROOT], StackRole(F, False, False, True, MAIN_THREAD)),
    ([("/w/model.py", 1, "init_weights"), ROOT], StackRole(S, False, False, False, MAIN_THREAD)),
    # forward by path (with names or not) and by name; __init__ of model code is setup
    ([(f"{TORCH}/nn/functional.py", 1, "linear"), ROOT], StackRole(F, False, False, True, MAIN_THREAD)),
    ([("/venv/lib/python3.12/site-packages/accelerate/utils/operations.py", 1, "convert_to_fp32"), ROOT],
     StackRole(F, False, False, True, MAIN_THREAD)),
    ([(f"{TF}/models/llama/modeling_llama.py", 1, "__init__"), ROOT], StackRole(S, False, False, False, MAIN_THREAD)),
    # communication (named patterns, the innermost-frame site rule) with the other flags
    ([(f"{TORCH}/nn/parallel/distributed.py", 1, "_pre_forward"), (f"{TF}/cache_utils.py", 1, "update"),
      ("/tmp/torchinductor_me/ab/cab.py", 1, "call"), (f"{TF}/optimization.py", 1, "step"),
      ("/usr/lib/python3.12/threading.py", 1, "_bootstrap")],
     StackRole(F, True, True, True, PYTHON_THREAD, True, True)),
    ([(f"{TF}/cache_utils.py", 1, "update"), ("/w/train.py", 1, "main"), ROOT],
     StackRole(F, False, False, True, MAIN_THREAD, True, False)),
    ([("/venv/deepspeed/runtime/zero/stage3.py", 1, "_setup_for_real_optimizer"), ROOT],
     StackRole(X, True, False, False, MAIN_THREAD)),
    ([("/w/a.py", 1, "f"), ("/venv/deepspeed/runtime/zero/stage3.py", 1, "_setup_for_real_optimizer"), ROOT],
     StackRole(X, False, False, False, MAIN_THREAD)),
    # generation over evaluation, evaluation by name; model code keeps model=True
    ([("/w/model.py", 1, "forward"), (f"{TF}/generation/utils.py", 1, "generate"), ("/w/t.py", 1, "evaluate"), ROOT],
     StackRole(G, False, False, True, MAIN_THREAD)),
    ([("/w/model.py", 1, "forward"), ("/w/train.py", 1, "validate"), ROOT], StackRole(E, False, False, True, MAIN_THREAD)),
    ([("/w/train.py", 1, "evaluate"), ROOT], StackRole(E, False, False, False, MAIN_THREAD)),
    ([("C:\\w\\torch\\optim\\sgd.py", 1, "step"), ROOT], StackRole(OP, False, True, False, MAIN_THREAD)),
]


@pytest.mark.parametrize("fr, role", CASES)
def test_classify_frames(fr, role):
    assert classify_frames(fr) == role


# ------------------------------------------------------------------------------------------------ RoleIndex


def _table(*stacks: list[tuple[str, int, str]]) -> StackTable:
    return stack_table(*stacks)[0]


def test_role_index_arrays_and_the_slot_of_stack_minus_one():
    ri = RoleIndex(_table(
        [("/w/model.py", 1, "forward"), ROOT],
        [(f"{TORCH}/distributed/fsdp/_runtime_utils.py", 1, "_post_backward_hook"), ("/w/h.py", 1, "hook")],
        [(f"{TORCH}/distributed/distributed_c10d.py", 1, "all_gather"), (f"{TORCH}/optim/adam.py", 1, "step"),
         ("/tmp/torchinductor_me/a/b.py", 1, "call"), (f"{TF}/cache_utils.py", 1, "update"), ROOT],
        [("??", 0, "at::native::empty_cuda")],
    ))
    assert ri.role.tolist() == [F, B, OP, NO_FRAMES, UNRECORDED] and ri.role.dtype == np.int8
    assert ri.thread.tolist() == [MAIN_THREAD, ENGINE_THREAD, MAIN_THREAD, NO_PYTHON, NO_PYTHON]
    assert ri.thread.dtype == np.int8
    assert ri.communication.tolist() == [False, False, True, False, False]
    assert ri.optimizer.tolist() == [False, False, True, False, False]
    assert ri.model.tolist() == [True, False, False, False, False]
    assert ri.cache.tolist() == [False, False, True, False, False]
    assert ri.compiled.tolist() == [False, False, True, False, False]
    ids = np.array([0, 1, 3, -1])
    assert ri.lookup(ri.role, ids).tolist() == [F, B, NO_FRAMES, UNRECORDED]
    assert ri.engine(ids, True).tolist() == [False, True, True, True]
    assert ri.engine(ids, False).tolist() == [False, True, False, False]
    roles = ri.roles_of(ids, False)
    assert roles.tolist() == [F, B, X, X] and roles.dtype == np.int8
    assert ri.roles_of(ids, True).tolist() == [F, B, B, B]


def test_role_index_reads_engine_roots_as_main_without_any_main_module():
    # stacks cut short (no <module> anywhere) say nothing of threads: their roots are the main thread's
    ri = RoleIndex(_table([("/w/model.py", 1, "forward"), ("/w/train.py", 1, "main")], [("/w/h.py", 1, "hook")]))
    assert ri.thread.tolist() == [MAIN_THREAD, MAIN_THREAD, NO_PYTHON]
    assert ri.roles_of(np.array([0, 1]), True).tolist() == [F, X]


# ------------------------------------------------------------------------------------------ Phases accessors


def _phases(phase, source=None, pass_starts=(), steps=None) -> Phases:
    return Phases(np.array(phase, dtype=np.int8), np.array(pass_starts, dtype=np.int64), steps, "k", True, True,
                  False, None if source is None else np.array(source, dtype=np.int8))


def test_phase_name_at_every_edge():
    ph = _phases([F, B, OP])
    assert [ph.phase_name(k) for k in (-1, 0, 1, 2, 3, 99)] == ["setup", "forward", "backward", "optimizer",
                                                                  "optimizer", "optimizer"]
    assert _phases([B]).phase_name(0) == "backward" and _phases([B]).phase_name(5) == "backward"
    assert _phases([]).phase_name(0) == "setup" and _phases([]).phase_name(3) == "setup"


def test_source_name_at_every_edge():
    ph = _phases([F, B, OP], source=[FRAMES, THREAD, ANNOTATIONS])
    assert [ph.source_name(k) for k in (-1, 0, 1, 2, 3, 99)] == [
        "inferred", "frames", "autograd engine thread", "annotations", "annotations", "annotations"]
    assert _phases([F]).source_name(0) == "inferred"  # no sources kept
    assert _phases([], source=[]).source_name(0) == "inferred"
    one = _phases([OP], source=[MARKERS])
    assert one.source_name(0) == "markers" and one.source_name(4) == "markers" and one.source_name(-1) == "inferred"


def test_pass_of():
    ph = _phases([F] * 10, pass_starts=[3, 7])
    assert [int(ph.pass_of(k)) for k in (0, 2, 3, 6, 7, 100)] == [-1, -1, 0, 0, 1, 1]
    assert ph.pass_of(np.array([2, 3, 7])).tolist() == [-1, 0, 1]
    assert _phases([]).pass_of(np.array([0, 5])).tolist() == [-1, -1]


def test_run_starts_and_run_number():
    ph = _phases([F, F, B, F, S, F, F, OP])
    assert ph.run_starts(F).tolist() == [0, 3, 5]
    assert ph.run_number(F).tolist() == [1, 1, 1, 2, 2, 3, 3, 3]
    assert ph.run_starts(OP).tolist() == [7] and ph.run_number(OP).tolist() == [0] * 7 + [1]
    assert ph.run_starts(E).tolist() == [] and ph.run_number(E).tolist() == [0] * 8
    assert _phases([]).run_starts(F).tolist() == [] and _phases([]).run_number(F).tolist() == []


def test_step_of():
    steps = Steps(np.array([0, 10, 20]), "markers", 2, first=5)
    ph = _phases([F] * 30, steps=steps)
    assert [ph.step_of(k) for k in (-1, 0, 9, 10, 19, 20, 99)] == [None, 5, 5, 6, 6, 7, 7]
    assert _phases([F]).step_of(0) is None
    assert _phases([F] * 5, steps=Steps(np.zeros(0, np.int64), "markers", 0)).step_of(3) is None
    assert len(Steps(np.array([4, 8]), "annotations", 1)) == 2


# ---------------------------------------------------------------------------------------- annotation_windows


def _dt(times, annotations=()):
    times = np.array(times, dtype=np.int64)
    return SimpleNamespace(annotations=[Annotation(*a) for a in annotations], events={"time_us": times},
                           num_events=int(times.size))


def test_annotation_windows_pairs_start_and_end_per_name():
    dt = _dt([1, 2, 100], [
        ("ProfilerStep#1", "START", 0), ("Optimizer.step#Adam.step", "END", 5),  # an END with nothing open: ignored
        (STEP, "START", 10), (STEP, "START", 12), (STEP, "END", 14), (STEP, "END", 20),
        ("ProfilerStep#1", "END", 21), ("Optimizer.step#Adam.step", "START", 15), ("Optimizer.step#Adam.step", "start", 16),
        ("Optimizer.step#Adam.step", "end", 17), (ZERO, "START", 40), (ZERO, "END", 45), (STEP, "START", 30),
    ])
    # the innermost START closes first; Adam's step (START at 15) and SGD's at 30 are still open: closed at 100
    assert annotation_windows(dt, "Optimizer.step#").tolist() == [[10, 20], [12, 14], [15, 100], [30, 100]]
    assert annotation_windows(dt, ("Optimizer.step#", "Optimizer.zero_grad#")).tolist() == [
        [10, 20], [12, 14], [15, 100], [30, 100], [40, 45]]
    assert annotation_windows(dt, "ProfilerStep#").tolist() == [[0, 21]]
    assert annotation_windows(dt, "nothing").shape == (0, 2)


def test_annotation_windows_left_open_close_at_the_last_event_or_their_start():
    assert annotation_windows(_dt([1, 2, 100], [(STEP, "START", 150)]), "Optimizer.step#").tolist() == [[150, 150]]
    assert annotation_windows(_dt([], [(STEP, "START", 0)]), "Optimizer.step#").tolist() == [[0, 0]]
    assert annotation_windows(_dt([], [(STEP, "START", 7)]), "Optimizer.step#").tolist() == [[7, 7]]
    w = annotation_windows(_dt([5], [(STEP, "START", 3)]), "Optimizer.step#")
    assert w.tolist() == [[3, 5]] and w.dtype == np.int64


# ---------------------------------------------------------------------------------------------------- _marked


def test_marked_holds_from_each_mark_on_over_forward_and_unknown_stacks():
    roles = np.array([X, F, X, B, S, F, X, OP, F], dtype=np.int8)
    times = np.array([5, 10, 20, 30, 40, 50, 60, 70, 80])
    marks = [{"time_us": 50, "phase": "evaluation"}, {"time_us": 10, "phase": "optimizer"},
             {"time_us": 75, "phase": "train"}]
    out, placed = _marked(roles, times, marks)
    # before the first mark nothing; a mark at an allocation's own time covers it; backward and setup keep theirs;
    # an unknown phase ("train") says nothing
    assert out.tolist() == [X, OP, OP, B, S, E, E, OP, F] and out.dtype == np.int8
    assert placed.tolist() == [False, True, True, False, False, True, True, False, False]


def test_marked_edges():
    one = np.array([X], dtype=np.int8)
    out, placed = _marked(one, np.array([10]), [{"time_us": 10, "phase": "evaluation"}])
    assert out.tolist() == [E] and placed.tolist() == [True]
    for marks in (None, []):
        out, placed = _marked(one, np.array([10]), marks)
        assert out.tolist() == [X] and placed.tolist() == [False]
    out, placed = _marked(np.zeros(0, np.int8), np.zeros(0, np.int64), [{"time_us": 1, "phase": "optimizer"}])
    assert out.size == 0 and placed.size == 0
    # two marks at the same time: the later one said wins
    same = [{"time_us": 10, "phase": "optimizer"}, {"time_us": 10, "phase": "evaluation"}]
    assert _marked(one, np.array([10]), same)[0].tolist() == [E]
    assert _marked(one, np.array([10]), same[::-1])[0].tolist() == [OP]
    # beyond int64, malformed: the marks are not used at all
    for bad in ([{"time_us": 5, "phase": "optimizer"}, {"time_us": 2 ** 70, "phase": "evaluation"}],
                [{"phase": "optimizer"}], [{"time_us": None, "phase": "optimizer"}]):
        out, placed = _marked(one, np.array([10]), bad)
        assert out.tolist() == [X] and placed.tolist() == [False]


# ---------------------------------------------------------------------------------------------------- _smooth

M4 = np.full(4, MAIN_THREAD, dtype=np.int8)
NOWIN = np.zeros((0, 2), np.int64)


def test_smooth_continues_the_phase_before():
    roles = np.array([X, F, X, S, X, E, X], dtype=np.int8)
    out, gap = _smooth(roles, np.full(7, MAIN_THREAD, np.int8), np.arange(7) * 10, NOWIN, None)
    assert out.tolist() == [S, F, F, S, S, E, E] and out.dtype == np.int8
    assert gap.tolist() == [False] * 7
    out, gap = _smooth(np.array([X], np.int8), np.array([MAIN_THREAD], np.int8), np.array([0]), NOWIN, None)
    assert out.tolist() == [S] and gap.tolist() == [False]
    out, gap = _smooth(np.zeros(0, np.int8), np.zeros(0, np.int8), np.zeros(0, np.int64), NOWIN, None)
    assert out.size == 0 and gap.size == 0


def test_smooth_after_a_backward_is_optimizer_only_when_an_update_shows():
    roles = np.array([F, B, X, F, B, X, F, B, X, OP], dtype=np.int8)
    th = np.full(10, MAIN_THREAD, np.int8)
    t = np.arange(10) * 10
    out, gap = _smooth(roles, th, t, NOWIN, None)
    # the gaps at 20 and 50 reach a forward (no update): other; the one at 80 reaches an optimizer allocation
    assert out.tolist() == [F, B, X, F, B, X, F, B, OP, OP]
    assert gap.tolist() == [False, False, True, False, False, True, False, False, True, False]
    # an Optimizer.step# window starting between the gap and the next known allocation, both ends counted
    for win, expect in (([[25, 90]], [F, B, OP, F, B, X, F, B, OP, OP]),
                        ([[20, 21], [50, 51]], [F, B, OP, F, B, OP, F, B, OP, OP]),
                        ([[30, 31]], [F, B, OP, F, B, X, F, B, OP, OP]),
                        ([[19, 31], [31, 49], [61, 90]], [F, B, X, F, B, X, F, B, OP, OP])):
        out, gap2 = _smooth(roles, th, t, np.array(win, np.int64), None)
        assert out.tolist() == expect and gap2.tolist() == gap.tolist()
    # step markers likewise (only integer times count)
    out, _ = _smooth(roles, th, t, NOWIN, [{"time_us": 55}, {"time_us": "25"}, {"step": 3}])
    assert out.tolist() == [F, B, X, F, B, OP, F, B, OP, OP]
    out, _ = _smooth(roles, th, t, NOWIN, [{"time_us": 19}, {"time_us": 30}])
    assert out.tolist() == [F, B, OP, F, B, X, F, B, OP, OP]


def test_smooth_gap_edges():
    th = M4[:3]
    # the next known allocation is the last one
    out, gap = _smooth(np.array([B, X, OP], np.int8), th, np.array([10, 20, 30]), NOWIN, None)
    assert out.tolist() == [B, OP, OP] and gap.tolist() == [False, True, False]
    out, _ = _smooth(np.array([B, X, F], np.int8), th, np.array([10, 20, 30]), np.array([[25, 26]]), None)
    assert out.tolist() == [B, OP, F]
    # no known allocation after the gap: any update after it counts
    out, gap = _smooth(np.array([B, X], np.int8), th[:2], np.array([10, 20]), np.array([[30, 40]]), None)
    assert out.tolist() == [B, OP] and gap.tolist() == [False, True]
    out, _ = _smooth(np.array([B, X], np.int8), th[:2], np.array([10, 20]), NOWIN, None)
    assert out.tolist() == [B, X]
    out, _ = _smooth(np.array([B, X], np.int8), th[:2], np.array([0, 0]), NOWIN, None)
    assert out.tolist() == [B, X]
    # engine-thread and native (no Python) allocations after a backward are part of it
    out, gap = _smooth(np.array([B, X, X, X], np.int8), np.array([MAIN_THREAD, ENGINE_THREAD, NO_PYTHON, PYTHON_THREAD],
                                                                   np.int8), np.arange(4), NOWIN, None)
    assert out.tolist() == [B, B, B, X] and gap.tolist() == [False, False, False, True]


# ------------------------------------------------------------------------------------------- _optimizer_starts


def test_optimizer_starts():
    t = np.array([0, 10, 20, 30, 40, 50, 60, 70])
    phase = np.array([F, B, OP, F, F, B, OP, S], np.int8)
    # a window with a closure inside (forward, forward, backward: the last of them), one without, one before all
    win = np.array([[15, 55], [65, 70], [-5, -1]])
    out = _optimizer_starts(t, phase, win)
    assert out.tolist() == [5, 6, -1] and out.dtype == np.int64
    # the window's end is inclusive: a backward at exactly the end is the closure's
    assert _optimizer_starts(t, phase, np.array([[15, 50]])).tolist() == [5]
    assert _optimizer_starts(t, phase, np.array([[15, 49]])).tolist() == [4]
    assert _optimizer_starts(t, phase, np.array([[60, 70]])).tolist() == [5]
    assert _optimizer_starts(np.array([7]), np.array([OP], np.int8), np.array([[8, 9]])).tolist() == [0]
    assert _optimizer_starts(np.zeros(0, np.int64), np.zeros(0, np.int8), np.array([[5, 10]])).tolist() == []
    assert _optimizer_starts(t, phase, np.zeros((0, 2), np.int64)).tolist() == []


# ---------------------------------------------------------------------------------------------------- _passes


def test_passes_runs_and_repeated_entries():
    allocs = np.arange(10) * 2 + 1
    stack = np.full(21, -1, np.int32)
    smoothed = np.array([S, F, X, F, F, B, OP, E, E, E], np.int8)
    model = np.array([False, True, False, True, True, False, False, True, False, True])
    ids = [9, 1, 9, 1, 2, 9, 9, 3, 9, 4]  # the entry of run 1 repeats (stack 1); run 2's entries differ (3, 4)
    stack[allocs] = ids
    smoothed[2] = F
    assert _passes(allocs, model, smoothed, stack).tolist() == [3, 7, 15]
    ids[9] = 3  # now run 2's entry repeats too
    stack[allocs] = ids
    assert _passes(allocs, model, smoothed, stack).tolist() == [3, 7, 15, 19]
    # an entry of run 1's stack inside run 2 (whose own entry differs) is run 2's business: no pass
    ids[9] = 1
    stack[allocs] = ids
    assert _passes(allocs, model, smoothed, stack).tolist() == [3, 7, 15]
    assert _passes(np.array([4]), np.array([True]), np.array([F], np.int8), stack).tolist() == [4]
    # generation runs are passes; a first allocation has nothing before it: never an entry
    g = np.array([G, G, G], np.int8)
    assert _passes(np.array([0, 1, 2]), np.array([True, False, True]), g, np.array([5, 6, 5])).tolist() == [0]
    assert _passes(np.array([0, 1, 2]), np.array([False] * 3), np.array([S, OP, B], np.int8),
                   np.array([5, 6, 5])).tolist() == []
    assert _passes(np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0, np.int8), np.zeros(0, np.int32)).size == 0


def test_passes_the_first_entry_of_a_run_is_no_repeat():
    # an evaluation run: transfer, model, model, transfer, model, model: the entry (1) repeats at 4, one pass
    # begins at the run (0) and the next at the repeat (4)
    ev = np.array([E] * 6, np.int8)
    model = np.array([False, True, True, False, True, True])
    assert _passes(np.arange(6), model, ev, np.array([7, 1, 2, 7, 1, 2])).tolist() == [0, 4]


def test_passes_a_run_opening_with_model_code_began_inside_a_batch():
    # the trace begins inside a batch (model code at 0, its transfer unrecorded), then two whole batches
    # (transfer, model, model): the first entry (3) is the second batch's and begins it, as its repeat (6) does
    ev = np.array([E] * 8, np.int8)
    model = np.array([True, True, False, True, True, False, True, True])
    assert _passes(np.arange(8), model, ev, np.array([2, 3, 7, 1, 2, 7, 1, 2])).tolist() == [0, 3, 6]


# ------------------------------------------------------------------------------------------ _trailing_evaluation


def test_trailing_evaluation():
    sm = np.array([F, B, OP, X, F, F, S, F], np.int8)
    allocs = np.arange(8) * 10
    out = _trailing_evaluation(sm, allocs, np.array([0, 40, 70]))
    assert out.tolist() == [F, B, OP, X, E, E, S, E]
    assert sm.tolist() == [F, B, OP, X, F, F, S, F]  # not changed in place
    # one forward pass after the last update: the next step's
    assert _trailing_evaluation(sm, allocs, np.array([0, 40])).tolist() == sm.tolist()
    # a pass starting at the update's own allocation is not after it
    assert _trailing_evaluation(sm, allocs, np.array([20, 40])).tolist() == sm.tolist()
    assert _trailing_evaluation(sm, allocs, np.array([30, 40])).tolist() == [F, B, OP, X, E, E, S, E]
    sm2 = np.array([F, B, X, F, X, F], np.int8)
    assert _trailing_evaluation(sm2, np.arange(6), np.array([0, 3, 5])).tolist() == [F, B, X, E, X, E]
    # the allocation right after the update is the first of the tail
    assert _trailing_evaluation(np.array([F, B, F, F], np.int8), np.arange(4), np.array([0, 2, 3])).tolist() == [
        F, B, E, E]
    fwd = np.array([F, F, F], np.int8)
    assert _trailing_evaluation(fwd, np.arange(3), np.array([0, 1, 2])).tolist() == [F, F, F]


def test_a_pipeline_schedules_warm_up_forwards_are_not_evaluation():
    """1F1B on the first of two stages: F0 F1 B0 F2 B1 B2, update; two forwards ran before the step's first
    backward, so two forwards after the last update are the next step's warm-up (a stage that ran out in its
    second warm-up forward, issue 35), not evaluation; a third is. GPipe (every forward first) likewise."""
    sm = np.array([F, F, B, F, B, B, OP, F, F], np.int8)
    starts = np.array([0, 1, 3, 7, 8])
    assert _trailing_evaluation(sm, np.arange(9), starts).tolist() == sm.tolist()
    sm3 = np.append(sm, F).astype(np.int8)
    assert _trailing_evaluation(sm3, np.arange(10), np.append(starts, 9)).tolist() == [F, F, B, F, B, B, OP, E, E, E]
    # the warm-up depth is read between backwards too: a trace that begins mid-step (B, then a step of F F B)
    mid = np.array([B, OP, F, F, B, OP, F, F], np.int8)
    assert _trailing_evaluation(mid, np.arange(8), np.array([2, 3, 6, 7])).tolist() == mid.tolist()
    gpipe = np.array([F, F, F, F, B, B, B, B, OP, F, F, F, F], np.int8)
    assert _trailing_evaluation(gpipe, np.arange(13), np.array([0, 1, 2, 3, 9, 10, 11, 12])).tolist() == \
        gpipe.tolist()


# ------------------------------------------------------------------------------------------------------ _steps


def _trace_dt(times, meta=None, annotations=()):
    dt = _dt(times, annotations)
    return SimpleNamespace(meta=meta or {}), dt


def _eq(steps: Steps | None, starts, source, updates, first=0):
    assert steps is not None
    assert (steps.starts.tolist(), steps.source, steps.updates, steps.first) == (starts, source, updates, first)


def test_steps_from_markers():
    times = [10, 20, 30, 40, 50]
    none = np.zeros(0, np.int64)
    tr, dt = _trace_dt(times, {"step_markers": [{"step": 3, "time_us": 25}, {"step": 2, "time_us": 15},
                                                {"step": 4, "time_us": 60}]})
    _eq(_steps(tr, dt, none, none), [1, 2], "markers", 2, 2)
    # markers at the first event (not an end inside the trace) and the last one (one), two at one event
    tr, dt = _trace_dt(times, {"step_markers": [{"step": 0, "time_us": 10}, {"step": 1, "time_us": 10},
                                                {"step": 2, "time_us": 50}]})
    _eq(_steps(tr, dt, none, none), [0, 4], "markers", 1, 1)
    tr, dt = _trace_dt(times, {"step_markers": [{"step": 0, "time_us": 4}, {"step": 1, "time_us": 9}]})
    _eq(_steps(tr, dt, none, none), [0], "markers", 0, 1)
    for number in (True, -1, "3", None):
        tr, dt = _trace_dt(times, {"step_markers": [{"step": number, "time_us": 35}]})
        _eq(_steps(tr, dt, none, none), [3], "markers", 1, 0)
    tr, dt = _trace_dt(times, {"step_markers": [{"time_us": 35}]})
    _eq(_steps(tr, dt, none, none), [3], "markers", 1, 0)
    # all after the trace, or beyond int64: the next evidence decides (none here)
    for marks in ([{"step": 1, "time_us": 51}], [{"step": 1, "time_us": 2 ** 70}],
                  [{"step": 0, "time_us": 35}, {"step": 1, "time_us": 2 ** 70}]):
        tr, dt = _trace_dt(times, {"step_markers": marks})
        assert _steps(tr, dt, none, none) is None
    tr, dt = _trace_dt([], {"step_markers": [{"step": 1, "time_us": 5}]})
    assert _steps(tr, dt, none, none) is None


def test_steps_from_annotations():
    times = [10, 20, 30, 40, 50]
    none = np.zeros(0, np.int64)
    prof = [("ProfilerStep#7", "START", 15), ("ProfilerStep#7", "END", 29), ("ProfilerStep#8", "START", 30),
            ("ProfilerStep#x", "START", 40), ("ProfilerStep#9", "START", 55), ("ProfilerStep#6", "START", 5)]
    _eq(_steps(*_trace_dt(times, annotations=prof), none, none), [0, 1, 2], "annotations", 3)
    two = [("ProfilerStep#7", "START", 20), ("ProfilerStep#8", "START", 41)]
    _eq(_steps(*_trace_dt(times, annotations=two), none, none), [1, 4], "annotations", 1)
    # one ProfilerStep is no step boundary: the Optimizer.step# ENDs decide (after the event at their time)
    opt = [("ProfilerStep#7", "START", 15), (STEP, "START", 18), (STEP, "END", 20), (STEP, "END", 45),
           ("Optimizer.zero_grad#SGD.zero_grad", "END", 31), (STEP, "END", 50)]
    _eq(_steps(*_trace_dt(times, annotations=opt), none, none), [0, 2, 4], "annotations", 3)
    _eq(_steps(*_trace_dt(times, annotations=[(STEP, "END", 5)]), none, none), [0], "annotations", 1)
    # step markers come first
    tr, dt = _trace_dt(times, {"step_markers": [{"step": 0, "time_us": 30}]}, annotations=opt)
    _eq(_steps(tr, dt, none, none), [2], "markers", 1, 0)
    tr, dt = _trace_dt([], annotations=opt)
    assert _steps(tr, dt, none, none) is None


def test_steps_from_optimizer_runs():
    tr, dt = _trace_dt(list(range(0, 200, 10)), annotations=[(STEP, "START", 5)])  # no END: no step from it
    allocs = np.array([1, 3, 5, 7, 9, 11, 13])
    _eq(_steps(tr, dt, allocs, np.array([F, B, OP, OP, F, OP, F], np.int8)), [0, 9, 13], "optimizer frames", 2)
    _eq(_steps(tr, dt, allocs, np.array([OP, F, B, F, B, OP, OP], np.int8)), [0, 3], "optimizer frames", 2)
    _eq(_steps(tr, dt, allocs[:1], np.array([OP], np.int8)), [0], "optimizer frames", 1)
    assert _steps(tr, dt, allocs, np.array([F, B, F, B, S, E, X], np.int8)) is None
    assert _steps(tr, dt, np.zeros(0, np.int64), np.zeros(0, np.int8)) is None


# ---------------------------------------------------------------------------------------------- find_phases

SETUP_FR = frames((MODULE, 965, "_apply"), ROOT)
INPUT = frames(("/w/train.py", 25, "main"), ROOT)
MODEL = frames(("/w/model.py", 3, "forward"), (MODULE, 1790, "_call_impl"), ROOT)
MODEL2 = frames(("/w/model.py", 4, "forward"), (MODULE, 1790, "_call_impl"), ROOT)
ENGINE: list[dict] = []  # the autograd engine's thread: no Python frame
BWD_PY = frames((f"{TORCH}/_tensor.py", 626, "backward"), ROOT)
OPT = frames((f"{TORCH}/optim/adam.py", 178, "_init_group"), (f"{TORCH}/optim/optimizer.py", 533, "wrapper"), ROOT)
EVAL = frames(("/w/model.py", 3, "forward"), (MODULE, 1790, "_call_impl"), ("/w/train.py", 60, "evaluate"), ROOT)
GEN = frames(("/w/model.py", 3, "forward"), (f"{TF}/generation/utils.py", 2000, "generate"), ROOT)
COMPILED = frames(("/tmp/torchinductor_me/ab/cab.py", 10, "call"), ROOT)


class Job:
    def __init__(self) -> None:
        self.b = SnapBuilder()
        self.seg = self.b.segment(1024 * MiB)  # event 0
        self.off = 0

    def alloc(self, fr: list[dict]) -> int:
        a = self.b.alloc(self.seg, self.off, MiB, fr=fr)
        self.off += MiB
        return a

    @property
    def next_t(self) -> int:
        return self.b.t

    @property
    def last_t(self) -> int:
        return self.b.events[-1]["time_us"]

    def scope(self, name: str, stage: str, t: int) -> None:
        self.b.annotations.append({"name": name, "stage": stage, "device": 0, "time_us": t})

    def phases(self, tmp_path, **meta) -> Phases:
        t = load(self.b.write(tmp_path / "rank0.pickle"))
        t.meta.update(meta)
        return find_phases(t, t.primary)


def _check(ph: Phases, phase, source, after_backward=None):
    assert ph.phase.tolist() == phase and ph.phase.dtype == np.int8
    assert ph.source.tolist() == source and ph.source.dtype == np.int8
    assert ph.after_backward.tolist() == (after_backward or [False] * len(phase))


def test_find_phases_closure_inside_an_optimizer_step(tmp_path):
    j = Job()
    j.alloc(SETUP_FR)       # 1
    j.alloc(INPUT)          # 2 unknown: continues setup
    j.alloc(MODEL)          # 3
    j.alloc(MODEL2)         # 4
    j.alloc(ENGINE)         # 5 backward (engine thread)
    j.alloc(BWD_PY)         # 6 backward (frames)
    j.alloc(INPUT)          # 7 after the backward, the step starts before the next forward: optimizer
    j.scope(STEP, "START", j.last_t + 5)
    j.alloc(INPUT)          # 8 inside the step
    j.alloc(MODEL)          # 9 the closure's forward
    j.alloc(ENGINE)         # 10 and backward
    j.alloc(OPT)            # 11
    j.scope(STEP, "END", j.last_t + 5)
    j.alloc(INPUT)          # 12 continues the optimizer
    ph = j.phases(tmp_path)
    _check(ph, [S, S, S, F, F, B, B, OP, OP, F, B, OP, OP],
           [INFERRED, FRAMES, INFERRED, FRAMES, FRAMES, THREAD, FRAMES, INFERRED, ANNOTATIONS, FRAMES, THREAD,
            ANNOTATIONS, INFERRED], [False] * 7 + [True] + [False] * 5)
    assert ph.pass_starts.tolist() == [3, 9]
    assert ph.optimizer_starts.tolist() == [10] and ph.optimizer_starts.dtype == np.int64
    # the END falls after event 11: a step from 0 and one from 12, where only the optimizer ran: dropped
    _eq(ph.steps, [0], "annotations", 1)
    assert ph.kind == "one optimizer step"
    assert (ph.stacks_recorded, ph.python_stacks, ph.has_backward, ph.compiled) == (True, True, True, False)
    assert ph.stacks_recorded is True and ph.compiled is False


def test_find_phases_windows_at_their_exact_start_and_end(tmp_path):
    j = Job()
    x = j.alloc(SETUP_FR)   # 1
    j.scope(ZERO, "START", j.next_t)
    j.b.free(x)             # 2 free_requested (at the START), 3 free_completed (at the END)
    j.scope(ZERO, "END", j.last_t)
    j.alloc(INPUT)          # 4
    j.alloc(MODEL)          # 5
    j.alloc(ENGINE)         # 6
    j.scope(STEP, "START", j.next_t)
    j.alloc(INPUT)          # 7 at the step's START
    j.alloc(MODEL)          # 8 closure
    j.alloc(ENGINE)         # 9
    j.alloc(INPUT)          # 10 at the step's END
    j.scope(STEP, "END", j.last_t)
    j.alloc(INPUT)          # 11
    ph = j.phases(tmp_path)
    _check(ph, [S, S, OP, OP, S, F, B, OP, F, B, OP, OP],
           [INFERRED, FRAMES, ANNOTATIONS, ANNOTATIONS, INFERRED, FRAMES, THREAD, ANNOTATIONS, FRAMES, THREAD,
            ANNOTATIONS, INFERRED])
    assert ph.pass_starts.tolist() == [5, 8]
    assert ph.optimizer_starts.tolist() == [9]
    _eq(ph.steps, [0], "annotations", 1)
    assert ph.phase_name(3) == "optimizer" and ph.source_name(2) == "annotations"


def test_find_phases_gap_after_backward_and_step_markers(tmp_path):
    j = Job()
    j.alloc(MODEL)          # 1
    j.alloc(ENGINE)         # 2
    j.alloc(INPUT)          # 3 a step marker follows before the next forward: optimizer
    mark = j.b.t - 5
    j.alloc(MODEL)          # 4
    j.alloc(ENGINE)         # 5
    j.alloc(INPUT)          # 6 no update before the next forward: other
    j.alloc(MODEL)          # 7
    ph = j.phases(tmp_path, step_markers=[{"step": 7, "time_us": mark}])
    _check(ph, [S, F, B, OP, F, B, X, F], [INFERRED, FRAMES, THREAD, INFERRED, FRAMES, THREAD, INFERRED, FRAMES],
           [False, False, False, True, False, False, True, False])
    assert ph.pass_starts.tolist() == [1, 4, 7]
    _eq(ph.steps, [4], "markers", 1, 7)
    assert ph.kind == "one optimizer step"
    # without the marker both gaps are other, and the trace is forward and backward
    ph = j.phases(tmp_path)
    assert ph.phase.tolist() == [S, F, B, X, F, B, X, F] and ph.steps is None
    assert ph.kind == "forward and backward, no torch.optim step"


def test_find_phases_phase_markers(tmp_path):
    j = Job()
    j.alloc(MODEL)          # 1
    mark = j.b.t
    j.alloc(MODEL)          # 2 marked evaluation
    j.alloc(SETUP_FR)       # 3 keeps setup
    ph = j.phases(tmp_path, phase_markers=[{"phase": "evaluation", "time_us": mark}])
    _check(ph, [S, F, E, S], [INFERRED, FRAMES, MARKERS, FRAMES])
    assert ph.kind == "evaluation only"


def test_find_phases_native_stacks_only(tmp_path):
    j = Job()
    j.alloc(frames(("??", 0, "torch::autograd::Engine::thread_main(std::shared_ptr<GraphTask>)")))
    j.alloc(frames(("??", 0, "at::native::empty_cuda")))  # no Python anywhere: part of the backward
    ph = j.phases(tmp_path)
    _check(ph, [S, B, B], [INFERRED, FRAMES, INFERRED])
    assert (ph.stacks_recorded, ph.python_stacks) == (True, False)
    assert ph.kind == "forward and backward, no torch.optim step"


def test_find_phases_no_stacks(tmp_path):
    j = Job()
    j.alloc(ENGINE)
    j.alloc(ENGINE)
    ph = j.phases(tmp_path)
    _check(ph, [S, S, S], [INFERRED] * 3)
    assert ph.stacks_recorded is False and ph.python_stacks is False and ph.has_backward is False
    assert ph.kind == "no stacks recorded: phases unknown"
    j = Job()
    j.alloc(MODEL)
    j.alloc(ENGINE)
    ph = j.phases(tmp_path, recording={"stacks": "none"})
    assert ph.stacks_recorded is False and ph.python_stacks is False
    assert ph.kind == "no stacks recorded: phases unknown"
    ph = j.phases(tmp_path, recording={"stacks": "python"})
    assert ph.stacks_recorded is True and ph.python_stacks is True and ph.kind == "forward and backward, no " \
        "torch.optim step"


def test_find_phases_without_allocations(tmp_path):
    b = SnapBuilder()
    s = b.segment(20 * MiB)
    b.free_segment(s)
    t = load(b.write(tmp_path / "rank0.pickle"))
    ph = find_phases(t, t.primary)
    _check(ph, [S, S], [INFERRED, INFERRED])
    assert ph.pass_starts.tolist() == [] and ph.steps is None and ph.optimizer_starts.tolist() == []
    assert ph.kind == "no stacks recorded: phases unknown" and ph.compiled is False


@pytest.mark.parametrize("allocs, kind, passes", [
    ([SETUP_FR, INPUT], "setup only", []),
    ([SETUP_FR, MODEL], "forward only", [2]),
    ([SETUP_FR, MODEL, INPUT, MODEL], "2 forward passes, no backward", [2, 4]),
    ([SETUP_FR, MODEL, INPUT, MODEL, INPUT, MODEL], "3 forward passes, no backward", [2, 4, 6]),
    ([SETUP_FR, EVAL], "evaluation only", [2]),
    ([SETUP_FR, GEN, EVAL], "generation (inference)", [2]),
    ([SETUP_FR, MODEL, BWD_PY], "forward and backward, no torch.optim step", [2]),
    ([MODEL, BWD_PY, OPT, MODEL, BWD_PY, OPT, MODEL], "2 optimizer steps", [1, 4, 7]),
])
def test_find_phases_kind(tmp_path, allocs, kind, passes):
    j = Job()
    for fr in allocs:
        j.alloc(fr)
    ph = j.phases(tmp_path)
    assert ph.kind == kind and ph.pass_starts.tolist() == passes
    assert ph.python_stacks is True and ph.stacks_recorded is True


def test_find_phases_source_of_events_after_the_first_allocation(tmp_path):
    j = Job()
    x = j.alloc(SETUP_FR)
    j.b.free(x)
    ph = j.phases(tmp_path)
    _check(ph, [S, S, S, S], [INFERRED, FRAMES, FRAMES, FRAMES])
    assert ph.kind == "setup only" and ph.has_backward is False


def test_find_phases_drops_a_last_step_of_teardown_only(tmp_path):
    j = Job()
    for _ in range(2):
        j.alloc(MODEL)
        j.alloc(BWD_PY)
        j.alloc(OPT)
    j.alloc(SETUP_FR)       # 7: after the last update only teardown (not model code)
    ph = j.phases(tmp_path)
    _eq(ph.steps, [0, 4], "optimizer frames", 2)
    assert ph.kind == "2 optimizer steps"
    # one step whose start follows all model code is kept (nothing before it to merge with)
    j = Job()
    j.alloc(MODEL)
    j.alloc(BWD_PY)
    mark = j.b.t
    j.alloc(SETUP_FR)
    ph = j.phases(tmp_path, step_markers=[{"step": 3, "time_us": mark}])
    _eq(ph.steps, [3], "markers", 1, 3)
    assert ph.kind == "one optimizer step"


def test_a_last_update_no_marker_follows_is_counted(tmp_path):
    """Issue 52: preflight's own snapshot read "one optimizer step" and "2 steps (markers)": its markers start each
    step (step 0 at the trace's first event, step 1 after the first update) and none follows the last update, which
    the trace shows (the optimizer's allocations). The updates are the steps whose optimizer work the trace shows,
    where that is more than the markers count; a last step that ends in an OOM has not updated."""
    j = Job()
    marks = []
    for step in (0, 1):
        marks.append({"step": step, "time_us": j.b.events[-1]["time_us"] if step == 0 else j.b.t})
        j.alloc(MODEL)
        j.alloc(BWD_PY)
        j.alloc(OPT)
    ph = j.phases(tmp_path, step_markers=marks)
    _eq(ph.steps, [0, 4], "markers", 2, 0)
    assert ph.kind == "2 optimizer steps"
    # the same job out of memory in its last optimizer step: one update
    j.b.oom(MiB, device_free=0)
    ph = j.phases(tmp_path, step_markers=marks)
    _eq(ph.steps, [0, 4], "markers", 1, 0)
    assert ph.kind == "one optimizer step"
    # oomdoctor run's markers: one after each update too; the optimizer's work after the last one, with no pass
    # before it (a Trainer's teardown), is no third update (the corpus's Trainer runs: 4 steps, not 5)
    j = Job()
    marks = [{"step": 0, "time_us": j.b.events[-1]["time_us"]}]
    for step in (1, 2):
        j.alloc(MODEL)
        j.alloc(BWD_PY)
        j.alloc(OPT)
        marks.append({"step": step, "time_us": j.b.t})
    j.alloc(OPT)
    j.alloc(OPT)
    ph = j.phases(tmp_path, step_markers=marks)
    assert ph.steps.updates == 2 and ph.kind == "2 optimizer steps"


def test_find_phases_dropping_the_teardown_step_keeps_the_step_numbers(tmp_path):
    j = Job()
    marks = []
    for step in (5, 6):
        marks.append({"step": step, "time_us": j.b.t})
        j.alloc(MODEL)
        j.alloc(BWD_PY)
        j.alloc(OPT)
    marks.append({"step": 7, "time_us": j.b.t})
    j.alloc(SETUP_FR)
    ph = j.phases(tmp_path, step_markers=marks)
    _eq(ph.steps, [1, 4], "markers", 3, 5)


@pytest.mark.parametrize("fr, context, compiled", [
    (MODEL, None, False),
    (COMPILED, None, True),
    (MODEL, "torch/compile 0/0", True),
])
def test_find_phases_compiled(tmp_path, fr, context, compiled):
    j = Job()
    j.alloc(fr)
    if context:
        j.b.events[-1]["compile_context"] = context
    assert j.phases(tmp_path).compiled is compiled


def test_annotations_named_is_the_prefix_filter_in_record_order(snapshots):
    """The names index gives what one test per record gives, for the prefixes the analyses ask, on a real trace
    with thousands of records; a record appended later is seen."""
    from oomdoctor import load
    from oomdoctor.analysis.phases import OPTIMIZER_STEP, OPTIMIZER_ZERO_GRAD, annotations_named
    from oomdoctor.trace.model import Annotation

    dt = load(snapshots / "fsdp2-gpt2" / "rank0.pickle").primary
    assert len(dt.annotations) > 1000
    for prefix in ("nccl:", "ProfilerStep#", OPTIMIZER_STEP, OPTIMIZER_ZERO_GRAD, ("nccl:", "FSDP::"), "", "zzz"):
        want = [a for a in dt.annotations if a.name.startswith(prefix)]
        got = annotations_named(dt, prefix)
        assert got == want and all(g is w for g, w in zip(got, want)), prefix
    assert annotations_named(dt, "nccl:") and annotations_named(dt, OPTIMIZER_STEP)
    dt.annotations.append(Annotation("nccl:late", "START", 1))
    assert annotations_named(dt, "nccl:late") == [dt.annotations[-1]]
