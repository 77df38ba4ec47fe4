"""Folded stacks, flame trees, moments and the diff's two-runs-on-one-axis on small traces built in code."""

import pickle
import re

import numpy as np
import pytest
from builder import MiB, SnapBuilder, frames
from folded import parse_folded

from oomdoctor.analysis import analyze
from oomdoctor.analysis.accounting import CATEGORIES
from oomdoctor.cli.main import main
from oomdoctor.errors import UsageError
from oomdoctor.render.folded import render_folded
from oomdoctor.trace.load import from_snapshot
from oomdoctor.views.flame import (
    DIFF_COLORS,
    FrameTable,
    diff_tree,
    flame_tree,
    flame_view,
    folded_at,
    frame_label,
)
from oomdoctor.views.moments import moment_at, moments_per_rank, page_moments
from oomdoctor.views.overlay import pair_view, warp

MAIN = ("/work/train.py", 40, "main")
FWD = ("/venv/lib/python3.11/site-packages/model/net.py", 12, "forward")
A = frames(FWD, MAIN)              # innermost first, as snapshots list them
B = frames(("/work/train.py", 44, "backward"), MAIN)

def _trace(snap: dict, name: str = "rank0.pickle"):
    return from_snapshot(pickle.loads(pickle.dumps(snap)), name)


def _run(drop_first: int = 0) -> SnapBuilder:
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    b.alloc(s, 0, 2 * MiB, fr=B)                     # born first: lost when the first events are dropped
    x = b.alloc(s, 2 * MiB, 4 * MiB, fr=A)
    b.alloc(s, 6 * MiB, 8 * MiB, fr=A)
    b.alloc(s, 14 * MiB, 1 * MiB, fr=[])             # recorded without a stack (autograd's C++ thread)
    b.free(x)
    b.alloc(s, 16 * MiB, 3 * MiB, requested=3 * MiB - 100, fr=B)
    return b


def test_folded_at_the_peak_adds_up_root_first():
    a = analyze(_trace(_run().snapshot()))
    f = folded_at(a, moment_at(a))
    assert f.moment.kind == "peak_allocated" and f.moment.event == a.peak_allocated[1]
    got = parse_folded(render_folded(f))
    assert {";".join(p): n for p, n in got} == {
        "/work/train.py:40 main;model/net.py:12 forward": 12 * MiB,   # both A blocks at the peak
        "/work/train.py:40 main;/work/train.py:44 backward": 2 * MiB,
        "<no stack recorded>": 1 * MiB,
    }
    assert sum(n for _p, n in got) == f.allocated_bytes == a.peak_allocated[0] == 15 * MiB
    assert [p for p, _n in got] == sorted(p for p, _n in got)       # by frames, as inferno checks


def test_blocks_from_before_the_trace_sit_under_their_own_root_frame():
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    old = b.alloc(s, 0, 2 * MiB, fr=B)               # its alloc falls out of the ring buffer
    b.alloc(s, 2 * MiB, 4 * MiB, fr=A)
    b.free(old)                                      # freed in the trace: its stack is nowhere
    a = analyze(_trace(b.snapshot(drop_first=2)))
    assert a.lifetimes.truncated
    f = folded_at(a, moment_at(a, "0"))              # after the 4 MiB alloc, before the free
    assert dict((";".join(p), n) for p, n in f.stacks) == {
        "<allocated before recording started>": 2 * MiB, "/work/train.py:40 main;model/net.py:12 forward": 4 * MiB}
    assert f.allocated_bytes == int(a.timeline.allocated[0]) == 6 * MiB


def test_frame_labels_are_one_frame_to_every_reader():
    assert frame_label(FWD) == "model/net.py:12 forward"
    assert frame_label(("??", 0, "c10::foo(int, long)")) == "c10::foo(int, long)"
    assert frame_label(("memory_snapshot.cpp", 0, "gather()")) == "memory_snapshot.cpp gather()"
    evil = [("/a;b.py", 3, "f\nraise"), ("x.py", 5, "  "), ("x.py", 7, "step 12"), ("", 0, ""), ("y.py", 1, "v 1.5")]
    labels = [frame_label(f) for f in evil]
    assert labels == ["/a,b.py:3 f raise", "x.py:5", "x.py:7 step_12", "?", "y.py:1 v_1.5"]
    text = "".join(f"{';'.join(labels[:i + 1])} {i + 1}\n" for i in range(len(labels)))
    assert [n for _p, n in parse_folded(text)] == [1, 2, 3, 4, 5]
    # the guard matters: unguarded, flamegraph.pl reads "step 12 3" as two counts
    with pytest.raises(AssertionError, match="differential"):
        parse_folded("x.py:7 step 12 3\n")


