"""Memory accounting: every allocated byte in one category.

Categories (:data:`CATEGORIES`), after the profiler's memory categories
(``torch/profiler/_memory_profiler.py`` ``Category``) and ``torch.distributed._tools.mem_tracker``'s
``_MemRefType``, with communication and kept outputs named because they decide distributed jobs:
``parameters``, ``gradients``, ``optimizer_state``, ``activations`` (saved for backward),
``temporaries`` (workspaces, short-lived tensors, one-off caches), ``communication`` (collective
buffers), ``outputs`` (tensors of one micro-batch kept while later ones run: logits or predictions
gathered across batches) and ``unknown``.

Each block (a row of :class:`~.lifetimes.Lifetimes`) gets one category, from two sources:

1. ``recorded``: the sidecar's storages of parameters, gradients and optimizer state, noted by
   ``oomdoctor run`` at the end of the first optimizer steps (:mod:`oomdoctor.capture.facts`); the block
   that contained a storage then is that category.
2. ``trace``: the block's lifetime against the phases of :mod:`.phases` (born and freed where), and
   what its stack is (collective buffers, optimizer code):

   - born at setup (or before recording) and never freed: parameters (optimizer state if optimizer
     code made it, communication if a collective's: DDP's buckets); freed later: temporaries;
   - born in the optimizer step: optimizer state if it outlives that step's optimizer run (Adam's
     ``exp_avg``/``exp_avg_sq`` created lazily at the first step), else temporaries;
   - born in backward: gradients if it outlives the backward run (``AccumulateGrad``, FSDP's
     reduce-scatter output), else temporaries or communication; the cuBLAS workspace of the engine
     thread (one block of the workspace size, no frames, never freed) is a temporary
     (``aten/src/ATen/cuda/CublasHandlePool.cpp``: one workspace per handle and stream, 32 MiB by
     default on Hopper, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``);
   - born in a forward (or evaluation) pass: activations if freed in a backward before the next pass
     begins, outputs if still allocated after the next pass began (and either freed later, or one of
     several such blocks of the same site: accumulation), communication if a collective's buffer,
     else temporaries (a block kept forever that its site never repeats is a one-off cache);
   - still allocated when the trace ends inside its own pass (an OOM): what the completed blocks of
     the same stack became, else activations.

The byte identity: the categories at an event sum to the allocated bytes then (asserted by
:meth:`Breakdown.check` and in :func:`breakdown`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..trace.model import DeviceTrace, Trace
from .lifetimes import IN_TRACE, Lifetimes
from .phases import (
    BACKWARD_PHASE,
    EVALUATION_PHASE,
    FORWARD_PHASE,
    OPTIMIZER_PHASE,
    OTHER_PHASE,
    SETUP_PHASE,
    Phases,
    role_index,
)

CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "activations", "temporaries",
                               "communication", "outputs", "unknown")
PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, TEMPORARIES, COMMUNICATION, OUTPUTS, UNKNOWN = range(8)
RECORDED, TRACE = 1, 0

#: Categories whose bytes grow with the micro-batch (used by what fits): tensors of the batch's passes.
BATCH_SCALED = (ACTIVATIONS, TEMPORARIES, OUTPUTS)

CUBLAS_WORKSPACE_BYTES: tuple[int, ...] = (32 * 1024 * 1024, 4096 * 1024 * 2 + 16 * 1024 * 8)
"""cuBLAS workspace sizes PyTorch allocates by default: ``:4096:8`` (Hopper and newer) and
``:4096:2:16:8`` (``CublasHandlePool.cpp`` ``getChosenWorkspaceSize``)."""


@dataclass
class Accounting:
    """Per lifetime row (arrays of length ``len(lifetimes)``): ``category`` (index into
    :data:`CATEGORIES`), ``source`` (:data:`RECORDED` or :data:`TRACE`), ``born_phase`` (index into
    :data:`~.phases.PHASE_NAMES`), and ``batch_scaled``: whether its size grows with the micro-batch."""

    category: np.ndarray
    source: np.ndarray
    born_phase: np.ndarray
    batch_scaled: np.ndarray
    recorded_steps: int = 0


@dataclass
class Breakdown:
    """Allocated bytes after event ``event_index`` by category. ``at`` names the point (``oom``,
    ``peak_allocated``, ``peak_reserved``, ``optimizer_start``, ``step_end``); ``sources`` says per
    category with bytes whether most of them came from recorded facts or from the trace."""

    at: str
    event_index: int
    step: int | None
    phase: str
    categories: dict[str, int]
    sources: dict[str, str]
    allocated_bytes: int
    counts: dict[str, int] = field(default_factory=dict)

    def check(self) -> None:
        """Assert the identity: the categories add up to the allocated bytes."""
        assert sum(self.categories.values()) == self.allocated_bytes, (self.categories, self.allocated_bytes)


def _runs(phase: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each event (``phase`` non-empty), the first and last event index of its run of equal phase."""
    n = phase.shape[0]
    change = np.flatnonzero(np.diff(phase)) + 1
    starts = np.concatenate(([0], change))
    ends = np.concatenate((change - 1, [n - 1]))
    rid = np.searchsorted(starts, np.arange(n), side="right") - 1
    return starts[rid], ends[rid]


