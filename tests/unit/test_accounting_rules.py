"""Memory accounting (``analysis/accounting.py``), pinned rule by rule.

- The pure helpers, on small arrays: ``_runs`` (first and last event of each run of equal phase),
  ``_grown`` (a cache concatenated by hand: one stack's kept blocks from at least three passes, sizes that
  never shrink and do grow), ``_lazy_workspaces`` (a block never freed that an op made on its first call,
  of a size none of that stack's other blocks has, beside freed blocks of a later pass), ``_recurs_after``
  (its stack allocated again later in the same pass), ``_row_ids`` (dense lexicographic ids, exact in 64-bit
  integers), ``_stacks_with`` (a frame named exactly, or containing a name).
- ``_apply_facts``: which recorded storages land on which blocks (the event a note belongs to, a dump noted
  after the last event, the trace's time bounds, pointers inside a block only, later kinds winning), and how
  many records it applied; ``breakdown``: each category's requested bytes, the rounding apart, the counts and
  whether most bytes of a category came from recorded facts.
- ``account`` (with ``_forward``), each rule of the module doc on a hand-made trace: the stack table holds
  the frames PyTorch records (``Module._apply`` at setup, ``torch/optim`` in the step, none on the autograd
  engine's thread, ``distributed_c10d`` for a collective), and the lifetimes and phases are laid out by hand so
  that each block sits on one side of a boundary (freed when the last pass begins or before, alive at the
  torch optimizer's step or freed by it, born before the trace, ...). Every expected category is the one the
  rule names for the block placed.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from builder import stack_table

from oomdoctor.analysis.accounting import (
    ACTIVATIONS,
    CATEGORIES,
    GRADIENTS,
    OPTIMIZER_STATE,
    PARAMETERS,
    RECORDED,
    TEMPORARIES,
    TRACE,
    UNKNOWN,
    UNKNOWN_WHY,
    Accounting,
    _apply_facts,
    _grown,
    _lazy_workspaces,
    _recurs_after,
    _row_ids,
    _runs,
    _stacks_with,
    account,
    breakdown,
)
from oomdoctor.analysis.lifetimes import ALLOCATED_AT_START, IN_TRACE, Lifetimes
from oomdoctor.analysis.phases import (
    ANNOTATIONS,
    BACKWARD_PHASE,
    EVALUATION_PHASE,
    FORWARD_PHASE,
    FRAMES,
    GENERATION_PHASE,
    INFERRED,
    MARKERS,
    OPTIMIZER_PHASE,
    OTHER_PHASE,
    SETUP_PHASE,
    THREAD,
    Phases,
)

A = np.array


def bools(s: str) -> np.ndarray:
    return np.array([c == "1" for c in s], dtype=bool)


# --------------------------------------------------------------------------- _runs

def test_runs_give_each_event_the_first_and_last_event_of_its_run():
    phase = A([0, 0, 1, 1, 1, 2, 0])
    starts, ends = _runs(phase)
    assert starts.tolist() == [0, 0, 2, 2, 2, 5, 6]
    assert ends.tolist() == [1, 1, 4, 4, 4, 5, 6]
    s, e = _runs(A([3]))
    assert s.tolist() == [0] and e.tolist() == [0]


# --------------------------------------------------------------------------- _grown

@pytest.mark.parametrize("sizes, passes, want", [
    ([10, 20, 30], [0, 1, 2], True),  # three passes, growing
    ([10, 10, 20], [0, 1, 2], True),  # never shrinks (equal is fine), does grow
    ([10, 20, 20], [0, 1, 2], True),  # grew, then stayed
    ([10, 10, 10, 20], [0, 1, 2, 3], True),
    ([10, 10, 10], [0, 1, 2], False),  # never grows
    ([10, 5, 20], [0, 1, 2], False),  # shrinks once
    ([10, 20, 30], [0, 1, 1], False),  # two passes only
    ([10, 20], [0, 1], False),  # two blocks only
])
def test_grown_wants_three_passes_of_sizes_that_never_shrink_and_do_grow(sizes, passes, want):
    n = len(sizes)
    got = _grown(np.ones(n, bool), np.zeros(n, np.int64), A(passes), A(sizes))
    assert got.tolist() == [want] * n


def test_grown_judges_each_stack_alone_and_only_the_rows_given():
    # stack 0: two blocks only (skipped); stack 1: grows over three passes; stack 2: shrinks
    stack = A([1, 0, 1, 2, 0, 1, 2, 2, 1])
    bpass = A([0, 0, 1, 0, 1, 2, 1, 2, 3])
    req = A([10, 5, 20, 30, 6, 30, 20, 10, 999])
    rows = bools("111111110")  # the last row (stack 1, pass 3) is not a candidate
    assert _grown(rows, stack, bpass, req).tolist() == [True, False, True, False, False, True, False, False, False]
    # rows given out of pass order: sorted by pass before the sizes are compared
    assert _grown(np.ones(3, bool), A([4, 4, 4]), A([2, 0, 1]), A([30, 10, 20])).tolist() == [True] * 3
    assert not _grown(np.zeros(3, bool), A([4, 4, 4]), A([2, 0, 1]), A([30, 10, 20])).any()


# --------------------------------------------------------------------------- _lazy_workspaces

def test_lazy_workspace_is_the_first_pass_block_of_a_size_its_stack_never_makes_again():
    # stack 0: its first pass (0) makes a 100-byte block never freed beside a freed 50-byte output; the next
    # pass frees another 50; a 70-byte block of pass 0 was freed (not a candidate)
    stack = A([0, 0, 0, 0])
    bpass = A([0, 0, 1, 0])
    req = A([100, 50, 50, 70])
    persistent = bools("1000")
    assert _lazy_workspaces(bools("1000"), stack, persistent, req, bpass).tolist() == [True, False, False, False]
    # the same, but the never-freed block's size repeats in its stack: a kept output, not a workspace
    assert not _lazy_workspaces(bools("1000"), stack, persistent, A([50, 50, 50, 70]), bpass).any()
    # a candidate of a later pass than the stack's first: re-allocated, not made once
    assert not _lazy_workspaces(bools("0010"), stack, bools("0010"), req, bpass).any()
    # nothing to look at
    assert not _lazy_workspaces(bools("0000"), stack, persistent, req, bpass).any()
    assert not _lazy_workspaces(bools("1000"), A([-1, -1, -1, -1]), persistent, req, bpass).any()


def test_lazy_workspace_needs_a_freed_block_of_its_stack_in_a_later_pass():
    # stack 1 (stack 0 is another site): the candidate of pass 0, 100 bytes
    stack = A([0, 1, 1])
    req = A([8, 100, 200])
    # the later block of pass 1 is never freed either: no freed block of a later pass
    assert not _lazy_workspaces(bools("010"), stack, bools("111"), req, A([0, 0, 1])).any()
    # the other block is freed, but in the same first pass: not later
    assert not _lazy_workspaces(bools("010"), stack, bools("110"), req, A([0, 0, 0])).any()
    # freed in a later pass: the candidate is the op's workspace
    assert _lazy_workspaces(bools("010"), stack, bools("110"), req, A([0, 0, 1])).tolist() == [False, True, False]
    # stack 0 runs first in pass 1; stack 1 in pass 0, freed in pass 1: each stack's own first pass counts
    assert _lazy_workspaces(bools("010"), stack, bools("010"), req, A([1, 0, 1])).tolist() == [False, True, False]
    # a block born before the trace (pass -1) counts as made in its stack's first pass
    assert _lazy_workspaces(bools("010"), stack, bools("010"), req, A([0, -1, 0])).tolist() == [False, True, False]


def test_lazy_workspaces_of_several_stacks_and_sizes():
    # stack 0: candidate 100 beside freed 50s of passes 0 and 1; stack 2: candidate 64 whose size a freed
    # block of pass 2 repeats; stack 3 (never freed) and a stack -1 freed row in a later pass
    stack = A([0, 0, 0, 2, 2, 2, 3, -1])
    bpass = A([0, 0, 1, 1, 1, 2, 0, 2])
    req = A([100, 50, 50, 64, 32, 64, 8, 100])
    persistent = bools("10010010")
    cand = bools("10010010")
    assert _lazy_workspaces(cand, stack, persistent, req, bpass).tolist() == [True] + [False] * 7


# --------------------------------------------------------------------------- _recurs_after

def test_recurs_after_needs_the_same_stack_again_later_in_the_same_pass():
    #            r0  r1  r2  r3  r4  r5  r6
    op = bools("1010110")
    fw = bools("0101001")
    b = A([10, 20, 30, 40, 0, 5, 50])
    bpass = A([0, 0, 1, 1, 2, 2, 0])
    stack = A([5, 5, 5, 6, 7, 8, 9])
    # r0: stack 5 again at r1 (pass 0, later): yes; r1 is no open row; r2: stack 5 in pass 1 only itself;
    # r4 (event 0) and r5: alone in their (pass, stack)
    assert _recurs_after(op, fw, b, bpass, stack).tolist() == [True, False, False, False, False, False, False]
    # the same stack in the next pass, or another stack later in the same pass, is no recurrence
    assert not _recurs_after(bools("10"), bools("01"), A([1, 2]), A([1, 2]), A([3, 3])).any()
    assert not _recurs_after(bools("10"), bools("01"), A([1, 2]), A([1, 1]), A([3, 4])).any()
    # an open row allocated again by another open row of its site
    assert _recurs_after(bools("11"), bools("00"), A([1, 2]), A([0, 0]), A([3, 3])).tolist() == [True, False]
    assert _recurs_after(bools("00"), bools("00"), A([1, 2]), A([0, 0]), A([3, 3])).tolist() == [False, False]
    # rows of the pass that are not open are never said to recur
    assert _recurs_after(bools("100"), bools("011"), A([1, 2, 3]), A([0, 0, 0]), A([3, 3, 3])).tolist() == [
        True, False, False]
    assert _recurs_after(np.zeros(0, bool), np.zeros(0, bool), A([], np.int64), A([], np.int64),
                         A([], np.int64)).tolist() == []


# --------------------------------------------------------------------------- _row_ids

def test_row_ids_stay_exact_where_offsets_would_overflow():
    # values near 2**62: the key is the offset from the column's minimum, never the value plus it
    c = A([(1 << 62) + 1, (1 << 62) - 1, (1 << 62) + 1])
    assert _row_ids(c).tolist() == [1, 0, 1]
    assert _row_ids(A([2, 2, 1]), c).tolist() == [2, 1, 0]


# --------------------------------------------------------------------------- _stacks_with

def _table(*stacks: tuple[str, ...]) -> SimpleNamespace:
    """A trace holding only a stack table: stack i has one frame per function name of ``stacks[i]``."""
    table, _ = stack_table(*([("/w/x.py", 1, name) for name in st] for st in stacks))
    return SimpleNamespace(stacks=table)


def test_stacks_with_names_exact_never_contained():
    tr = _table(("forward", "Block.__init__"), ("__init__", "main"), ("main",), ())
    rows = A([0, 1, 2, 3, -1, 1])
    got = _stacks_with(tr, rows, ("__init__",))
    assert got.dtype == bool and got.tolist() == [False, True, False, False, False, True]
    assert _stacks_with(tr, rows, ("nothing",)).tolist() == [False] * 6
    assert _stacks_with(tr, A([0]), ("init",)).tolist() == [False]
    # C++ frames: the qualified name without return type and arguments, compared exactly
    cpp = _table(("at::cuda::setWorkspaceForHandle(cublasContext*, c10::cuda::CUDAStream)",),
                 ("void at::cuda::setWorkspaceForHandleX(int)",), ("at::native::(anonymous namespace)::Workspace::"
                                                                   "Workspace(unsigned long)",))
    names = ("at::cuda::setWorkspaceForHandle", "at::native::(anonymous namespace)::Workspace::Workspace")
    assert _stacks_with(cpp, A([0, 1, 2]), names, cpp=True).tolist() == [True, False, True]
    assert _stacks_with(cpp, A([0, 1, 2]), names).tolist() == [False] * 3


# --------------------------------------------------------------------------- _apply_facts

class _Live:
    """Lifetimes stand-in: which rows are allocated after each event (``live[k]``, k = -1..n-1; past the
    last event, the last state, as :meth:`Lifetimes.allocated_mask` gives it)."""

    def __init__(self, addr: list[int], size: list[int], live: dict[int, str]) -> None:
        self.addr, self.size, self.live = A(addr, np.int64), A(size, np.int64), live
        self.last = max(live)

    def allocated_mask(self, k: int) -> np.ndarray:
        return bools(self.live[min(k, self.last)])


TIMES = [100, 200, 300, 400]
# rows: 0 at address 0 (always), 1 (always), 2 (after event 1 only), 3 (after event 2 only: freed at the last
# event), 4 (allocated at the last event), 5 (high address, always), 6 (after event 0 only), 7 (before the
# trace's first event only)
FACT_ADDR = [0, 1000, 2000, 3000, 4000, 1 << 60, 5000, 6000]
FACT_SIZE = [16, 100, 100, 100, 100, 256, 100, 100]
FACT_LIVE = {-1: "11000101", 0: "11000110", 1: "11100100", 2: "11010100", 3: "11001100"}


def facts(*records: dict, times=TIMES, lt=None) -> tuple[list[str], list[int]]:
    lt = lt or _Live(FACT_ADDR, FACT_SIZE, FACT_LIVE)
    trace = SimpleNamespace(meta={"tensors": list(records)})
    dt = SimpleNamespace(num_events=len(times), events={"time_us": A(times, np.int64)})
    cat = np.full(len(lt.addr), UNKNOWN, np.int8)
    src = np.full(len(lt.addr), TRACE, np.int8)
    assert _apply_facts(trace, dt, lt, cat, src) is None  # in place
    assert ((src == RECORDED) == (cat != UNKNOWN)).all()
    return [CATEGORIES[c] for c in cat], np.flatnonzero(src == RECORDED).tolist()


def rec(when: int, at: str = "step", **kinds) -> dict:
    return {"time_us": when, "at": at, **{k: [[p, 1] for p in v] for k, v in kinds.items()}}


@pytest.mark.parametrize("when, at, row", [
    (200, "step", 2),  # noted at an event's time: the state after that event
    (250, "step", 2),  # between events: after the last one before it
    (150, "step", 6),
    (100, "step", 6),  # the first event's own time
    (400, "step", 4),  # the last event's own time
    (500, "dump", 4),  # a dump noted after the snapshot was taken: its final state
    (250, "dump", 2),  # a dump noted inside the trace: like any other note
    (350, "dump", 3),
])
def test_a_note_lands_on_the_blocks_allocated_when_it_was_taken(when, at, row):
    cat, hit = facts(rec(when, at, gradients=[FACT_ADDR[row] + 8]))
    assert hit == [row] and cat[row] == "gradients"


@pytest.mark.parametrize("when, at", [(50, "step"), (99, "dump"), (401, "step"), (500, "step")])
def test_a_note_outside_the_trace_is_ignored(when, at):
    # before the first event (ring buffer) or after the last (addresses may have been reused), unless a dump
    cat, hit = facts(rec(when, at, parameters=[6000, 4000, 2000, 1000]))
    assert hit == [] and set(cat) == {"unknown"}


@pytest.mark.parametrize("ptr, rows", [
    (0, [0]), (15, [0]), (16, []), (50, []),  # row 0 is [0, 16)
    (1000, [1]), (1099, [1]), (1100, []), (1500, []), (999, []),  # row 1 is [1000, 1100)
    ((1 << 60) + 200, [5]), ((1 << 60) + 256, []), ((1 << 60) - 1, []),  # exact in 64-bit integers
    (-5, []), (1 << 63, []), (1 << 64, []),  # out of range: skipped
])
def test_a_pointer_marks_the_block_it_falls_in(ptr, rows):
    cat, hit = facts(rec(400, "step", optimizer_state=[ptr]))
    assert hit == rows and [i for i, c in enumerate(cat) if c == "optimizer_state"] == rows


def test_later_kinds_win_a_shared_block():
    cat, hit = facts(rec(400, "step", gradients=[4000, 1000], optimizer_state=[1010], parameters=[4050]))
    assert hit == [1, 4]
    assert cat == ["unknown", "optimizer_state", "unknown", "unknown", "parameters", "unknown", "unknown", "unknown"]
    # a record naming only gradients leaves the other blocks alone (no pointer 0 for the kinds it lacks)
    cat, hit = facts(rec(400, "step", gradients=[1000]))
    assert hit == [1] and cat[0] == "unknown"
    # pointers in and out of range in one record: those in range are still exact integers
    cat, hit = facts(rec(400, "step", gradients=[(1 << 60) + 200, -5, 1 << 63]))
    assert hit == [5]


def test_a_note_with_nothing_allocated_is_skipped_and_the_last_note_wins():
    lt = _Live([7000], [64], {-1: "0", 0: "0", 1: "1"})
    times = [100, 200]
    cat, hit = facts(rec(100, parameters=[7000]), rec(200, parameters=[7000]), rec(200, gradients=[7000]),
                     times=times, lt=lt)
    assert cat == ["gradients"] and hit == [0]  # the first note saw nothing allocated; the last one wins
    assert facts(rec(100, parameters=[7000]), times=times, lt=lt) == (["unknown"], [])  # nothing allocated then
    assert facts(times=times, lt=lt) == (["unknown"], [])  # no records
    one = _Live([7000], [64], {-1: "0", 0: "1"})
    assert facts(rec(100, parameters=[7000]), times=[100], lt=one) == (["parameters"], [0])
    assert facts(rec(100, parameters=[7000]), times=[], lt=one) == (["unknown"], [])


# --------------------------------------------------------------------------- breakdown

def test_breakdown_counts_requested_bytes_rounding_apart_and_the_source_of_most_bytes():
    #          params(rec) params  state(rec) state  grads(rec) grads  activ.  temp (freed)
    cat = A([PARAMETERS, PARAMETERS, OPTIMIZER_STATE, OPTIMIZER_STATE, GRADIENTS, GRADIENTS, ACTIVATIONS,
             TEMPORARIES], np.int8)
    src = A([RECORDED, TRACE, RECORDED, TRACE, RECORDED, TRACE, TRACE, RECORDED], np.int8)
    size = A([512, 512, 1024, 512, 200, 300, 2048, 4096])
    req = A([500, 512, 1000, 512, 200, 300, 3000, 4000])
    acc = Accounting(cat, src, np.zeros(8, np.int8), np.zeros(8, bool))
    lt = SimpleNamespace(allocated_mask=lambda k: bools("11111110") if k == 5 else bools("00000000"), size=size,
                         requested=req, alloc=A([0] * 8), start_state=np.full(8, IN_TRACE, np.int8), stack=A([0] * 8))
    ph = SimpleNamespace(step_of=lambda k: k + 2, phase_name=lambda k: "forward", source_name=lambda k: "frames")
    allocated = 512 + 512 + 1024 + 512 + 200 + 300 + 2048
    bd = breakdown(acc, lt, ph, 5, "peak_allocated", allocated)
    assert bd.unknown_why == {}
    assert bd.categories == {"parameters": 500 + 512, "gradients": 200 + 300, "optimizer_state": 1000 + 512,
                             "activations": 2048, "temporaries": 0, "communication": 0, "outputs": 0,
                             "kv_cache": 0, "workspaces": 0, "weight_copy": 0, "buffers": 0, "unknown": 0,
                             "rounding": 12 + 24}
    assert list(bd.categories) == list(CATEGORIES) + ["rounding"]
    # recorded bytes: half of the parameters' (not most), 2/3 of the state's, 2/5 of the gradients'
    assert bd.sources == {"parameters": "trace", "gradients": "trace", "optimizer_state": "recorded",
                          "activations": "trace"}
    assert bd.counts == {"parameters": 2, "gradients": 2, "optimizer_state": 2, "activations": 1}
    assert (bd.at, bd.event_index, bd.step, bd.phase, bd.phase_source, bd.allocated_bytes) == (
        "peak_allocated", 5, 7, "forward", "frames", allocated)
    assert all(type(v) is int for v in bd.categories.values())
    with pytest.raises(AssertionError):
        breakdown(acc, lt, ph, 5, "x", allocated + 1)


def test_breakdown_says_why_unknown_bytes_are_unknown():
    """Each unknown block's requested bytes (rounding apart) under why: born before the trace with no stack (the
    ring buffer dropped its allocation), born before it with a stack, born in the trace; they add up to the line."""
    cat = A([UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN, PARAMETERS], np.int8)
    acc = Accounting(cat, np.zeros(6, np.int8), np.zeros(6, np.int8), np.zeros(6, bool))
    lt = SimpleNamespace(allocated_mask=lambda k: bools("111110" if k == 3 else "000000"),
                         size=A([1024, 2048, 512, 4096, 512, 512]), requested=A([1000, 2048, 500, 4000, 512, 512]),
                         alloc=A([-1, 2, -1, 1, 0, 0]),  # the second: allocated at event 2, but alive at the start
                         start_state=np.array([ALLOCATED_AT_START, ALLOCATED_AT_START, ALLOCATED_AT_START, IN_TRACE,
                                               IN_TRACE, IN_TRACE], np.int8),
                         stack=A([-1, -1, 7, 3, -1, 0]))
    ph = SimpleNamespace(step_of=lambda k: None, phase_name=lambda k: "other", source_name=lambda k: "inferred")
    bd = breakdown(acc, lt, ph, 3, "x", 1024 + 2048 + 512 + 4096 + 512)
    assert bd.unknown_why == {"before_trace_no_stack": 1000 + 2048, "before_trace": 500, "in_trace": 4000 + 512}
    assert sum(bd.unknown_why.values()) == bd.categories["unknown"]
    assert list(bd.unknown_why) == [w for w in UNKNOWN_WHY if w in bd.unknown_why]
    bd = breakdown(acc, lt, ph, 0, "x", 0)  # nothing alive: no reason
    assert bd.unknown_why == {}


# --------------------------------------------------------------------------- account, on hand-laid traces

TORCH = "/venv/lib/python3.12/site-packages/torch"
TF = "/venv/lib/python3.12/site-packages/transformers"
MAIN = ("/w/train.py", 1, "<module>")
CALL = (f"{TORCH}/nn/modules/module.py", 1790, "_call_impl")
STACKS: dict[str, list[tuple[str, int, str]]] = {
    "setup": [(f"{TORCH}/nn/modules/module.py", 1370, "convert"), (f"{TORCH}/nn/modules/module.py", 965, "_apply"),
              MAIN],
    "init": [("/w/model.py", 3, "__init__"), MAIN],  # a constructor of the job's own module
    "model": [("/w/model.py", 20, "forward"), CALL, MAIN],
    "model2": [("/w/model.py", 21, "forward"), CALL, MAIN],
    "model3": [("/w/model.py", 23, "forward"), CALL, MAIN],
    "model4": [("/w/model.py", 24, "forward"), CALL, MAIN],
    "model5": [("/w/model.py", 25, "forward"), CALL, MAIN],
    "logits": [("/w/model.py", 40, "forward"), CALL, MAIN],
    "acc": [("/w/model.py", 41, "forward"), CALL, MAIN],
    "opt": [(f"{TORCH}/optim/adam.py", 178, "_init_group"), (f"{TORCH}/optim/optimizer.py", 533, "wrapper"), MAIN],
    "input": [("/w/train.py", 25, "<module>")],  # the main loop itself: no role
    "comm": [(f"{TORCH}/distributed/distributed_c10d.py", 2500, "all_reduce"), MAIN],
    "ddp": [(f"{TORCH}/nn/parallel/distributed.py", 1400, "_pre_forward"), CALL, MAIN],
    "ddp2": [(f"{TORCH}/nn/parallel/distributed.py", 1401, "_pre_forward"), CALL, MAIN],
    "input2": [("/w/train.py", 26, "<module>")],
    "engine": [],  # the autograd engine's thread: no Python frame
    "hook": [(f"{TORCH}/utils/hooks.py", 50, "hook")],  # a Python hook the engine called
    "bw_comm": [(f"{TORCH}/distributed/distributed_c10d.py", 2500, "all_reduce"), ("/w/hooks.py", 5, "allreduce_hook")],
    "post_backward": [(f"{TORCH}/distributed/fsdp/_fully_shard/_fsdp_state.py", 300, "post_backward")],
    "_post_backward_hook": [(f"{TORCH}/distributed/fsdp/_runtime_utils.py", 700, "_post_backward_hook")],
    "foreach_reduce": [(f"{TORCH}/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 400, "foreach_reduce")],
    "cache": [(f"{TF}/cache_utils.py", 500, "update"), ("/w/model.py", 30, "forward"), CALL, MAIN],
    "evalloop": [("/w/train.py", 60, "evaluate"), MAIN],
    "cublas": [("", 0, "at::cuda::getCUDABlasLtWorkspace()"), ("/w/model.py", 22, "forward"), CALL, MAIN],
    "fwd_opt": [(f"{TORCH}/nn/functional.py", 5000, "normalize"), (f"{TORCH}/optim/optimizer.py", 533, "wrapper"),
                MAIN],
    # one line of model code reached from a pipeline schedule's warm-up loop and from its steady loop
    "head_warmup": [("/w/model.py", 40, "forward"), CALL,
                    (f"{TORCH}/distributed/pipelining/schedules.py", 873, "_step_microbatches"), MAIN],
    "head_steady": [("/w/model.py", 40, "forward"), CALL,
                    (f"{TORCH}/distributed/pipelining/schedules.py", 931, "_step_microbatches"), MAIN],
}
PHASE = {"s": SETUP_PHASE, "f": FORWARD_PHASE, "b": BACKWARD_PHASE, "o": OPTIMIZER_PHASE, "e": EVALUATION_PHASE,
         "x": OTHER_PHASE, "g": GENERATION_PHASE}
SOURCE = {"m": MARKERS, "a": ANNOTATIONS, "t": THREAD, "f": FRAMES, "i": INFERRED}


def blk(stack: str | None, b: int, d: int = -1, req: int = 4096, fc: int | None = None,
        free_stack: str | None = None) -> dict:
    """A block of ``stack`` (None: none recorded) allocated at event ``b`` (-1: before the trace), freed at
    ``d`` (-1: never), its free completed at ``fc`` (default: with the request)."""
    return {"stack": stack, "b": b, "d": d, "fc": d if fc is None else fc, "req": req, "free_stack": free_stack}


def accounted(phases: str, blocks: list[dict], passes: list[int], opt_starts: list[int] | None = None,
              source: str | None = None, after_backward: str | None = None, python: bool = True,
              recorded: bool = True, free_stacks: bool | None = None, first: str | None = None,
              raw: bool = False):
    """Categories of ``blocks`` on a trace whose event k has phase ``phases[k]``, with forward passes starting
    at ``passes`` and torch optimizer steps beginning after the events ``opt_starts``."""
    order = ([first] if first else []) + [k for k in STACKS if k != first]
    table, interned = stack_table(*(STACKS[name] for name in order))
    ids = dict(zip(order, interned))
    rows = len(blocks)

    def col(key, f=lambda x: x):
        return np.array([f(x[key]) for x in blocks], dtype=np.int64)

    sid = col("stack", lambda s: ids[s] if s is not None else -1).astype(np.int32)
    b = col("b")
    d, fc = col("d"), col("fc")
    lt = Lifetimes(addr=np.arange(rows, dtype=np.int64) * 4096, requested=col("req"), size=col("req"),
                   stream=np.zeros(rows, np.int64), stack=sid, alloc=b, free_requested=d,
                   free_completed=fc, start_state=np.where(b < 0, ALLOCATED_AT_START, IN_TRACE).astype(np.int8),
                   size_exact=np.ones(rows, bool), unmatched_frees=0, ghost_blocks=0, truncated=False,
                   deferred=(d >= 0) & ((fc < 0) | (fc > d + 1)),  # no row pending at the start
                   free_stack=col("free_stack", lambda s: ids[s] if s is not None else -1).astype(np.int32))
    n = len(phases)
    ph = Phases(phase=np.array([PHASE[c] for c in phases], np.int8), pass_starts=np.array(passes, np.int64),
                steps=None, kind="", stacks_recorded=recorded, python_stacks=python, has_backward="b" in phases,
                source=np.array([SOURCE[c] for c in (source or "f" * n)], np.int8),
                optimizer_starts=None if opt_starts is None else np.array(opt_starts, np.int64),
                after_backward=None if after_backward is None else bools(after_backward))
    trace = SimpleNamespace(stacks=table, meta={})
    dt = SimpleNamespace(num_events=n)
    args = (trace, dt, lt, ph) if free_stacks is None else (trace, dt, lt, ph, free_stacks)
    acc = account(*args)
    assert acc.category.dtype == np.int8 and acc.source.dtype == np.int8 and acc.born_phase.dtype == np.int8
    assert (acc.source == TRACE).all()
    return acc if raw else [CATEGORIES[c] for c in acc.category]


def test_setup_blocks_that_live_through_the_training_passes_are_the_models_state():
    #        0123456789012
    trace = "ssssffbbofbbo"
    got = accounted(trace, [
        blk("setup", 0),  # made by Module._apply, never freed: a parameter
        blk("setup", 1, 9),  # freed when the last pass begins (teardown): still lived through the training
        blk("setup", 1, 8),  # freed before the last pass: a temporary of setup
        blk("init", 2, req=333),  # made in a constructor of the job's own code, no gradient of its size: unknown
        blk("init", 2, req=555),  # the same, and a gradient of its size (below): a parameter
        blk("opt", 2),  # optimizer code at setup
        blk("comm", 3),  # a collective's buffer
        blk("input", 3),  # anything else (a batch preloaded on the GPU): unknown, never a guess
        blk("setup", -1),  # born before the trace; its stack says Module._apply
        blk("setup", -1, 9),
        blk("model", 4, 6),  # an activation of each pass
        blk("model", 9, 11),
        blk("engine", 6, 8, req=555),  # made by the engine's thread, alive at the step: a gradient
        blk("engine", 10, 11, req=4096),  # freed inside its backward run: a temporary, no gradient
        *[blk("engine", 6, 8)] * 4,  # the gradients of the 4096-byte parameters (else frozen: weight_copy)
    ], passes=[4, 9], opt_starts=[7, 11], first="setup")
    assert got == ["parameters", "parameters", "temporaries", "unknown", "parameters", "optimizer_state",
                   "communication", "unknown", "parameters", "parameters", "activations", "activations", "gradients",
                   "temporaries"] + ["gradients"] * 4


def test_module_state_no_gradient_reaches_in_a_training_job_is_a_weight_copy():
    """A frozen teacher built before the student: its blocks of a size no gradient has (2000) and, of a size the
    student's gradients have (1000), those beyond one step's gradients of it, born nearest the former."""
    #        0123456789012
    trace = "ssssffbbofbbo"
    blocks = [
        blk("setup", 0, req=2000),  # the teacher's: no gradient of its size ever
        blk("setup", 1, req=1000),  # the teacher's, of the student's size: two such blocks, one gradient a step
        blk("setup", 3, req=1000),  # the student's
        blk("engine", 6, 8, req=1000),  # the student's gradient, alive at the step
        blk("engine", 10, 12, req=1000),
    ]
    got = accounted(trace, blocks, passes=[4, 9], opt_starts=[7, 11], first="setup")
    # issue 54: the teacher's block of a size no gradient has could as well be a registered buffer (a memory bank):
    # unknown, and why; its block of the student's size, beyond the gradients, copies every trained size: a copy
    assert got == ["unknown", "weight_copy", "parameters", "gradients", "gradients"]
    acc = accounted(trace, blocks, passes=[4, 9], opt_starts=[7, 11], first="setup", raw=True)
    assert [UNKNOWN_WHY[w] if w >= 0 else None for w in acc.why] == ["frozen_or_buffer", None, None, None, None]
    # a second block of the student's size beside a second gradient size: the extras no longer copy every trained
    # size (BatchNorm's statistics beside its weight): unknown, copy_or_buffer, never a weight copy
    two = blocks + [blk("setup", 3, req=3000), blk("engine", 6, 8, req=3000), blk("engine", 10, 12, req=3000)]
    acc = accounted(trace, two, passes=[4, 9], opt_starts=[7, 11], first="setup", raw=True)
    assert [CATEGORIES[c] for c in acc.category[:3]] == ["unknown", "unknown", "parameters"]
    assert [UNKNOWN_WHY[w] for w in acc.why[:2]] == ["frozen_or_buffer", "copy_or_buffer"]
    # no optimizer step (inference, evaluation): the model's state stays parameters
    assert accounted(trace, blocks, passes=[4, 9], opt_starts=[], first="setup")[:3] == ["parameters"] * 3
    # a collective in a backward (FSDP's reduce-scatter, DeepSpeed, DDP's buckets): gradients are not one per
    # parameter of its shape, and nothing is called frozen
    comm = blocks + [blk("bw_comm", 6, 7)]
    assert accounted(trace, comm, passes=[4, 9], opt_starts=[7, 11], first="setup")[:3] == ["parameters"] * 3
    # no parameter with a gradient of its size: none is frozen (the gradients say nothing of these blocks)
    assert accounted(trace, blocks[:2] + [blk("engine", 6, 8, req=777)], passes=[4, 9], opt_starts=[7, 11],
                     first="setup")[:2] == ["parameters"] * 2


def test_the_optimizers_input_its_state_and_its_temporaries():
    """Blocks born in the optimizer's work, against the torch optimizer steps beginning after events 6 and 13
    and the passes beginning at 1, 9 and 15."""
    #        01234567890123456
    trace = "fffbbooooffbbooff"
    src = "fffffafiiffffffff"  # the transfer at 7 and the allocation at 8 are placed by no evidence
    got = accounted(trace, [
        blk("opt", 5, 8),  # alive when the step began (after 6), freed after it, before the next pass: its input
        blk("opt", 6, 7),  # born at the event the step begins after: that step
        blk("opt", 5, 6),  # freed at the event the step begins after: not alive at it
        blk("opt", 5, 9),  # freed when the next pass begins: not before it; alive at the step: state
        blk("opt", 5),  # never freed: state
        blk("opt", 5, 10),  # freed inside the next pass: state
        blk("opt", 13, 14),  # the second step's input
        blk("opt", 14, 16),  # after the last step: freed before the next whole pass ended
        blk("opt", 14),
        blk("input", 5, 10),  # the step's annotation window places it: state
        blk("input", 7),  # nothing says optimizer: a temporary, kept or not
        blk("opt", 8),  # its own frames say optimizer
        blk("comm", 5, 10),  # a collective's buffer
        blk("fwd_opt", 7),  # optimizer frames around it
        blk("model", 1, 3),
    ], passes=[1, 9, 15], opt_starts=[6, 13], source=src)
    assert got == ["gradients", "gradients", "temporaries", "optimizer_state", "optimizer_state", "optimizer_state",
                   "gradients", "temporaries", "optimizer_state", "optimizer_state", "temporaries", "optimizer_state",
                   "communication", "optimizer_state", "activations"]


def test_without_a_torch_optimizer_step_state_is_what_outlives_the_next_whole_pass():
    #        0123456789
    trace = "sfbooofbof"
    got = accounted(trace, [
        blk("opt", 3, 8),  # the next pass (5) and the one after (8): freed when that one begins
        blk("opt", 3, 6),  # freed inside the next pass
        blk("opt", 3),
        blk("opt", 3, 4),
        blk("opt", -1, 3),  # born before the trace: freed before the first pass after the trace's first ended
        blk("model", 1, 2),
    ], passes=[1, 5, 8], opt_starts=None)
    assert got == ["optimizer_state", "temporaries", "optimizer_state", "temporaries", "temporaries", "activations"]
    assert accounted(trace, [blk("opt", 3, 8), blk("opt", 3, 6)], passes=[1, 5, 8], opt_starts=[]) == [
        "optimizer_state", "temporaries"]


def test_the_main_thread_between_a_backward_and_the_next_pass_keeps_a_hand_written_optimizers_state():
    #        0123456
    trace = "sfboofb"
    gap = "0001100"
    blocks = [blk("input", 3), blk("model", 3), blk("input", 4, 5), blk("model", 1, 2)]
    got = accounted(trace, blocks, passes=[1, 5], opt_starts=[], source="fffiiff", after_backward=gap)
    # kept for good, not model code: the update's state; model code there is not; freed at the next pass: a
    # temporary
    assert got == ["optimizer_state", "temporaries", "temporaries", "activations"]
    assert accounted(trace, blocks, passes=[1, 5], opt_starts=[], source="fffiiff")[0] == "temporaries"


def test_backward_blocks_are_gradients_when_alive_at_the_next_step_and_workspaces_when_kept_for_good():
    """Passes begin at 1, 8 and 13, backward runs are 3-5, 10-11 and 14-15, the torch optimizer steps begin
    after events 6, 11 and 15. The parameter is 1000 bytes: a gradient has its shape."""
    #        01234567890123456
    trace = "sffbbbooffbbofbbo"
    got = accounted(trace, [
        blk("setup", 0, req=1000),
        blk("engine", 3, 7, req=1000),  # alive when the step began: a gradient
        blk("engine", 3, 6, req=1000),  # freed at the event the step begins after (after its backward run)
        blk("engine", 3, req=777),  # kept for good, no parameter's shape: cuBLAS's workspace of the thread
        blk("engine", 3, req=1000),  # kept for good, a parameter's shape: a gradient
        blk("engine", 4, 13, req=777),  # freed when the last pass began (teardown): kept for good
        blk("engine", 4, 5, req=555),  # freed inside its backward: a temporary
        blk("bw_comm", 4, 5),  # a collective's, freed inside the backward
        blk("ddp", 2, 4),  # a collective's buffer in forward that the backward frees: saved for it
        blk("hook", 4, 7, req=1000),  # a hook the engine called
        blk("engine", 10, 12, req=1000),
        blk("engine", 14, 15, req=555),  # the last pass's own backward temporary
        blk("engine", 14, req=777),  # kept for good from the last backward run (the trace went on)
    ], passes=[1, 8, 13], opt_starts=[6, 11, 15])
    assert got == ["parameters", "gradients", "temporaries", "workspaces", "gradients", "workspaces", "temporaries",
                   "communication", "activations", "gradients", "gradients", "temporaries", "workspaces"]


def test_without_a_step_a_backward_block_is_a_gradient_when_it_outlives_its_backward_run():
    """The trace begins inside a backward (a ring buffer): runs 0-2, 4-5 and 7; passes begin at 3, 6, 8."""
    #        0123456789
    trace = "bbbfbbfbff"
    got = accounted(trace, [
        blk("engine", 0, 2, req=555),  # freed at the last event of its run
        blk("engine", 4, 6, req=555),  # freed after its run
        blk("engine", 4, 5, req=555),
        blk(None, -1, 0),  # born before the trace, freed by the backward at its first event: an activation
        blk(None, -1, 0, fc=3),  # the same, its free completed later: the request is what counts
        blk("model", 3, 4),
    ], passes=[3, 6, 8], opt_starts=None)
    assert got == ["temporaries", "gradients", "temporaries", "activations", "activations", "activations"]


def test_a_trace_ending_inside_a_backward_takes_the_fate_of_the_same_allocation_in_the_last_one():
    """Backward runs 2-4 and 7-8 (the end: an OOM); the torch optimizer step begins after event 4."""
    #        012345678
    trace = "sfbbbofbb"
    got = accounted(trace, [
        blk("engine", 2, req=777),  # kept for good: the engine thread's workspace (no open row to match)
        blk("engine", 2, 5, req=555),  # alive at the step: a gradient (rank 0 of its stack in the run)
        blk("engine", 3, 4, req=555),  # freed at the event the step begins after: a temporary (rank 1)
        blk("engine", 7, req=555),  # open, rank 0: as the gradient
        blk("engine", 8, req=555),  # open, rank 1: as the temporary
        blk("bw_comm", 3, 4),  # a collective's buffer
        blk("bw_comm", 7),  # open: as it
        blk("post_backward", 7, req=555),  # no earlier allocation: FSDP's post-backward makes gradients
        blk("_post_backward_hook", 8, req=555),
        blk("foreach_reduce", 8, req=555),
        blk("hook", 8, req=555),  # no earlier allocation, no post-backward: a temporary
        blk("setup", -1, 3),  # born before the trace by Module._apply, freed in the first backward
        blk("engine", -1, 3, req=555),  # born before the trace on the engine thread, freed in the backward
        blk("model", 1, 2),
        blk("model", 6, 7),
    ], passes=[1, 6], opt_starts=[4])
    assert got == ["workspaces", "gradients", "temporaries", "gradients", "temporaries", "communication",
                   "communication", "gradients", "gradients", "gradients", "temporaries", "temporaries",
                   "temporaries", "activations", "activations"]


def test_a_last_backward_of_one_event_is_still_the_open_one():
    #        0123456
    trace = "sfbbofb"
    got = accounted(trace, [
        blk("engine", 2, 3, req=555),  # freed at the event the step begins after: a temporary
        blk("engine", 6, req=555),  # open at the end, inside the backward: as that temporary
        blk("model", 5, 6),  # freed by the backward at the last event
        blk("model", 1, 2),
    ], passes=[1, 5], opt_starts=[3])
    assert got == ["temporaries", "temporaries", "activations", "activations"]


def test_a_trace_beginning_inside_a_backward_matches_the_runs_by_rank():
    #        0123456
    trace = "bboofbb"
    got = accounted(trace, [
        blk("engine", 0, 3, req=555),  # born at the trace's first event, alive at the step: a gradient
        blk("engine", 1, 2, req=555),  # freed at the event the step begins after
        blk("engine", 5, req=555),  # open: rank 0, as the gradient
        blk("model", 4, 5),
    ], passes=[4], opt_starts=[2])
    assert got == ["gradients", "temporaries", "gradients", "activations"]


def test_forward_blocks_by_what_frees_them_and_when():
    """Passes begin at 1, 7, 13 and 17 (the trace ends inside the last), backward runs 4-5, 10-11, 15."""
    #        0123456789012345678
    trace = "sfffbbofffbboffboff"
    got = accounted(trace, [
        blk("model", 1, 4),  # freed by the backward: saved for it
        blk("model", 2, 5, fc=-1),  # freed by the backward, its free still pending at the end
        blk("logits", 3, 8),  # still allocated when the next pass began, freed later: kept across batches
        blk("model2", 3, 7),  # freed at the first event of the next pass: not kept into it
        blk("acc", 2), blk("acc", 8), blk("acc", 14),  # one site, several passes, never freed: accumulation
        blk("model2", 9),  # one block of its site kept: a one-off cache
        blk("ddp2", 9),  # the same, a collective's buffer
        blk("ddp", 3, 9),  # a collective's buffer kept across passes in training (DDP's buckets)
        blk("comm", 8, 9),  # a collective's buffer freed inside its pass
        blk("model3", 2, 8, req=100), blk("model3", 8, 14, req=200), blk("model3", 14, 18, req=300),  # by hand
        blk("model4", 2, 3, req=100), blk("model4", 8, 9, req=200), blk("model4", 13, 14, req=300),
        blk("input2", 2, 8, req=100), blk("input2", 8, 14, req=200), blk("input2", 14, 18, req=300),  # prefetch
        blk("model5", 2, req=999), blk("model5", 2, 3, req=65), blk("model5", 8, 9, req=64),  # a lazy workspace
        blk("cache", 13, 15),  # transformers' Cache code in training, freed by the backward
    ], passes=[1, 7, 13, 17], opt_starts=[6, 12, 16])
    assert got == ["activations", "activations", "outputs", "temporaries", "outputs", "outputs", "outputs",
                   "temporaries", "communication", "communication", "communication",
                   "kv_cache", "kv_cache", "kv_cache", "temporaries", "temporaries", "temporaries",
                   "temporaries", "temporaries", "temporaries", "workspaces", "temporaries", "temporaries",
                   "activations"]


def test_inference_keeps_kv_caches_by_name_and_gathered_predictions_as_outputs():
    #        0123456789
    trace = "seeeeeeeee"  # an evaluation loop: passes at 1, 4 and 7, no backward
    got = accounted(trace, [
        blk("cache", 1, 2),  # transformers' Cache code
        blk("evalloop", 2, 9),  # the loop gathers predictions across batches
        blk("ddp", 2, 5),  # a collective's buffer kept across passes in evaluation: gathered, an output
        blk("model", 4, 5),
    ], passes=[1, 4, 7], opt_starts=None)
    assert got == ["kv_cache", "outputs", "outputs", "temporaries"]
    # an evaluation pass at the trace's first event, training after it: its gathered buffer is still an output
    #                 012345
    assert accounted("efbofb", [blk("ddp", 0, 4), blk("ddp", 1, 4), blk("model", 4, 5)], passes=[0, 1, 4],
                     opt_starts=[3]) == ["outputs", "communication", "activations"]
    # forward only, no backward: a cache by name is a KV cache; in training, only in evaluation or generation
    assert accounted("sfff", [blk("cache", 1, 2)], passes=[1]) == ["kv_cache"]
    #                 01234567
    assert accounted("sfbofeeg", [blk("cache", 1, 2), blk("cache", 5, 6), blk("cache", 7)],
                     passes=[1, 4, 5, 7]) == ["activations", "kv_cache", "kv_cache"]


def test_open_blocks_at_the_end_of_a_later_pass_take_the_fate_of_the_same_allocation_before():
    """Passes at 1 and 7, a backward at 5; the trace ends inside pass 1 (an OOM)."""
    #        012345678901
    trace = "sffffbofffff"
    got = accounted(trace, [
        blk("model", 1, 2),  # rank 0 of its site in pass 0: freed in the pass, a temporary
        blk("model", 2, 5),  # rank 1: an activation
        blk("logits", 3, 8),  # an output
        blk("model2", 4, 6),  # freed in the pass (not by the backward)
        blk("model", 7),  # open, rank 0 (its site allocates again after it): as the temporary
        blk("model", 8),  # open, rank 1: as the activation
        blk("logits", 9),
        blk("model2", 10, 11),  # rank 0 of model2 in pass 1, done
        blk("model2", 11),  # open, rank 1: no match; most of its site's blocks were temporaries
        blk("comm", 9),  # a collective's buffer
    ], passes=[1, 7], opt_starts=[5])
    assert got == ["temporaries", "activations", "outputs", "temporaries", "temporaries", "activations", "outputs",
                   "temporaries", "temporaries", "communication"]


def test_open_blocks_of_a_first_pass():
    #                 01234
    got = accounted("sffff", [
        blk("model", 1, 2),  # freed in the pass: a temporary
        blk("model", 2),  # open, its site allocates again later in the pass, keeping it: saved for backward
        blk("model", 3),  # open, the last of its site: what most of its site's blocks became
        blk("model2", 4),  # open, nothing to learn from: an activation
    ], passes=[1])
    assert got == ["temporaries", "activations", "temporaries", "activations"]
    # the trace went on into this pass's backward with the block still there: saved for it
    #                 012345
    got = accounted("sfffbb", [blk("model2", 2, 3), blk("model2", 3), blk("engine", 4, 5, req=555)], passes=[1])
    assert got == ["temporaries", "activations", "temporaries"]


def test_blocks_born_before_the_trace_by_pass_code_or_by_nothing_known():
    """Passes at 1, 5 and 8, backward at 3 and 6, the torch optimizer steps begin after events 3 and 6."""
    #        012345678
    trace = "sffbofbof"
    got = accounted(trace, [
        blk("setup", 0, req=1000),  # born at the first event, at setup: a parameter
        blk("setup", -1, req=1000),  # born before the trace by Module._apply: a parameter too
        blk("model", -1),  # model code, kept for good: an output
        blk("model", -1, 0),  # freed before the first pass: a temporary
        blk("model", -1, 1),  # freed when the first pass began: lived into it, an output
        blk("model", -1, 5),
        blk("model", -1, 4, req=1000),  # freed in the optimizer's work: still model code's output
        blk(None, -1, 2),  # no stack, freed inside the first pass: unknown
        blk(None, -1, 1),
        blk(None, -1, 0),  # freed before the first pass: a temporary
        blk(None, -1, 4, req=1000),  # a parameter's shape, freed in the optimizer's work: a gradient
        blk(None, -1, 4, req=555),
        blk(None, -1, req=1000),  # kept for good: parameter or optimizer state? unknown
        blk("engine", -1, 3),  # the engine's, freed in the backward before the step: a temporary
        blk("engine", -1, 4),  # freed after the step began: a gradient
        blk("input", -1, 5),  # no role: unknown
        blk("model", 1, 3),
    ], passes=[1, 5, 8], opt_starts=[3, 6])
    assert got == ["parameters", "parameters", "outputs", "temporaries", "outputs", "outputs", "outputs",
                   "unknown", "unknown", "temporaries", "gradients", "unknown", "unknown", "temporaries", "gradients",
                   "unknown", "activations"]


def test_the_first_pass_from_the_first_event_and_blocks_made_before_it():
    #        012345678
    trace = "fffbofbof"
    got = accounted(trace, [
        blk("model5", -1, req=999),  # made before the trace by the op that frees its 64 bytes every pass
        blk("model5", 1, 2, req=64),
        blk("opt", -1, 4),  # alive at the first step but it lived through pass 0 before it: state
        blk("model", 1, 3),
    ], passes=[0, 5, 8], opt_starts=[3, 6])
    assert got == ["workspaces", "temporaries", "optimizer_state", "activations"]
    #                 0123
    got = accounted("xfff", [
        blk("input", 0),  # the loop's, kept into the first pass and past it: a temporary (not model code)
        blk("model5", 0, req=999),  # made at the first event, before the first pass, beside a freed output
        blk("model5", 1, 2, req=64),
    ], passes=[1])
    assert got == ["temporaries", "workspaces", "temporaries"]
    # made before the trace beside a block freed before the first pass: no later pass freed one, no workspace;
    # and no block of its site is kept across passes in the trace: no output either, unknown
    assert accounted("xff", [blk("model5", -1, req=999), blk("model5", 0, 1, req=64)], passes=[1]) == [
        "unknown", "temporaries"]


def test_free_stacks_say_where_a_block_born_before_the_trace_was_freed():
    #        0123456789
    trace = "sffbbofbbo"
    blocks = [blk(None, -1, 6, free_stack="engine"), blk(None, -1, 6, free_stack="input"), blk("model", 1, 3)]
    # frees with their own stacks (context="all"): the engine thread freed it, in a backward: an activation
    assert accounted(trace, blocks, passes=[1, 6], opt_starts=[4, 8], free_stacks=True, first="engine") == [
        "activations", "unknown", "activations"]
    # frees carrying the allocation's stack (the default): the free's stack says nothing of where it was freed
    for free_stacks in (None, False):
        assert accounted(trace, blocks, passes=[1, 6], opt_starts=[4, 8], free_stacks=free_stacks) == [
            "unknown", "unknown", "activations"]


def test_library_workspaces_named_by_cpp_frames_and_a_snapshot_without_events():
    got = accounted("sfff", [blk("cublas", 1), blk("model", 2)], passes=[1])
    assert got == ["workspaces", "activations"]
    # no trace at all (a state-only snapshot): what the stacks say
    # (model code's block: no lifetime says output or activation, so unknown)
    got = accounted("", [blk("setup", -1), blk("hook", -1, req=555), blk("model", -1)], passes=[])
    assert got == ["parameters", "gradients", "unknown"]


def test_a_trace_beginning_inside_the_optimizers_work():
    """The torch optimizer step begins after the trace's first event; one pass at 2."""
    #        01234
    trace = "oofbo"
    got = accounted(trace, [
        blk("opt", 0, 1),  # alive at the step, freed before the next pass: the optimizer's input
        blk("input", 0),  # the step's annotation window places it, kept for good: state
        blk("input", 4),  # the same after the last step
        blk("opt", 4),
        blk("input", 1),  # nothing says optimizer
        blk("model", 2, 3),
    ], passes=[2], opt_starts=[0], source="aifia")
    assert got == ["gradients", "optimizer_state", "optimizer_state", "optimizer_state", "temporaries", "activations"]
    # born before the trace, freed by the backward at the first event (the next event is the optimizer's)
    assert accounted("bofbo", [blk(None, -1, 0), blk("model", 2, 3)], passes=[2]) == ["activations", "activations"]