def test_moments_named_by_the_user_and_their_errors():
    b = _run()
    b.oom(64 * MiB, device_free=0)
    a = analyze(_trace(b.snapshot()))
    n = a.num_events
    assert moment_at(a, "oom").event == n - 1
    assert moment_at(a, "3").event == 3
    t0 = int(a.device.events["time_us"][0])
    k = moment_at(a, "25us").event  # events are 10 µs apart: the last at or before 25 µs is event 2
    assert k == 2 and int(a.device.events["time_us"][k]) - t0 <= 25 < int(a.device.events["time_us"][k + 1]) - t0
    assert moment_at(a, "0.02ms").event == 2
    for at, msg in [("soon", "bad --at 'soon'"), (str(n), f"outside the trace's 0..{n - 1}"), ("1s", "after the trace's last"),
                    ("-1", "bad --at")]:
        with pytest.raises(UsageError, match=re.escape(msg)) as e:
            moment_at(a, at)
        assert "rank0.pickle" in str(e.value)
    with pytest.raises(UsageError, match="no OOM in this trace"):
        moment_at(analyze(_trace(_run().snapshot())), "oom")


def test_a_snapshot_without_history_has_one_moment_its_final_state():
    snap = _run().snapshot()
    snap["device_traces"] = [[]]
    a = analyze(_trace(snap))
    assert a.num_events == 0
    f = folded_at(a, moment_at(a, "peak"))
    assert f.moment.event == -1 and f.allocated_bytes == 4 * MiB + 8 * MiB + 1 * MiB + 2 * MiB + 3 * MiB - 4 * MiB
    with pytest.raises(UsageError, match="only --at peak"):
        moment_at(a, "oom")
    v = flame_view(a)
    assert len(v.moments) == 1 and v.moments[0].tree.bytes[0] == f.allocated_bytes


def test_flame_tree_nests_adds_up_and_keeps_its_budget():
    a = analyze(_trace(_run().snapshot()))
    v = flame_view(a)
    for m in v.moments:
        t = m.tree
        assert t.bytes[0] == m.allocated_bytes == a.allocated_at(m.moment.event)
        # children follow their parent in preorder and fit in it, largest first
        for i in range(1, len(t.depth)):
            parent = max(j for j in range(i) if t.depth[j] == t.depth[i] - 1)
            kids = [j for j in range(parent + 1, len(t.depth)) if t.depth[j] == t.depth[i]
                    and max(q for q in range(j) if t.depth[q] == t.depth[i] - 1) == parent]
            assert sum(t.bytes[j] for j in kids) <= t.bytes[parent]
            assert [t.bytes[j] for j in kids] == sorted((t.bytes[j] for j in kids), reverse=True)
        for i, split in t.mixed.items():
            assert sum(x for _c, x in split) == t.bytes[i] and t.category[i] == split[0][0]
    peak = next(m for m in v.moments if m.moment.kind == "peak_allocated")
    cat = a.accounting.category
    rows = np.flatnonzero(a.lifetimes.allocated_mask(peak.moment.event))
    split = {int(c): int(a.lifetimes.size[rows][cat[rows] == c].sum()) for c in np.unique(cat[rows])}
    assert dict(peak.tree.mixed.get(0, [[peak.tree.category[0], peak.tree.bytes[0]]])) == split
    assert set(v.categories) <= set(CATEGORIES)
    # a budget of 3 nodes keeps the root and its two largest children, and counts the rest
    def vec(*x):
        return np.array(list(x) + [0] * (len(CATEGORIES) - len(x)), np.int64)

    paths = {("a", "b"): vec(5), ("a", "c"): vec(3), ("d",): vec(1, 1)}
    assert flame_tree(paths, FrameTable()).bytes == [10, 8, 5, 3, 2]
    small = flame_tree(paths, FrameTable(), budget=3)  # the 3 largest nodes: root, a, a;b
    assert small.depth == [0, 1, 2] and small.bytes == [10, 8, 5] and small.left_out == 2


def test_diff_tree_is_as_wide_as_the_bytes_moved():
    frames_ = FrameTable()
    t = diff_tree({("m", "x"): 10, ("m", "y"): 4, ("z",): 6}, {("m", "x"): 3, ("m", "y"): 4, ("w",): 2}, frames_)
    label = [frames_.labels[f] if f >= 0 else "root" for f in t.frame]
    rows = {lab: (b, a, w, g) for lab, b, a, w, g in zip(label, t.before, t.after, t.moved, t.grade)}
    assert rows["root"] == (20, 9, 7 + 6 + 2, round(4 * -11 / 15))
    assert rows["m"] == (14, 7, 7, -4) and rows["x"] == (10, 3, 7, -4)
    assert rows["z"] == (6, 0, 6, -4) and rows["w"] == (0, 2, 2, 4)
    assert "y" not in rows and t.left_out == 0  # unchanged: no room, and not counted as left out
    assert t.net_bytes == 9 - 20 and len(DIFF_COLORS) == 9


