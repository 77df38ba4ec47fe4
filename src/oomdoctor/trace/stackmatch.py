"""Stacks for the steps recorded without them, matched against a step recorded with them.

``oomdoctor run --stack-steps K/N`` (:mod:`oomdoctor.capture.recorder`) gathers Python stacks only in some
steps and records every event of the other steps without a stack (``context=None``). The sidecar says which
(``stack_markers``: from a step on, stacks on or off) and where the steps are (``step_markers``). A seeded
training step repeats the same allocations in the same order: this module gives an allocation of a
stack-less step the stack of the allocation at the **same position** in a stacked step's sequence of
allocations, when every allocation up to and including it has the **same size and stream** in both steps
(the common prefix). After the first difference nothing more of that step is matched: its allocations keep
no stack (``unknown`` over a guess). Frees of a matched block get its stack too, as PyTorch records them
under ``context="alloc"`` (``CUDACachingAllocator.cpp``: ``free`` passes ``block->context_when_allocated``).

The reference of a step is the complete stacked step with the longest common prefix (ties: the nearest
earlier one, then the nearest later one). A step is complete when both its markers fall inside the trace;
a stack-less step that began before the trace (the ring buffer dropped its start) is not matched, since
positions in it are unknown.

What was matched is written to ``trace.meta["stack_matches"]`` (:func:`match_stackless_steps`), so that the
report can say it: per step, its reference step and how many of its allocations took a stack.
:func:`matched_from` gives, per event, the step its stack was matched from (-1: recorded, or none).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

import numpy as np

from .model import ACTION_CODES, DeviceTrace, Trace

ALLOC = ACTION_CODES["alloc"]
FREE_REQUESTED = ACTION_CODES["free_requested"]
FREE_COMPLETED = ACTION_CODES["free_completed"]
META_KEY = "stack_matches"


def _markers(meta: dict[str, Any], key: str, field: str) -> list[tuple[int, int, Any]] | None:
    """``[(step, time_us, value)]`` of a sidecar marker list, or None when absent or malformed."""
    raw = meta.get(key)
    if not isinstance(raw, list):
        return None
    out = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("step"), int) or not isinstance(m.get("time_us"), int):
            return None
        out.append((m["step"], m["time_us"], m.get(field)))
    return sorted(out, key=lambda x: (x[0], x[1]))


def _device_of(trace: Trace) -> DeviceTrace | None:
    dev = trace.meta.get("device")
    if isinstance(dev, int) and dev in trace.devices:
        return trace.devices[dev]
    return trace.primary if trace.devices else None


def match_stackless_steps(trace: Trace) -> dict[str, Any] | None:
    """Fill the ``stack`` column of the allocations (and their frees) of the steps recorded without stacks,
    from stacked steps, in place; return what was done (also kept in ``trace.meta["stack_matches"]``):

    ``{"device": d, "steps": [{"step", "first_event", "end_event", "from_step" (None: no reference),
    "allocations", "matched" (took a stack), "matched_without_stack" (the reference had none either),
    "unmatched"[, "started_before_trace": True]}], "matched": n, "unmatched": m}``; ``allocations == matched +
    matched_without_stack + unmatched`` for every step. Steps are those of ``step_markers`` (from 0), events ``[first_event,
    end_event)``.

    None (and nothing changed) when the sidecar has no ``stack_markers`` (stacks at every step), when the
    trace was matched before (a saved trace), or when the markers are malformed (a warning is added).
    """
    meta = trace.meta
    if META_KEY in meta or "stack_markers" not in meta:
        return None
    stack_marks = _markers(meta, "stack_markers", "stacks")
    step_marks = _markers(meta, "step_markers", "step")
    if stack_marks is None or step_marks is None or any(not isinstance(v, bool) for _, _, v in stack_marks):
        trace.warnings.append("sidecar: stack_markers or step_markers malformed; steps recorded without stacks "
                              "are not matched")
        return None
    dt = _device_of(trace)
    if dt is None or dt.num_events == 0:
        return None
    times = dt.events["time_us"].tolist()
    n = len(times)
    starts = [(s, bisect_left(times, t), t >= times[0]) for s, t, _ in step_marks]

    def stacked(step: int) -> bool | None:
        on = None
        for s, _, v in stack_marks:
            if s <= step:
                on = v
        return on

    action, size, stream, stack = dt.events["action"], dt.events["size"], dt.events["stream"], dt.events["stack"]
    steps = []  # (step, lo, hi, complete, stacked)
    for i, (s, lo, inside) in enumerate(starts):
        hi = starts[i + 1][1] if i + 1 < len(starts) else n
        steps.append((s, lo, hi, inside and i + 1 < len(starts), inside, stacked(s)))
    allocs = {s: lo + np.flatnonzero(action[lo:hi] == ALLOC) for s, lo, hi, _, _, _ in steps}
    refs = [s for s, _, _, complete, _, on in steps if on and complete]
    result: dict[str, Any] = {"device": dt.device, "steps": [], "matched": 0, "unmatched": 0}
    filled: dict[int, int] = {}  # alloc event -> stack given
    for s, lo, hi, _, inside, on in steps:
        if on is not False:
            continue
        mine = allocs[s]
        if not inside:  # began before the trace: positions in it are unknown
            if mine.size:
                result["steps"].append({"step": s, "first_event": lo, "end_event": hi, "from_step": None,
                                        "allocations": int(mine.size), "matched": 0, "matched_without_stack": 0,
                                        "unmatched": int(mine.size), "started_before_trace": True})
                result["unmatched"] += int(mine.size)
            continue
        best, best_len = None, 0
        for r in sorted(refs, key=lambda r: (r > s, abs(r - s))):  # nearest earlier first, then later
            theirs = allocs[r]
            m = min(mine.size, theirs.size)
            diff = np.flatnonzero((size[mine[:m]] != size[theirs[:m]]) | (stream[mine[:m]] != stream[theirs[:m]]))
            common = int(diff[0]) if diff.size else m
            if common > best_len:
                best, best_len = r, common
        entry = {"step": s, "first_event": lo, "end_event": hi, "from_step": best, "allocations": int(mine.size),
                 "matched": 0, "matched_without_stack": 0, "unmatched": int(mine.size) - best_len}
        if best is not None:
            src = stack[allocs[best][:best_len]]
            dst = mine[:best_len]
            give = (stack[dst] < 0) & (src >= 0)
            stack[dst[give]] = src[give]
            filled.update(zip(dst[give].tolist(), src[give].tolist()))
            entry["matched"] = int(give.sum())
            entry["matched_without_stack"] = best_len - entry["matched"]
        result["steps"].append(entry)
        result["matched"] += entry["matched"]
        result["unmatched"] += entry["unmatched"]
    if filled:
        _fill_frees(dt, filled)
    meta[META_KEY] = result
    return result


def _fill_frees(dt: DeviceTrace, filled: dict[int, int]) -> None:
    """The frees of the blocks whose allocation took a stack carry that stack (``context="alloc"``)."""
    action, addr, stack = dt.events["action"], dt.events["addr"], dt.events["stack"]
    live: dict[int, int] = {}
    for k in np.flatnonzero((action == ALLOC) | (action == FREE_REQUESTED) | (action == FREE_COMPLETED)).tolist():
        a = int(addr[k])
        if action[k] == ALLOC:
            if k in filled:
                live[a] = filled[k]
            else:
                live.pop(a, None)
        elif a in live and stack[k] < 0:
            stack[k] = live[a]
            if action[k] == FREE_COMPLETED:
                del live[a]


def unmatched_allocations(trace: Trace) -> np.ndarray | None:
    """Per event of the matched device: True for the allocations recorded without a stack (a step outside
    ``--stack-steps``) that no stacked step matched; None when nothing was matched (no ``stack_markers``).
    Their site is unknown: they are not the autograd engine's allocations that an empty stack means
    otherwise."""
    res = trace.meta.get(META_KEY)
    if not isinstance(res, dict) or res.get("device") not in trace.devices:
        return None
    dt = trace.devices[res["device"]]
    out = np.zeros(dt.num_events, dtype=bool)
    action = dt.events["action"]
    for e in res.get("steps", []):
        if e.get("unmatched"):
            lo, hi = int(e["first_event"]), int(e["end_event"])
            idx = lo + np.flatnonzero(action[lo:hi] == ALLOC)
            out[idx[int(e["allocations"]) - int(e["unmatched"]):]] = True
    return out


def matched_from(trace: Trace, dt: DeviceTrace) -> np.ndarray:
    """Per event of ``dt``: the step whose allocation gave it its stack (-1: recorded, or none)."""
    out = np.full(dt.num_events, -1, dtype=np.int32)
    res = trace.meta.get(META_KEY)
    if not isinstance(res, dict) or res.get("device") != dt.device:
        return out
    action, stack = dt.events["action"], dt.events["stack"]
    for e in res.get("steps", []):
        if e.get("from_step") is None:
            continue
        lo, hi = int(e["first_event"]), int(e["end_event"])
        idx = lo + np.flatnonzero(action[lo:hi] == ALLOC)
        idx = idx[: e["allocations"] - e["unmatched"]]
        out[idx[stack[idx] >= 0]] = int(e["from_step"])
    return out


__all__ = ["META_KEY", "match_stackless_steps", "matched_from", "unmatched_allocations"]
