"""Live memory by call stack: folded stacks, and the flame graphs (icicles) of the HTML report.

*Folded stacks* are the text of Brendan Gregg's FlameGraph (the output of its ``stackcollapse`` scripts), which
``flamegraph.pl``, inferno and speedscope read: one line per distinct stack, its frames root first joined by
``;``, then one space and a count, here the bytes of the blocks allocated from that stack. What the three readers
parse (``flamegraph.pl``: ``/^(.*)\\s+?(\\d+(?:\\.\\d*)?)$/`` then the same again for a differential second count;
inferno: ``LineParser::parse``, the count after the last space; speedscope: ``/^(.*) (\\d+)$/``, frames split at
``;``) fixes what a frame may hold: no ``;``, no line break, not empty, and no ending of whitespace and a number,
which two of them would read as a second count. :func:`frame_label` makes every frame so. Lines are sorted by
their frames, the order inferno checks.

A frame is ``file:line function``, the file shortened as the report shortens it (after ``site-packages/``,
:func:`~oomdoctor.analysis.sites.short_path`); a C++ frame (line 0) is its function, after its file when one is
named. Blocks with no stack sit under one frame that says why, the report's site labels for them:
``<allocated before recording started>`` (the trace began after them) or ``<no stack recorded>`` (allocated in the
trace without a frame: autograd's C++ threads record none unless ``stacks="all"``, nor does ``--stacks none``).

A *flame tree* is the same stacks merged into a tree, in preorder, each node as wide as the bytes of the blocks
under it and coloured by the accounting's category holding most of them (:mod:`oomdoctor.analysis.accounting`);
a *difference tree* merges two runs' stacks and is as wide as the bytes moved under each node. Colours are chosen
here, the page only draws them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..analysis.accounting import CATEGORIES
from ..analysis.device import DeviceAnalysis
from ..analysis.fragmentation import Anatomy
from ..analysis.lifetimes import IN_TRACE
from ..analysis.sites import NO_STACK, PRE_TRACE, short_path, site_label
from ..trace.model import Frame, Trace
from .moments import Moment, page_moments

TREE_NODES = 2000
"""At most this many nodes in one flame tree of the page; the smallest are left out (and counted)."""

CATEGORY_COLORS = {
    "parameters": "#a0cbe8", "gradients": "#ffbe7d", "optimizer_state": "#d4a6c8", "activations": "#8cd17d",
    "temporaries": "#f1ce63", "communication": "#86bcb6", "outputs": "#ff9d9a", "kv_cache": "#d7b5a6",
    "workspaces": "#fabfd2", "weight_copy": "#b6992d", "buffers": "#9d7660", "unknown": "#bab0ac",
}
"""The colour of each category of the breakdown (the light half of Tableau 20, under dark text); a category not
named here gets :data:`OTHER_COLOR`."""
OTHER_COLOR = "#dcdcdc"

DIFF_COLORS = ("#6baed6", "#9ecae1", "#c6dbef", "#deebf7", "#ececec", "#fee0d2", "#fcbba1", "#fc9272", "#fb6a4a")
"""Difference trees: index 4 + g for a grade g in -4..4, blue where bytes went away, red where they came
(ColorBrewer Blues and Reds, light enough for dark text)."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")
_TRAILING_COUNT = re.compile(r"\s[\d.]+$")


def frame_label(frame: Frame) -> str:
    """One frame as folded stacks and the flame graphs show it: ``file:line function`` (file shortened after
    ``site-packages/``), or for a C++ frame (line 0) ``file function`` / ``function``. Line breaks and other
    control characters become spaces, ``;`` becomes ``,``, an ending of whitespace and a number gets ``_`` for
    its whitespace, and an empty label is ``?``: the label is one frame to every reader of the format."""
    filename, line, name = frame
    filename = short_path(filename)
    if line > 0:
        text = f"{filename}:{line} {name}"
    elif filename and filename != "??":
        text = f"{filename} {name}"
    else:
        text = name
    text = _CONTROL.sub(" ", text).replace(";", ",").strip()
    m = _TRAILING_COUNT.search(text)
    if m:
        text = f"{text[:m.start()]}_{text[m.start() + 1:]}"
    return text or "?"