def test_micro_batches_in_flight_are_activations_whatever_their_sizes():
    # a pipeline's forward passes at 1, 2 and 3, their backward later frees each (growing sequence lengths)
    got = accounted("sfffbbb", [blk("model3", 1, 4, req=100), blk("model3", 2, 5, req=200),
                                blk("model3", 3, 6, req=300)], passes=[1, 2, 3])
    assert got == ["activations"] * 3


def test_outputs_kept_from_two_call_paths_of_one_site_are_all_outputs():
    """A pipeline's last stage keeps every micro-batch's logits until step() ends (issue 52): the first comes from
    the schedule's warm-up loop, the others from its steady loop, so their stacks differ though their site (the
    model's line) and their size are the same. All of them are outputs kept, the first too; a one-off block of
    another size at that site stays a temporary."""
    #                 0123456789
    got = accounted("sfbfbfbfbf", [
        blk("head_warmup", 1, req=500), blk("head_steady", 3, req=500), blk("head_steady", 5, req=500),
        blk("head_steady", 7, req=500), blk("head_warmup", 1, req=300),
    ], passes=[1, 3, 5, 7, 9])
    assert got == ["outputs"] * 4 + ["temporaries"]


def test_open_blocks_learn_only_from_blocks_of_the_passes():
    # the loop's block of setup, freed there, says nothing of the first pass's open block of the same line
    assert accounted("ssfff", [blk("input", 0, 1), blk("input", 2)], passes=[2]) == ["temporaries", "activations"]
    # the same line allocating again in the optimizer's work is not the pass running on past the open block
    assert accounted("sffo", [blk("input", 1, 2), blk("input", 2), blk("input", 3)], passes=[1]) == [
        "temporaries", "temporaries", "optimizer_state"]
    # a first backward ending the trace: a block born before the trace (no stack) is no earlier run of it
    assert accounted("sffbb", [blk(None, -1, 2), blk(None, 3), blk("model", 1, 3)], passes=[1]) == [
        "unknown", "temporaries", "activations"]


