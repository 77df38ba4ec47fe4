"""Folded stacks, flame graphs and the diff's one-axis view on the real H200 snapshots of ``shared/snapshots``."""

import json
from pathlib import Path

from folded import parse_folded

from oomdoctor import load
from oomdoctor.analysis import analyze
from oomdoctor.cli.main import main
from oomdoctor.views.flame import flame_view
from oomdoctor.views.overlay import pair_view

# Files whose peak of allocated bytes PyTorch's own counter saw too (stats.jsonl's max_allocated, read at the
# end of the run that recorded them): (file, tag, rank).
PEAKS_SEEN_BY_TORCH = [
    ("tp-allreduce/legacy-rank0.pickle", "tp-legacy-b4096", 0),
    ("tp-allreduce/legacy-rank1.pickle", "tp-legacy-b4096", 1),
    ("tp-allreduce/legacy-expandable-rank0.pickle", "tp-legacy-expandable-b4096", 0),
    ("tp-allreduce/modern-rank0.pickle", "tp-modern-b4096", 0),
    ("tp-allreduce/noallreduce-rank0.pickle", "tp-none-b4096", 0),
    ("fragmentation-oom/default-oom.pickle", "frag-default", 0),
    ("fragmentation-oom/expandable-end.pickle", "frag-expandable", 0),
    ("fsdp2-gpt2/rank0.pickle", "gpt2-fsdp2", 0),
    ("pp-microbatch/return-outputs-rank0.pickle", "pp-m8-ret1", 0),
    ("pp-microbatch/return-outputs-rank1.pickle", "pp-m8-ret1", 1),
]


def _all_snapshots(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.name.endswith((".pickle", ".pickle.xz")))


def _export(path: Path, at: str, out: Path) -> list[tuple[list[str], int]]:
    assert main(["export", str(path), "--format", "folded", "--at", at, "-o", str(out)]) == 0
    return parse_folded(out.read_text())


def test_folded_export_sums_to_the_allocated_bytes_on_every_shared_snapshot(snapshots, tmp_path, capsys):
    files = _all_snapshots(snapshots)
    assert len(files) >= 21
    out = tmp_path / "stacks.folded"
    for f in files:
        a = analyze(load(f))
        alloc = a.timeline.allocated  # the counter, summed event by event
        t0 = int(a.device.events["time_us"][0])
        mid = a.num_events // 2
        moments = {"peak": int(alloc.argmax()), str(mid): mid}
        if a.oom_events.size:
            moments["oom"] = int(a.oom_events[-1])
        span_ms = (int(a.device.events["time_us"][-1]) - t0) // 2000
        moments[f"{span_ms}ms"] = int((a.device.events["time_us"] - t0 <= span_ms * 1000).sum()) - 1
        for at, k in moments.items():
            stacks = _export(f, at, out)
            assert sum(n for _p, n in stacks) == int(alloc[k]), (f, at)
            assert len({tuple(p) for p, _n in stacks}) == len(stacks)  # one line per distinct stack
            assert f"after event {k} " in capsys.readouterr().err
    for name, tag, rank in PEAKS_SEEN_BY_TORCH:
        row = next(json.loads(x) for x in (snapshots / name).parent.joinpath("stats.jsonl").read_text().splitlines()
                   if json.loads(x)["tag"] == tag and json.loads(x)["rank"] == rank)
        assert sum(n for _p, n in _export(snapshots / name, "peak", out)) == row["max_allocated"], name


def test_the_folded_frames_read_as_the_report_shortens_them(snapshots, tmp_path):
    stacks = _export(snapshots / "fsdp2-gpt2" / "rank0.pickle", "peak", tmp_path / "f.folded")
    frames = {fr for p, _n in stacks for fr in p}
    assert "transformers/models/gpt2/modeling_gpt2.py:305 forward" in frames  # after site-packages/
    rooted = [p for p, _n in stacks if any(fr.endswith(" <module>") for fr in p)]
    assert len(rooted) == 23 and all(p[0] == "/workspace/lab/gpt2_fsdp.py:44 <module>" for p in rooted)  # root first
    # a backward hook's stack starts in the autograd engine's thread, at the hook
    assert any(p[0].endswith("_fsdp_state.py:307 _pre_backward") for p, _n in stacks)
    no_stack = dict((p[0], n) for p, n in stacks if len(p) == 1)
    assert set(no_stack) == {"<no stack recorded>"}  # autograd's engine thread records no Python frame
    # C++ stacks: native frames are their function (with their file when the snapshot names one)
    cpp = _export(snapshots / "tp-allreduce" / "legacy-cppstacks-rank0.pickle", "peak", tmp_path / "c.folded")
    assert any("at::native::" in fr and ":0 " not in fr for p, _n in cpp for fr in p)


def test_flame_graphs_of_the_report_at_every_moment(snapshots):
    a = analyze(load(snapshots / "fragmentation-oom" / "default-oom.pickle"))
    v = flame_view(a)
    assert 64 <= len(v.moments) <= 128
    assert [v.moments[i].moment.kind for i in v.shown] == ["oom", "peak_reserved", "peak_allocated"]
    for m in v.moments:
        assert m.tree.bytes[0] == int(a.timeline.allocated[m.moment.event]) == m.allocated_bytes
        assert m.anatomy.event_index == m.moment.event and m.tree.left_out == 0
    assert {"activations", "gradients"} <= set(v.categories)


def test_diff_pairs_align_steps_and_move_the_pending_frees(snapshots):
    tp = snapshots / "tp-allreduce"
    before, after = analyze(load(tp / "legacy-rank0.pickle")), analyze(load(tp / "modern-rank0.pickle"))
    p = pair_view(0, before, after)
    t = p.flame
    assert t.before[0] == int(before.timeline.active[before.peak_reserved[1]])
    assert t.after[0] == int(after.timeline.active[after.peak_reserved[1]])
    forward = [i for i, f in enumerate(t.frame) if f >= 0 and p.frames[f] == "/workspace/lab/tp_legacy.py:32 forward"]
    assert forward and min(t.after[i] - t.before[i] for i in forward) < -1600 * 2**20  # the all-reduce's inputs
    ddp = pair_view(0, analyze(load(snapshots / "ddp-imbalance" / "rank0.pickle")),
                    analyze(load(snapshots / "ddp-clean" / "rank0.pickle")))
    assert ddp.aligned_steps == 12
    steps = {}
    for mk in ddp.event.marks:
        if mk["kind"] == "step":
            steps.setdefault(mk["label"].split(": ")[1], set()).add(mk["x"])
    assert len(steps) == 12 and all(len(x) == 1 for x in steps.values())