def account(trace: Trace, dt: DeviceTrace, lt: Lifetimes, ph: Phases) -> Accounting:
    """Categorise every row of ``lt`` (see the module doc). Pure; O(rows log rows)."""
    n = dt.num_events
    rows = len(lt)
    ri = role_index(trace)
    b = lt.alloc
    d = np.where(lt.free_requested >= 0, lt.free_requested, lt.free_completed)
    pre = (b < 0) | (lt.start_state != IN_TRACE)
    phase = ph.phase
    if n:
        bp = np.where(pre, SETUP_PHASE, phase[np.clip(b, 0, n - 1)])
        dp = np.where(d >= 0, phase[np.clip(d, 0, n - 1)], -1)
        b_end = np.where(b >= 0, _runs(phase)[1][np.clip(b, 0, n - 1)], -1)
    else:
        bp = np.full(rows, SETUP_PHASE)
        dp = b_end = np.full(rows, -1)
    comm = ri.lookup(ri.communication, lt.stack)
    optim = ri.lookup(ri.optimizer, lt.stack)
    own = ri.roles_of(lt.stack, ph.python_stacks)  # the block's own stack, before smoothing
    persistent = d < 0
    cat = np.full(rows, UNKNOWN, dtype=np.int8)

    # setup and pre-trace: what lives through the training passes (until the last one began, or to the
    # end: teardown frees the rest) is the model's state
    setup = pre | (bp == SETUP_PHASE)
    last_pass = int(ph.pass_starts[-1]) if ph.pass_starts.size else n
    lives = persistent | (d >= last_pass)
    cat[setup & lives] = PARAMETERS
    cat[setup & lives & comm] = COMMUNICATION
    cat[setup & lives & optim] = OPTIMIZER_STATE
    cat[setup & ~lives & ~pre] = TEMPORARIES
    cat[setup & ~lives & pre & (dp == BACKWARD_PHASE)] = ACTIVATIONS
    cat[setup & ~lives & pre & (dp != BACKWARD_PHASE)] = TEMPORARIES
    # allocated before recording by model code (its stack is in the final segments): a trace that starts
    # in the middle of training or evaluation (the ring buffer dropped the oldest events)
    pre_model = pre & ((own == FORWARD_PHASE) | (own == EVALUATION_PHASE)) & ph.python_stacks
    first_pass = int(ph.pass_starts[0]) if ph.pass_starts.size else n
    cat[pre_model] = np.where(dp[pre_model] == BACKWARD_PHASE, ACTIVATIONS,
                              np.where(persistent[pre_model] | (d[pre_model] > first_pass), OUTPUTS, TEMPORARIES))

    # optimizer (its own code: data transfers or logging right after it are not optimizer state)
    o = ~setup & (bp == OPTIMIZER_PHASE) & (own == OPTIMIZER_PHASE)
    cat[o] = np.where(persistent[o] | (d[o] > b_end[o]), OPTIMIZER_STATE, TEMPORARIES)

    # backward
    bw = ~setup & (bp == BACKWARD_PHASE) & (own == BACKWARD_PHASE)
    outlives = persistent | (d > b_end)
    cat[bw & outlives] = GRADIENTS
    cat[bw & ~outlives] = np.where(comm[bw & ~outlives], COMMUNICATION, TEMPORARIES)
    if n and phase[-1] == BACKWARD_PHASE:
        # the trace ends inside a backward (an OOM): whether a block outlives it is unknown; the same
        # allocation in the previous backward says, else most of that stack's, else a temporary (a
        # gradient only where FSDP's post-backward made it)
        run_no = ph.run_number(BACKWARD_PHASE)
        group = np.where(b >= 0, run_no[np.clip(b, 0, n - 1)], -1)
        op = bw & persistent & (group == run_no[-1])
        reduce = _stacks_with(trace, lt.stack, ("post_backward", "_post_backward_hook", "foreach_reduce"))
        cat[op] = _fate_of_open(cat, bw & ~op, op, b, group, lt.stack, TEMPORARIES)[0]
        cat[op & reduce & (cat == TEMPORARIES)] = GRADIENTS
    # the engine thread's cuBLAS workspace: no frames, the workspace size, kept across optimizer steps
    # (gradients die at the next zero_grad)
    ws = np.flatnonzero(bw & outlives & np.isin(lt.requested, CUBLAS_WORKSPACE_BYTES))
    if ph.python_stacks and ws.size and n:
        o_starts = ph.run_number(OPTIMIZER_PHASE)
        updates = np.where(d[ws] >= 0, o_starts[np.clip(d[ws], 0, n - 1)], o_starts[-1] + 2) - o_starts[b[ws]]
        empty = np.array([s < 0 or not trace.stacks.stacks[s] for s in lt.stack[ws].tolist()], dtype=bool)
        cat[ws[empty & (updates >= 2)]] = TEMPORARIES

    # forward, evaluation and other code run by a pass
    fw = ~setup & ~o & ~bw
    _forward(cat, fw, b, d, bp, dp, own, persistent, comm, lt, ph, n)
    src = np.full(rows, TRACE, dtype=np.int8)
    recorded = _apply_facts(trace, dt, lt, cat, src)
    scaled = np.isin(cat, BATCH_SCALED) & (np.isin(bp, (FORWARD_PHASE, BACKWARD_PHASE, EVALUATION_PHASE, OTHER_PHASE)))
    return Accounting(cat, src, bp.astype(np.int8), scaled, recorded)