class StackLabels:
    """Root-first frame labels of a trace's stacks, each computed once. Keys are stack ids, or
    :data:`~oomdoctor.analysis.sites.PRE_TRACE` / :data:`~oomdoctor.analysis.sites.NO_STACK` for blocks without
    a stack."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self._frames: dict[int, str] = {}
        self._paths: dict[int, tuple[str, ...]] = {}

    def path(self, key: int) -> tuple[str, ...]:
        got = self._paths.get(key)
        if got is None:
            fids = self.trace.stacks.stacks[key] if key >= 0 else ()
            if not fids:
                got = (site_label(self.trace, key if key < 0 else NO_STACK),)
            else:
                got = tuple(self._frame(f) for f in reversed(fids))
            self._paths[key] = got
        return got

    def _frame(self, fid: int) -> str:
        got = self._frames.get(fid)
        if got is None:
            got = self._frames[fid] = frame_label(self.trace.stacks.frames[fid])
        return got


def stack_keys(a: DeviceAnalysis, rows: np.ndarray) -> np.ndarray:
    """The stack key of each lifetime row: its stack id, else :data:`PRE_TRACE` for a block born before the
    trace, else :data:`NO_STACK` (as :meth:`~oomdoctor.analysis.sites.SiteIndex.sites_of` groups them)."""
    lt = a.lifetimes
    st = lt.stack[rows].astype(np.int64)
    return np.where(st >= 0, st, np.where(lt.start_state[rows] != IN_TRACE, PRE_TRACE, NO_STACK))


def bytes_by_path(a: DeviceAnalysis, rows: np.ndarray, labels: StackLabels,
                  categories: bool = False) -> dict[tuple[str, ...], np.ndarray]:
    """Block bytes of the lifetime ``rows`` per distinct frame path (root first): an array of shape
    ``(len(CATEGORIES),)`` per path, split by the accounting's category when ``categories``, else all in slot 0.
    Stacks whose labels coincide are one path. The arrays add up to the rows' bytes."""
    keys = stack_keys(a, rows)
    cats = a.accounting.category[rows].astype(np.int64) if categories else np.zeros(rows.size, np.int64)
    ncat = len(CATEGORIES)
    combo, inv = np.unique(keys * ncat + cats, return_inverse=True)
    total = np.bincount(inv, weights=a.lifetimes.size[rows], minlength=combo.size).astype(np.int64)
    out: dict[tuple[str, ...], np.ndarray] = {}
    for c, b in zip(combo.tolist(), total.tolist()):
        key, cat = divmod(c, ncat)
        vec = out.setdefault(labels.path(key), np.zeros(ncat, np.int64))
        vec[cat] += b
    return out


@dataclass
class Folded:
    """Bytes allocated at ``moment`` by stack: ``stacks`` are ``(frames root first, bytes)``, one per distinct
    frame path, sorted by frames; they add up to ``allocated_bytes``, the timeline's allocated bytes then
    (asserted)."""

    path: str
    rank: int
    moment: Moment
    allocated_bytes: int
    stacks: list[tuple[tuple[str, ...], int]]


def folded_at(a: DeviceAnalysis, moment: Moment) -> Folded:
    """The folded stacks of the blocks allocated at ``moment`` (bytes: block sizes, the allocator's rounding
    included, as the allocated counter counts them)."""
    rows = np.flatnonzero(a.lifetimes.allocated_mask(moment.event))
    by = bytes_by_path(a, rows, StackLabels(a.trace))
    stacks = sorted((p, int(v.sum())) for p, v in by.items())
    out = Folded(a.trace.path, a.rank, moment, a.allocated_at(moment.event), [s for s in stacks if s[1]])
    assert sum(b for _p, b in out.stacks) == out.allocated_bytes, (moment, out.allocated_bytes)
    return out


class _Node:
    __slots__ = ("children", "vec")

    def __init__(self, width: int) -> None:
        self.children: dict[str, _Node] = {}
        self.vec = np.zeros(width, np.int64)


def _trie(paths: dict[tuple[str, ...], np.ndarray], width: int) -> _Node:
    root = _Node(width)
    for path, vec in paths.items():
        node = root
        root.vec += vec
        for label in path:
            node = node.children.setdefault(label, _Node(width))
            node.vec += vec
    return root


