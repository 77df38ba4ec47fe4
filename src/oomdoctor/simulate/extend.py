"""A trace cut by its OOM, extended by the rest of its step as the previous step ran it.

A replay of a trace that ends at an OOM proves only that the recorded events fit: the step the OOM cut
short would have gone on (the rest of the forward, the backward, the update). When the trace holds a
complete earlier step, the next step repeats the previous one, plus the state the previous one created
and kept (an optimizer's lazily made state exists now): so the rest of the cut step is the previous
step's events after the allocation that matches the failed one. Allocations are matched within a step by
(stack, rank among that stack's allocations in the step), as the accounting matches an open pass.

The extension (:func:`extend_by_previous_step`) is a new :class:`~oomdoctor.trace.model.DeviceTrace`:
the recorded events up to the OOM, without the ``oom`` entry, then the previous step's ``alloc``,
``free_requested`` and ``free_completed`` events after the matched allocation, with

- the blocks those allocate at fresh addresses (the recorded ones may be live now);
- frees of blocks the previous step made before the matched point sent to the current step's matching
  block (dropped when that one is gone already);
- frees of blocks made before the previous step kept as recorded when that block is still alive;
- allocations of blocks the previous step kept past its end (state created once) left out;
- no ``segment_*`` entries: they are the allocator's answers, which a replay computes;
- the sizes of the blocks it allocates scaled up where the cut step is larger than the previous one (a
  job of variable-size inputs: graphs, sequences): by the lower median, over the allocations matched before
  the OOM, of the cut step's size over the previous step's, when that is above 1 (more than half of them
  grew). A job whose steps have the same shapes has a median of 1 and is extended as recorded; so does one
  where a few matches pair different buffers of one stack (a DeepSpeed step pairs 2 of 396 that way). Without
  it, the rest of a large graph's step was replayed at the previous, smaller graph's sizes and predicted to
  complete where the rerun ran out (issue 35: GraphSAGE under a cap with ``garbage_collection_threshold:0.8``).

Its final segments are the recording's, so the state at the trace's start is rebuilt as before. What it
claims reaches as far as that assumption: the step completes if the next step repeats the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..trace.model import ALLOC, FREE_COMPLETED, FREE_REQUESTED, OOM, DeviceTrace

FRESH = 1 << 52
"""Offset that gives the extension's own blocks addresses no recorded block has (PyTorch's are below 2**48)."""


@dataclass
class Extension:
    """An extended trace (``device``), the index of its first appended event (``first_appended``), how many
    events were appended, the step it borrowed (``previous_step``: ``(start, end)`` event indices) and the
    recorded OOM event it replaces."""

    device: DeviceTrace
    first_appended: int
    appended: int
    previous_step: tuple[int, int]
    oom_event: int
    scale: float = 1.0  # the lower median of the matched allocations' size ratios (cut / previous), at least 1
    scaled: int = 0  # appended allocations whose size was scaled up


def _keys(action: np.ndarray, stack: np.ndarray, lo: int, hi: int) -> dict[int, tuple[int, int]]:
    """Event index -> (stack, rank among that stack's allocations in [lo, hi)) for the allocations there."""
    seen: dict[int, int] = {}
    out: dict[int, tuple[int, int]] = {}
    for j in np.flatnonzero(action[lo:hi] == ALLOC).tolist():
        s = int(stack[lo + j])
        out[lo + j] = (s, seen.get(s, 0))
        seen[s] = seen.get(s, 0) + 1
    return out


def extend_by_previous_step(dt: DeviceTrace, step_starts: np.ndarray, alive_at_oom: dict[int, bool] | None = None
                            ) -> Extension | None:
    """The trace of ``dt`` (ending at an ``oom`` entry) extended by the rest of its step (see the module doc).
    ``step_starts``: event indices where steps begin. None when there is no OOM, no complete step before the
    OOM's, or no allocation of the previous step matches the failed one."""
    ev = dt.events
    action, addr, stack = ev["action"], ev["addr"], ev["stack"]
    ooms = np.flatnonzero(action == OOM)
    if ooms.size == 0:
        return None
    k = int(ooms[-1])
    starts = np.asarray(step_starts, dtype=np.int64)
    cur = int(np.searchsorted(starts, k, side="right")) - 1
    if cur < 1:
        return None
    p0, s0 = int(starts[cur - 1]), int(starts[cur])
    if s0 <= p0:
        return None
    # the failed request's key in its step
    now = _keys(action, stack, s0, k)
    failed = int(stack[k])
    rank = sum(1 for key in now.values() if key[0] == failed)
    before = _keys(action, stack, p0, s0)
    by_key = {v: j for j, v in before.items()}
    p = by_key.get((failed, rank))
    if p is None:
        return None
    ratio = _growth(ev["size"], now, by_key)
    # current step's blocks by key -> their address, while alive at the OOM
    live: dict[int, int] = {}  # address -> alloc event, blocks allocated and not freed before the OOM
    for j in range(k):
        a = int(action[j])
        if a == ALLOC:
            live[int(addr[j])] = j
        elif a == FREE_REQUESTED:
            live.pop(int(addr[j]), None)
    cur_addr = {key: int(addr[j]) for j, key in now.items() if live.get(int(addr[j])) == j}
    # the previous step's blocks: which alloc each address belongs to, and which outlive that step
    holder: dict[int, int] = {}  # address -> the alloc event holding it now
    freed_at: dict[int, int] = {}
    made: list[int] = []
    for j in range(p0, len(action)):
        a = int(action[j])
        if a == ALLOC:
            holder[int(addr[j])] = j
            if j < s0:
                made.append(j)
        elif a == FREE_REQUESTED:
            i = holder.pop(int(addr[j]), None)
            if i is not None and i < s0:
                freed_at[i] = j
    kept_past = {i for i in made if freed_at.get(i, len(action)) >= s0}
    rows: list[int] = []
    new_addr: list[int] = []
    owner: dict[int, int] = {}  # recorded address -> alloc event in the previous step (after p0)
    for j in range(p0, s0):
        a = int(action[j])
        ad = int(addr[j])
        if a == ALLOC:
            owner[ad] = j
            if j >= p and j not in kept_past:
                rows.append(j)
                new_addr.append(ad + FRESH)
            continue
        if a not in (FREE_REQUESTED, FREE_COMPLETED) or j <= p:
            continue
        i = owner.get(ad)
        if i is None:  # made before the previous step: the same block now, if still alive
            if ad in live:
                rows.append(j)
                new_addr.append(ad)
        elif i >= p:
            if i not in kept_past:
                rows.append(j)
                new_addr.append(ad + FRESH)
        else:
            target = cur_addr.get(before[i])
            if target is not None:
                rows.append(j)
                new_addr.append(target)
    if not rows:
        return None
    idx = np.array(rows, dtype=np.int64)
    t_shift = int(ev["time_us"][k]) - int(ev["time_us"][p])
    sizes = ev["size"][idx].copy()
    grown: dict[int, int] = {}  # fresh address -> its scaled size, for the frees of that block
    scaled = 0
    for m, j in enumerate(rows):
        a = int(action[j])
        if a == ALLOC:
            if ratio > 1.0:
                sizes[m] = -(-int(sizes[m]) * ratio // 1)  # ceil: never below the scaled size
                scaled += 1
            grown[new_addr[m]] = int(sizes[m])
        elif new_addr[m] in grown:
            sizes[m] = grown[new_addr[m]]
    events: dict[str, np.ndarray] = {}
    for name, col in ev.items():
        tail = col[idx].copy()
        if name == "addr":
            tail = np.array(new_addr, dtype=col.dtype)
        elif name == "time_us":
            tail = tail + t_shift
        elif name == "size":
            tail = sizes
        events[name] = np.concatenate([col[:k], tail])
    out = DeviceTrace(dt.device, events, dt.segments, list(dt.annotations))
    return Extension(out, k, int(idx.size), (p0, s0), k, ratio, scaled)


def _growth(size: np.ndarray, now: dict[int, tuple[int, int]], by_key: dict[tuple[int, int], int]) -> float:
    """How much larger the cut step's allocations are than the previous step's: the lower median, over the
    allocations matched by key (``now``: event -> key in the cut step; ``by_key``: key -> event in the previous
    step), of the ratio of their sizes; at least 1.0 (1.0 when nothing is matched)."""
    ratios = sorted(int(size[j]) / int(size[i]) for j, key in now.items()
                    if (i := by_key.get(key)) is not None and int(size[i]) > 0)
    if not ratios:
        return 1.0
    return max(1.0, ratios[(len(ratios) - 1) // 2])


@dataclass
class Estimate:
    """A trace cut in its first forward pass, completed by assumption (:func:`mirror_backward`): the new
    device trace, and which of its events grow with the micro-batch (shape ``(num_events,)``)."""

    device: DeviceTrace
    scaled: np.ndarray


def mirror_backward(dt: DeviceTrace, saved: list[tuple[int, int]], scaled_events: np.ndarray,
                    loss_copies: int, gradient_sizes: list[int], optimizer_sizes: list[int],
                    pass_start: int | None = None) -> Estimate | None:
    """The trace of ``dt`` up to its OOM, then what the step would still have done, by assumption:

    - the failed request (the pass's output) and ``loss_copies`` more blocks of its size (the loss region:
      log-probabilities and their gradient);
    - the gradients (``gradient_sizes``, bytes each: the trainable parameters, made once and kept);
    - a backward that mirrors the forward: for every block the forward saved (``saved``: ``(address, size)``
      in the order they were made), last first, a gradient of its size is made, the saved block freed, and
      that gradient freed once the next one exists;
    - the optimizer state still to come (``optimizer_sizes``, kept);
    - with ``pass_start`` (the event where the cut pass began), the next step's forward up to the same
      request again, as recorded: it meets the cache the first step's backward left, which is where a
      caching allocator's fragmentation shows (the gradients are freed first, as ``zero_grad`` does).

    ``scaled_events``: which recorded events grow with the micro-batch. New blocks get fresh addresses
    (:data:`FRESH`). None when the trace has no OOM."""
    ev = dt.events
    ooms = np.flatnonzero(ev["action"] == OOM)
    if ooms.size == 0:
        return None
    k = int(ooms[-1])
    request = int(ev["size"][k])
    stream, stack, t = int(ev["stream"][k]), int(ev["stack"][k]), int(ev["time_us"][k])
    rows: list[tuple[int, int, int, bool]] = []  # (action, address, size, grows with the batch)
    fresh = iter(range(FRESH, FRESH + (1 << 50), 1 << 32))

    def alloc(size: int, grows: bool) -> int:
        a = next(fresh)
        rows.append((ALLOC, a, size, grows))
        return a

    def free(a: int, size: int) -> None:
        rows.append((FREE_REQUESTED, a, size, False))
        rows.append((FREE_COMPLETED, a, size, False))

    loss = [alloc(request, True) for _ in range(1 + max(loss_copies, 0))]
    grads = [(alloc(size, False), size) for size in gradient_sizes]
    held: tuple[int, int] | None = None
    for a, size in reversed(saved):
        g = alloc(size, True)
        free(a, size)
        if held is not None:
            free(*held)
        held = (g, size)
    for a in loss:
        free(a, request)
    if held is not None:
        free(*held)
    for size in optimizer_sizes:
        alloc(size, False)
    if pass_start is not None:
        for a, size in grads:
            free(a, size)
        mine: dict[int, int] = {}
        act, addr, size_col = ev["action"], ev["addr"], ev["size"]
        for j in range(pass_start, k):
            if act[j] == ALLOC:
                mine[int(addr[j])] = alloc(int(size_col[j]), bool(scaled_events[j]))
            elif act[j] == FREE_REQUESTED and int(addr[j]) in mine:
                free(mine.pop(int(addr[j])), int(size_col[j]))
        for _ in range(1 + max(loss_copies, 0)):
            alloc(request, True)
    n = len(rows)
    tail = {"action": np.array([r[0] for r in rows], dtype=ev["action"].dtype),
            "addr": np.array([r[1] for r in rows], dtype=ev["addr"].dtype),
            "size": np.array([r[2] for r in rows], dtype=ev["size"].dtype),
            "stream": np.full(n, stream, dtype=ev["stream"].dtype),
            "time_us": np.full(n, t, dtype=ev["time_us"].dtype),
            "stack": np.full(n, stack, dtype=ev["stack"].dtype)}
    events: dict[str, np.ndarray] = {}
    for name, col in ev.items():
        events[name] = np.concatenate([col[:k], tail[name] if name in tail else np.full(n, -1, dtype=col.dtype)])
    grows = np.concatenate([scaled_events[:k], np.array([r[3] for r in rows], dtype=bool)])
    return Estimate(DeviceTrace(dt.device, events, dt.segments, list(dt.annotations)), grows)