def _forward(cat: np.ndarray, fw: np.ndarray, b: np.ndarray, d: np.ndarray, bp: np.ndarray, dp: np.ndarray,
             own: np.ndarray, persistent: np.ndarray, comm: np.ndarray, lt: Lifetimes, ph: Phases, n: int) -> None:
    if not fw.any():
        return
    starts = ph.pass_starts
    bpass = ph.pass_of(b)
    nxt = np.append(starts, n)[np.clip(bpass + 1, 0, starts.size)]  # where the next pass begins (n: none)
    alive_next = (nxt < n) & (persistent | (d > nxt))
    freed_bw = ~persistent & (dp == BACKWARD_PHASE) & ~alive_next
    freed_here = ~persistent & ~freed_bw & ~alive_next
    open_ = persistent & (nxt >= n)
    # kept past the next pass: accumulation (blocks of one site from several passes) or a one-off cache;
    # only forward or evaluation code makes outputs (the next batch's inputs, prefetched, do not)
    model_code = (own == FORWARD_PHASE) | (own == EVALUATION_PHASE)
    kept = fw & alive_next
    cat[kept & ~model_code] = TEMPORARIES
    kept &= model_code
    stack = lt.stack
    out = kept & ~persistent  # freed in a later pass: kept across batches
    pk = kept & persistent
    if pk.any():
        idx = np.flatnonzero(pk)
        passes_of_site: dict[int, set[int]] = {}
        kept_idx = np.flatnonzero(kept)
        for s, p in zip(stack[kept_idx].tolist(), bpass[kept_idx].tolist()):
            passes_of_site.setdefault(s, set()).add(p)
        repeated = np.array([len(passes_of_site[s]) >= 2 for s in stack[idx].tolist()], dtype=bool)
        out[idx[repeated]] = True
        cat[idx[~repeated]] = np.where(comm[idx[~repeated]], COMMUNICATION, TEMPORARIES)
    cat[out] = OUTPUTS
    # a collective's buffer kept across passes in training is communication (DDP rebuilding its buckets
    # in _pre_forward); in evaluation, gathered predictions are outputs
    cat[out & comm & (bp != EVALUATION_PHASE)] = COMMUNICATION
    cat[fw & freed_bw] = ACTIVATIONS
    sel = fw & freed_here
    cat[sel] = np.where(comm[sel], COMMUNICATION, TEMPORARIES)
    # open at the end of the trace, inside their own pass (an OOM, or a dump mid-step): what the same
    # allocation (same stack, same rank among that stack's allocations in the pass) became in the last
    # finished pass, else what most of that stack's finished blocks became, else activations
    op = fw & open_
    if op.any():
        fate, matched = _fate_of_open(cat, fw & ~open_, op, b, bpass, stack, ACTIVATIONS)
        cat[op] = fate
        # no earlier pass to learn from, but the trace went on into this pass's backward and the block
        # was still there: saved for it
        bpos = np.flatnonzero(ph.phase == BACKWARD_PHASE)
        if bpos.size:
            nb = np.searchsorted(bpos, b[op], side="right")
            entered = (nb < bpos.size) & (bpos[np.minimum(nb, bpos.size - 1)] < nxt[op]) & ~matched
            cat[np.flatnonzero(op)[entered]] = ACTIVATIONS
        cat[op & comm] = COMMUNICATION


