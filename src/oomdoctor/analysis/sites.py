"""Allocation sites: which code holds the bytes at a moment of the trace.

A block's *site* is the first frame of its allocation stack (innermost first) that is not PyTorch's
own Python code, the Python standard library, or a C++ frame: the user's (or a model library's)
line that asked for the memory. Blocks allocated before recording started have no stack and are
grouped under :data:`PRE_TRACE`; allocations with an empty stack (autograd's C++ threads record no
Python frames unless ``stacks="all"``) under :data:`NO_STACK`.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Any, Callable, TypeVar, cast

import numpy as np

from ..trace.model import Frame, StackTable, Trace
from ..trace.stackmatch import META_KEY, matched_from, unmatched_allocations
from .lifetimes import IN_TRACE, Lifetimes

T = TypeVar("T")

PRE_TRACE = -2
"""Site id of blocks allocated before the trace started, with no known stack."""
NO_STACK = -1
"""Site id of allocations recorded without any frame."""
UNMATCHED = -3
"""Site id of allocations recorded without a stack by ``--stack-steps`` that no stacked step matched
(:mod:`oomdoctor.trace.stackmatch`): unknown, never guessed."""

_INTERNAL = re.compile(
    r"(-packages/|^|/pytorch/)(torch|triton|functorch|apex|transformer_engine)/"  # framework internals
    r"|(^|/)python3\.\d+/(?!site-packages|dist-packages)"  # stdlib
    r"|^<frozen |^<string>|^\?\?$|^$"
)


def is_internal(frame: Frame) -> bool:
    """True for frames of PyTorch itself, the standard library, or C++ (not a ``.py`` file)."""
    filename = frame[0]
    if not filename.endswith(".py"):
        return True
    return bool(_INTERNAL.search(filename))


CPP_SITE_PREFIXES = ("torch::autograd::generated::", "at::_ops::")
"""For a stack of C++ frames only, the frame that names what asked for the memory, in this order: the autograd
node that ran (``torch/csrc/autograd/generated/Functions.cpp``, e.g. ``NllLossBackward0::apply``), else the
ATen operator (``at::_ops::<op>``, ``build/aten/src/ATen/Operators_*.cpp``). The frames above them are the
recorder's own (``torch::unwind``, ``CapturedTraceback::gather``) and the allocator's."""


def cpp_site(stacks: StackTable, fids: tuple[int, ...]) -> int:
    """The site frame of a stack of C++ frames only (:data:`CPP_SITE_PREFIXES`); its outermost frame when none
    matches (the thread's entry, e.g. the autograd engine's ``thread_main``), never the unwinder's."""
    for prefix in CPP_SITE_PREFIXES:
        for f in fids:
            if stacks.frames[f][2].startswith(prefix):
                return f
    return fids[-1]


class SiteIndex:
    """Maps stack ids to site frame ids (cached per trace)."""

    def __init__(self, stacks: StackTable) -> None:
        self.stacks = stacks
        self._cache: dict[int, int] = {}

    def site(self, stack_id: int) -> int:
        if stack_id < 0:
            return NO_STACK
        got = self._cache.get(stack_id)
        if got is None:
            got = NO_STACK
            fids = self.stacks.stacks[stack_id]
            for fid in fids:
                if not is_internal(self.stacks.frames[fid]):
                    got = fid
                    break
            else:  # only internal frames: the innermost Python frame is the best we have
                got = next((f for f in fids if self.stacks.frames[f][0].endswith(".py")), NO_STACK)
                if got == NO_STACK and fids:  # C++ frames only (stacks="all": the autograd engine's threads)
                    got = cpp_site(self.stacks, fids)
            self._cache[stack_id] = got
        return got

    def sites_of(self, stack_ids: np.ndarray, pre_trace: np.ndarray | None = None) -> np.ndarray:
        """Site frame ids for an array of stack ids; :data:`PRE_TRACE` where ``pre_trace`` and no stack."""
        uniq, inv = np.unique(stack_ids, return_inverse=True)
        mapped = np.array([self.site(int(s)) for s in uniq], dtype=np.int64)[inv] if uniq.size else \
            np.zeros(0, np.int64)
        if pre_trace is not None:
            mapped = np.where(pre_trace & (stack_ids < 0), PRE_TRACE, mapped)
        return mapped

    def user_frame(self, stack_id: int) -> int:
        """The first frame outside any installed package (the training script itself), or -1."""
        if stack_id < 0:
            return -1
        for fid in self.stacks.stacks[stack_id]:
            fn = self.stacks.frames[fid][0]
            if fn.endswith(".py") and "-packages/" not in fn and not is_internal(self.stacks.frames[fid]):
                return fid
        return -1


_INDEXES: "weakref.WeakKeyDictionary[StackTable, SiteIndex]" = weakref.WeakKeyDictionary()


def per_table(cache: weakref.WeakKeyDictionary[StackTable, T], stacks: StackTable, make: Callable[[StackTable], T]) -> T:
    """``make(stacks)`` computed once per stack table and kept in ``cache`` while the table lives."""
    got = cache.get(stacks)
    if got is None:
        got = cache[stacks] = make(stacks)
    return got