def _preorder(root: _Node, size, budget: int) -> tuple[list[tuple[int, str | None, _Node]], int]:
    """``(depth, label, node)`` in preorder, children largest first by ``size(node)``: the root and, of the nodes
    with a positive size, the ``budget - 1`` largest (a node is never larger than its parent, so what is kept is
    a tree); also how many of those with a positive size were left out."""
    sizes: list[int] = []
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        if size(node) > 0:
            sizes.append(size(node))
        stack.extend(node.children.values())
    room = budget - 1
    cut = sorted(sizes, reverse=True)[room - 1] if len(sizes) > room else 0
    ties = room - sum(1 for s in sizes if s > cut)
    out: list[tuple[int, str | None, _Node]] = []
    todo: list[tuple[int, str | None, _Node]] = [(0, None, root)]
    while todo:
        depth, label, node = todo.pop()
        s = size(node)
        if depth and (s <= 0 or s < cut or (s == cut and ties <= 0)):
            continue
        if depth and s == cut:
            ties -= 1
        out.append((depth, label, node))
        kids = sorted(node.children.items(), key=lambda kv: (-size(kv[1]), kv[0]))
        todo.extend((depth + 1, lab, child) for lab, child in reversed(kids))
    return out, len(sizes) - (len(out) - 1)


class FrameTable:
    """Frame labels shared by the trees of one page section: each label stored once, trees refer to indices."""

    def __init__(self) -> None:
        self.labels: list[str] = []
        self._ids: dict[str, int] = {}

    def id(self, label: str | None) -> int:
        if label is None:
            return -1
        got = self._ids.get(label)
        if got is None:
            got = self._ids[label] = len(self.labels)
            self.labels.append(label)
        return got


@dataclass
class FlameTree:
    """An icicle in preorder. Node ``i`` has ``depth[i]`` (0: the root), ``frame[i]`` (index into the frame
    table; -1 for the root), ``bytes[i]`` (its blocks and its descendants'), ``category[i]`` (index into
    :data:`~oomdoctor.analysis.accounting.CATEGORIES`: the one holding most of its bytes) and, where its bytes are
    of several categories, ``mixed[i] = [[category, bytes], ...]`` largest first. Children follow their parent,
    largest first; their bytes add up to at most the parent's (the rest are blocks allocated in that frame
    itself). ``left_out`` counts the smallest nodes not kept (:data:`TREE_NODES`)."""

    depth: list[int]
    frame: list[int]
    bytes: list[int]
    category: list[int]
    mixed: dict[int, list[list[int]]] = field(default_factory=dict)
    left_out: int = 0


def flame_tree(paths: dict[tuple[str, ...], np.ndarray], frames: FrameTable, budget: int = TREE_NODES) -> FlameTree:
    """The icicle of ``paths`` (from :func:`bytes_by_path` with categories)."""
    root = _trie(paths, len(CATEGORIES))
    nodes, left = _preorder(root, lambda n: int(n.vec.sum()), budget)
    tree = FlameTree([], [], [], [], left_out=left)
    for i, (depth, label, node) in enumerate(nodes):
        tree.depth.append(depth)
        tree.frame.append(frames.id(label))
        tree.bytes.append(int(node.vec.sum()))
        tree.category.append(int(np.argmax(node.vec)))
        held = np.flatnonzero(node.vec)
        if held.size > 1:
            tree.mixed[i] = [[int(c), int(node.vec[c])] for c in held[np.argsort(-node.vec[held], kind="stable")]]
    return tree


@dataclass
class FlameMoment:
    """One moment of a rank's flame graph: the tree of the blocks allocated then (its root's bytes are
    ``allocated_bytes``, the timeline's, asserted) and the fragmentation anatomy then."""

    moment: Moment
    allocated_bytes: int
    anatomy: Anatomy
    tree: FlameTree


@dataclass
class FlameView:
    """A rank's flame graphs at :func:`~oomdoctor.views.moments.page_moments`: ``frames`` is the label table
    of all its trees; ``shown`` are the indices of the moments offered as buttons (OOMs and peaks), the first one
    drawn when the page opens (the last OOM where there is one, else the peak of allocated bytes); ``categories``
    the categories any tree holds, in :data:`CATEGORIES` order, for the legend."""

    frames: list[str]
    moments: list[FlameMoment]
    shown: list[int]
    categories: list[str]