def _stacks_with(trace: Trace, stacks: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
    """Per row: does its stack have a frame whose function is one of ``names``?"""
    hit = {s for s, fids in enumerate(trace.stacks.stacks) if any(trace.stacks.frames[f][2] in names for f in fids)}
    return np.array([s in hit for s in stacks.tolist()], dtype=bool) if hit else np.zeros(stacks.shape, bool)


def _fate_of_open(cat: np.ndarray, done: np.ndarray, op: np.ndarray, b: np.ndarray, bpass: np.ndarray,
                  stack: np.ndarray, default: int) -> tuple[np.ndarray, np.ndarray]:
    """Categories for the rows of ``op``, still allocated when the trace ends inside their own group
    (``bpass``: a pass, or a backward run). Allocations are matched by (stack, rank among that stack's
    allocations in the group), counted over every row of the group, to the last finished group; else
    the category most of that stack's finished rows got; else ``default``. Also returns which rows were
    matched to an allocation of an earlier group."""
    rows = np.flatnonzero(done | op)
    rows = rows[np.argsort(b[rows], kind="stable")]
    seen: dict[tuple[int, int], int] = {}
    rank = {}
    for r in rows.tolist():
        key = (int(bpass[r]), int(stack[r]))
        rank[r] = seen.get(key, 0)
        seen[key] = rank[r] + 1
    useful = done & np.isin(cat, (ACTIVATIONS, TEMPORARIES, OUTPUTS, COMMUNICATION))
    finished = {(int(bpass[r]), int(stack[r]), rank[r]): r for r in np.flatnonzero(useful).tolist()}
    passes_done = sorted({p for p, _s, _i in finished})
    majority: dict[int, int] = {}
    ks, cs = stack[useful], cat[useful]
    for s in np.unique(ks).tolist():
        vals, cnt = np.unique(cs[ks == s], return_counts=True)
        majority[s] = int(vals[np.argmax(cnt)])
    fate, matched = [], []
    for r in np.flatnonzero(op).tolist():
        p, s = int(bpass[r]), int(stack[r])
        prev = [q for q in passes_done if q < p]
        m = finished.get((prev[-1], s, rank[r])) if prev else None
        fate.append(int(cat[m]) if m is not None else majority.get(s, default))
        matched.append(m is not None)
    return np.array(fate, dtype=np.int8), np.array(matched, dtype=bool)


_FACT_CATEGORY = {"parameters": PARAMETERS, "gradients": GRADIENTS, "optimizer_state": OPTIMIZER_STATE}


def _apply_facts(trace: Trace, dt: DeviceTrace, lt: Lifetimes, cat: np.ndarray, src: np.ndarray) -> int:
    """Recorded storages -> the rows that held them at the time they were noted. Returns how many
    records were applied."""
    records = trace.meta.get("tensors")  # shape checked at load (trace/load.py _drop_malformed)
    if not records or dt.num_events == 0:
        return 0
    t = dt.events["time_us"]
    applied = 0
    for rec in records:
        when = rec["time_us"]
        if rec.get("at") == "dump" and when >= t[-1]:
            k = dt.num_events - 1  # noted right after the snapshot was taken: its final state
        elif when < t[0] or when > t[-1]:
            continue  # noted before the trace's first event (ring buffer) or after it: addresses may be reused
        else:
            k = int(np.searchsorted(t, when, side="right")) - 1
        alive = np.flatnonzero(lt.allocated_mask(k))
        if alive.size == 0:
            continue
        order = alive[np.argsort(lt.addr[alive], kind="stable")]
        lo, hi = lt.addr[order], lt.addr[order] + lt.size[order]
        for kind in ("gradients", "optimizer_state", "parameters"):  # later kinds win a shared block
            ptrs = np.array([p[0] for p in rec.get(kind, [])], dtype=object)
            ptrs = ptrs[(ptrs >= 0) & (ptrs < 1 << 63)].astype(np.int64) if ptrs.size else np.zeros(0, np.int64)
            j = np.searchsorted(lo, ptrs, side="right") - 1
            ok = (j >= 0) & (ptrs < hi[np.maximum(j, 0)])
            hit = order[j[ok]]
            cat[hit] = _FACT_CATEGORY[kind]
            src[hit] = RECORDED
        applied += 1
    return applied


def breakdown(acc: Accounting, lt: Lifetimes, ph: Phases, k: int, at: str, allocated_bytes: int) -> Breakdown:
    """The categories of the blocks allocated after event ``k``; asserts they sum to
    ``allocated_bytes`` (the timeline's allocated bytes then)."""
    rows = np.flatnonzero(lt.allocated_mask(k))
    cats = acc.category[rows]
    sizes = lt.size[rows]
    total = np.bincount(cats, weights=sizes, minlength=len(CATEGORIES)).astype(np.int64)
    count = np.bincount(cats, minlength=len(CATEGORIES))
    rec = np.bincount(cats[acc.source[rows] == RECORDED], weights=sizes[acc.source[rows] == RECORDED],
                      minlength=len(CATEGORIES))
    categories = {c: int(total[i]) for i, c in enumerate(CATEGORIES)}
    sources = {c: ("recorded" if rec[i] * 2 > total[i] else "trace") for i, c in enumerate(CATEGORIES) if total[i]}
    out = Breakdown(at, int(k), ph.step_of(k), ph.phase_name(k), categories, sources, int(allocated_bytes),
                    {c: int(count[i]) for i, c in enumerate(CATEGORIES) if count[i]})
    out.check()
    return out