def test_a_block_born_before_the_trace_freed_inside_the_backward_it_began_in_is_no_gradient():
    # the trace begins inside a backward (runs 0-2 and 4-5, no torch optimizer step): the engine's block made
    # before the trace and freed at event 1, still inside that backward run, did not outlive it
    assert accounted("bbbfbbfbff", [blk("engine", -1, 1, req=555), blk("model", 3, 4)], passes=[3, 6, 8]) == [
        "temporaries", "activations"]
    # freed after that run ended (event 3, a forward): it outlived it, a gradient
    assert accounted("bbbfbbfbff", [blk("engine", -1, 3, req=555), blk("model", 3, 4)], passes=[3, 6, 8])[0] == \
        "gradients"


def test_blocks_from_before_a_late_recording_are_parameters_where_the_gradients_match_them_one_to_one():
    """``_record_memory_history`` called after ``model.cuda()`` and the optimizer's construction: the parameters
    have no stack. Passes at 1, 5 and 8, backward at 3 and 6, the torch optimizer steps begin after 3 and 6."""
    #        012345678
    trace = "sffbofbof"
    grads = [blk("engine", 3, 4, req=1000), blk("engine", 3, 4, req=1000), blk("engine", 3, 4, req=2000),
             blk("engine", 3, 4, req=3000), blk("engine", 3, 4, req=4000),
             blk("engine", 6, 7, req=1000), blk("engine", 6, 7, req=1000), blk("engine", 6, 7, req=2000),
             blk("engine", 6, 7, req=3000)]  # the second step has no gradient of 4000 bytes
    got = accounted(trace, [
        blk(None, -1, req=1000), blk(None, -1, req=1000),  # two of a size, two gradients of it at each step
        blk(None, -1, 8, req=2000),  # freed when the last pass begins (teardown): lived through the training
        blk(None, -1, req=3000), blk(None, -1, req=3000), blk(None, -1, req=3000),  # 3 for 1 gradient: unknown
        blk(None, -1, req=4000),  # a gradient at one step only: unknown
        blk(None, -1, 5, req=1000),  # freed before the last pass: not the model's, unknown
        blk("opt", 4, req=1000),  # Adam's moment made at the first step in the trace stays optimizer state
    ] + grads, passes=[1, 5, 8], opt_starts=[3, 6])
    assert got[:9] == ["parameters", "parameters", "parameters", "unknown", "unknown", "unknown", "unknown",
                       "unknown", "optimizer_state"]
    assert got[9:] == ["gradients"] * 9
    # three candidates for two gradients: none (an optimizer that stepped before the trace keeps the moments)
    got = accounted(trace, [blk(None, -1, req=1000)] * 3 + grads, passes=[1, 5, 8], opt_starts=[3, 6])
    assert got[:3] == ["unknown"] * 3
    # no torch optimizer step in the trace: no gradient set to match, unknown
    assert accounted(trace, [blk(None, -1, req=1000)] + grads, passes=[1, 5, 8])[0] == "unknown"


def test_runs_give_each_event_its_run_of_equal_phase():
    """_runs counts run starts (cumsum) instead of searching them; the same first and last index per event as
    the search gave, on random phase sequences of every length from 1."""
    from oomdoctor.analysis.accounting import _runs

    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 7, 100, 1000):
        for kinds in (1, 2, 5):
            phase = rng.integers(0, kinds, n).astype(np.int8)
            first, last = _runs(phase)
            for i in range(n):
                lo = i
                while lo > 0 and phase[lo - 1] == phase[i]:
                    lo -= 1
                hi = i
                while hi < n - 1 and phase[hi + 1] == phase[i]:
                    hi += 1
                assert (first[i], last[i]) == (lo, hi), (n, i)