_UNMATCHED: "weakref.WeakKeyDictionary[StackTable, tuple[np.ndarray | None]]" = weakref.WeakKeyDictionary()


def mark_unmatched(trace: Trace, lt: Lifetimes, rows: np.ndarray, site: np.ndarray) -> np.ndarray:
    """``site`` with :data:`UNMATCHED` for the rows whose allocation was recorded without a stack by
    ``--stack-steps`` and matched to no stacked step (the trace's matched device's lifetimes only)."""
    mask = per_table(_UNMATCHED, trace.stacks, lambda _s: (unmatched_allocations(trace),))[0]
    if mask is None or rows.size == 0:
        return site
    ev = lt.alloc[rows]
    if int(ev.max()) >= mask.shape[0]:
        return site
    hit = (ev >= 0) & mask[np.maximum(ev, 0)]
    return np.where(hit, UNMATCHED, site) if hit.any() else site


_MATCHED: "weakref.WeakKeyDictionary[StackTable, tuple[np.ndarray | None]]" = weakref.WeakKeyDictionary()


def matched_rows(trace: Trace, lt: Lifetimes, rows: np.ndarray) -> np.ndarray:
    """Per row: True where the block's stack was matched from a stacked step, not recorded
    (:func:`oomdoctor.trace.stackmatch.matched_from`)."""
    def make(_s: StackTable) -> tuple[np.ndarray | None]:
        res = trace.meta.get(META_KEY)
        if not isinstance(res, dict):
            return (None,)
        info = cast("dict[str, Any]", res)  # the sidecar's JSON object
        if info.get("device") not in trace.devices:
            return (None,)
        return (matched_from(trace, trace.devices[info["device"]]) >= 0,)
    mask = per_table(_MATCHED, trace.stacks, make)[0]
    if mask is None or rows.size == 0 or int(lt.alloc[rows].max()) >= mask.shape[0]:
        return np.zeros(rows.size, dtype=bool)
    ev = lt.alloc[rows]
    return (ev >= 0) & mask[np.maximum(ev, 0)]


def site_index(trace: Trace) -> SiteIndex:
    """The :class:`SiteIndex` of a trace's stack table (one per table, kept while the table lives)."""
    return per_table(_INDEXES, trace.stacks, SiteIndex)


@dataclass
class Site:
    """Bytes one site holds at an event. ``frame`` indexes the trace's frames (or is
    :data:`PRE_TRACE` / :data:`NO_STACK`); ``stack`` is the stack of its largest block."""

    frame: int
    bytes: int
    count: int
    stack: int
    largest_block_bytes: int


def sites_at(trace: Trace, lt: Lifetimes, k: int, *, mask: np.ndarray | None = None) -> list[Site]:
    """Sites of the blocks allocated after event ``k`` (or of the rows in ``mask``), largest first."""
    rows = np.flatnonzero(lt.allocated_mask(k) if mask is None else mask)
    return group_sites(trace, lt, rows)


def group_sites(trace: Trace, lt: Lifetimes, rows: np.ndarray, min_bytes: int = 0) -> list[Site]:
    """Group block rows by site, largest total first; sites holding less than ``min_bytes`` are left out."""
    if rows.size == 0:
        return []
    idx = site_index(trace)
    site = mark_unmatched(trace, lt, rows, idx.sites_of(lt.stack[rows], lt.start_state[rows] != IN_TRACE))
    size = lt.size[rows]
    uniq, inv = np.unique(site, return_inverse=True)
    total = np.bincount(inv, weights=size).astype(np.int64)
    count = np.bincount(inv)
    out: list[Site] = []
    for u in range(uniq.size):
        if total[u] < min_bytes:
            continue
        members = np.flatnonzero(inv == u)
        big = members[np.argmax(size[members])]
        out.append(Site(int(uniq[u]), int(total[u]), int(count[u]), int(lt.stack[rows[big]]), int(size[big])))
    return sorted(out, key=lambda s: -s.bytes)


def short_path(filename: str) -> str:
    """A frame's file as the report shows it: the part after ``site-packages/`` (or ``dist-packages/``)."""
    return filename.split("-packages/", 1)[1] if "-packages/" in filename else filename


def site_label(trace: Trace, frame: int) -> str:
    """``file.py:line in name`` with the path shortened after ``site-packages/``; special ids named."""
    if frame == PRE_TRACE:
        return "<allocated before recording started>"
    if frame == NO_STACK:
        return "<no stack recorded>"
    if frame == UNMATCHED:
        return "<recorded without a stack (--stack-steps), matched to no stacked step>"
    if frame < 0:
        return "<no stack recorded>"
    filename, line, name = trace.stacks.frames[frame]
    return f"{short_path(filename)}:{line} in {name}"


def frame_text(trace: Trace, fid: int) -> str:
    """Frame ``fid`` of the trace as ``file.py:line in name``, its path whole."""
    filename, line, name = trace.stacks.frames[fid]
    return f"{filename}:{line} in {name}"


def stack_text(trace: Trace, stack: int) -> list[str]:
    """The frames of stack ``stack`` (innermost first) as :func:`frame_text` writes them; none for ``-1`` (no stack)."""
    return [frame_text(trace, f) for f in trace.stacks.stacks[stack]] if stack >= 0 else []