def test_page_moments_are_bounded_distinct_and_name_what_coincides():
    b = _run()
    b.oom(64 * MiB, device_free=0)
    a = analyze(_trace(b.snapshot()))
    ms = page_moments(a, budget=6)
    assert len(ms) <= 6 and len({m.event for m in ms}) == len(ms)
    assert [m.event for m in ms] == sorted(m.event for m in ms)
    kinds = {m.kind for m in ms}
    assert {"oom", "peak_allocated"} <= kinds
    assert moments_per_rank(1) == 128 and moments_per_rank(4) == 64 and moments_per_rank(64) == 16


def _stepped(lengths: list[int], size: int) -> SnapBuilder:
    """A run of len(lengths) steps (ProfilerStep# annotations); step i allocates and frees lengths[i] blocks."""
    b = SnapBuilder()
    s = b.segment(64 * MiB)
    for i, n in enumerate(lengths):
        b.annotate(f"ProfilerStep#{i}", "START")
        xs = [b.alloc(s, j * size, size, fr=A) for j in range(n)]
        for x in xs:
            b.free(x)
    return b


def test_two_runs_on_one_axis_align_their_step_starts():
    before = analyze(_trace(_stepped([2, 2, 2], MiB).snapshot()))
    after = analyze(_trace(_stepped([4, 1, 3], 2 * MiB).snapshot()))
    p = pair_view(0, before, after)
    assert p.aligned_steps == 3
    for axis in (p.event, p.time):
        assert axis.x == sorted(axis.x)
        assert all(len(v) == len(axis.x) for v in axis.series.values())
        steps = {}
        for mk in axis.marks:
            if mk["kind"] == "step":
                steps.setdefault(mk["label"].split(": ")[1], set()).add(mk["x"])
        assert all(len(xs) == 1 for xs in steps.values()), steps  # each step starts at one x in both runs
        after_peak = max(v for v in axis.series["after_allocated"] if v is not None)
        assert after_peak == after.peak_allocated[0] == 8 * MiB
    # the piecewise map: anchors land on anchors, outside them a shift
    src, dst = np.array([10, 20]), np.array([100, 300])
    assert warp(np.array([5, 10, 15, 20, 25]), src, dst).tolist() == [95, 100, 200, 300, 305]
    # the difference tree compares the blocks alive at each run's peak of reserved bytes
    assert p.flame.before[0] == int(before.timeline.active[before.peak_reserved[1]])
    assert p.flame.after[0] == int(after.timeline.active[after.peak_reserved[1]])


def test_export_folded_cli(tmp_path, capsys):
    b = _run()
    b.oom(64 * MiB, device_free=0)
    f = b.write(tmp_path / "rank0.pickle")
    out = tmp_path / "m.folded"
    assert main(["export", str(f), "--format", "folded", "-o", str(out)]) == 0
    assert "bytes allocated after event" in capsys.readouterr().err
    assert sum(n for _p, n in parse_folded(out.read_text())) == 15 * MiB
    assert main(["export", str(f), "--format", "folded", "--at", "oom"]) == 0
    assert sum(n for _p, n in parse_folded(capsys.readouterr().out)) == 14 * MiB
    b2 = _run()
    b2.write(tmp_path / "rank1.pickle")
    for argv, msg in [(["--at", "nope"], "bad --at 'nope'"), (["--at", "99"], "outside the trace's"),
                      (["--format", "perfetto", "--at", "peak"], "--at applies to --format folded only")]:
        assert main(["export", str(f), "--format", "folded", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err
    assert main(["export", str(tmp_path / "rank1.pickle"), "--format", "folded", "--at", "oom"]) == 2
    assert "no OOM in this trace" in capsys.readouterr().err
    (tmp_path / "m.folded").unlink()
    assert main(["export", str(tmp_path), "--format", "folded"]) == 2
    assert "hold 2 ranks" in capsys.readouterr().err
    cut = tmp_path / "cut" / "rank0.pickle"
    cut.parent.mkdir()
    cut.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert main(["export", str(cut), "--format", "folded", "--at", "oom"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"oomdoctor: error: {cut}:"), err


def test_every_category_has_its_colour_and_a_new_one_the_neutral_one(monkeypatch):
    import oomdoctor.views.flame as fl

    assert set(CATEGORIES) <= set(fl.CATEGORY_COLORS)
    assert len(set(fl.CATEGORY_COLORS.values()) | {fl.OTHER_COLOR}) == len(fl.CATEGORY_COLORS) + 1  # all distinct
    monkeypatch.setattr(fl, "CATEGORIES", CATEGORIES + ("prefetch_buffers",))  # a line the accounting may gain
    colors = {c["name"]: c["color"] for c in fl.category_colors()}
    assert colors["prefetch_buffers"] == fl.OTHER_COLOR and colors["activations"] == fl.CATEGORY_COLORS["activations"]