def category_colors() -> list[dict[str, str]]:
    """The legend and palette of the flame graphs, by category index: ``name``, ``label``, ``color``."""
    return [{"name": c, "label": c.replace("_", " "), "color": CATEGORY_COLORS.get(c, OTHER_COLOR)}
            for c in CATEGORIES]


def flame_view(a: DeviceAnalysis, moments: list[Moment] | None = None, budget: int = TREE_NODES) -> FlameView:
    """The flame graphs of one rank at ``moments`` (default :func:`page_moments`)."""
    moments = page_moments(a) if moments is None else moments
    labels, frames = StackLabels(a.trace), FrameTable()
    out, seen = [], np.zeros(len(CATEGORIES), bool)
    for m in moments:
        rows = np.flatnonzero(a.lifetimes.allocated_mask(m.event))
        tree = flame_tree(bytes_by_path(a, rows, labels, categories=True), frames, budget)
        allocated = a.allocated_at(m.event)
        assert tree.bytes[0] == allocated, (m, tree.bytes[0], allocated)
        seen[a.accounting.category[rows]] = True
        out.append(FlameMoment(m, allocated, a.anatomy_at(m.event), tree))
    kinds = [m.kind for m in moments]
    named = [i for i, k in enumerate(kinds) if k in ("oom", "peak_allocated", "peak_reserved")]
    ooms = [i for i in named if kinds[i] == "oom"]
    first = ooms[-1] if ooms else kinds.index("peak_allocated") if "peak_allocated" in kinds else 0
    shown = [first] + [i for i in named if i != first]
    return FlameView(frames.labels, out, shown, [c for i, c in enumerate(CATEGORIES) if seen[i]])


@dataclass
class DiffTree:
    """Two runs' stacks merged, in preorder (``depth``, ``frame`` as in :class:`FlameTree`): ``before[i]`` and
    ``after[i]`` are node ``i``'s bytes in each run, ``moved[i]`` its width: the sum over the distinct stacks
    under it of ``|after - before|``, so children fit in their parent and unchanged stacks take no room.
    ``grade[i]`` in -4..4 is ``round(4 * (after - before) / moved)``: -4 where every byte under the node went
    away, 4 where every one came (index ``grade + 4`` into :data:`DIFF_COLORS`)."""

    depth: list[int]
    frame: list[int]
    before: list[int]
    after: list[int]
    moved: list[int]
    grade: list[int]
    left_out: int = 0

    @property
    def net_bytes(self) -> int:
        """After minus before, over all stacks (the root's)."""
        return self.after[0] - self.before[0]


def diff_tree(before: dict[tuple[str, ...], int], after: dict[tuple[str, ...], int], frames: FrameTable,
              budget: int = TREE_NODES) -> DiffTree:
    """The difference tree of two runs' bytes by frame path."""
    paths = {p: np.array([before.get(p, 0), after.get(p, 0), abs(after.get(p, 0) - before.get(p, 0))], np.int64)
             for p in before.keys() | after.keys()}
    root = _trie(paths, 3)
    nodes, left = _preorder(root, lambda n: int(n.vec[2]), budget)
    tree = DiffTree([], [], [], [], [], [], left_out=left)
    for depth, label, node in nodes:
        b, a, moved = (int(x) for x in node.vec)
        tree.depth.append(depth)
        tree.frame.append(frames.id(label))
        tree.before.append(b)
        tree.after.append(a)
        tree.moved.append(moved)
        tree.grade.append(round(4 * (a - b) / moved) if moved else 0)
    return tree


def alive_by_path(a: DeviceAnalysis, k: int) -> dict[tuple[str, ...], int]:
    """Bytes of the blocks alive after event ``k`` (allocated, or freed and awaiting a deferred free: what
    ``diff`` compares at the peak of reserved) by frame path; they add up to the active bytes then."""
    rows = np.flatnonzero(a.lifetimes.alive_mask(k))
    return {p: int(v.sum()) for p, v in bytes_by_path(a, rows, StackLabels(a.trace)).items()}
