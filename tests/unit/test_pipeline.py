"""Issue 37: one path a rank takes (report/pipeline.py): analysis → predictions → decisions, each stage calling only
downward; the job merges the ranks' outcomes on every executor."""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

from builder import MiB, SnapBuilder

import oomdoctor.report.pipeline as pipeline
from oomdoctor.analysis import device
from oomdoctor.analysis.device import analyze
from oomdoctor.detectors import rank_imbalance
from oomdoctor.render.json import render_json
from oomdoctor.report import decide as decide_module
from oomdoctor.report import detect as detect_module
from oomdoctor.report import rank_predictions
from oomdoctor.report.decide import decide
from oomdoctor.report.detect import detect
from oomdoctor.report.job import Want, job_report, read_ranks
from oomdoctor.report.merge import merge_reports
from oomdoctor.report.serial import profile_to_plain
from oomdoctor.trace.load import from_snapshot, load_ranks


def _snap(extra: int, oom: bool) -> dict:
    b = SnapBuilder()
    s = b.segment(512 * MiB)
    x = b.alloc(s, 0, 256 * MiB)
    if extra:
        e = b.segment(extra)
        b.alloc(e, 0, extra)
    if oom:
        b.oom(512 * MiB, device_free=0)
    b.free(x)
    return b.snapshot()


def test_summarize_rank_is_the_rank_judged_alone_with_its_profile():
    meta = {"rank": 3, "gpu_total_memory_bytes": 900 * MiB, "micro_batch": 4}
    snap = _snap(300 * MiB, oom=True)
    got = pipeline.summarize_rank(from_snapshot(snap, "rank3.pickle", dict(meta)))
    a = analyze(from_snapshot(snap, "rank3.pickle", dict(meta)))
    assert got.rank == 3 and [r.rank for r in got.report.ranks] == [3]
    assert render_json(got.report) == render_json(pipeline.report_of([a]))
    assert profile_to_plain(got.profile) == profile_to_plain(rank_imbalance.profile(a))
    # the stages, called one by one, are the same path
    predictors: dict = {}
    staged = decide([a], detect([a], predictors), predictors, micro_batch=None, rule=pipeline.RankContext().rule)
    assert render_json(staged) == render_json(got.report)
    assert got.report.ranks[0].oom is not None and got.report.ranks[0].verdict.kind == "capacity"


def test_the_outcomes_merge_to_the_report_of_all_ranks_at_once_on_every_executor(tmp_path):
    d = tmp_path / "job"
    d.mkdir()
    for r in range(4):
        (d / f"rank{r}.pickle").write_bytes(pickle.dumps(_snap(400 * MiB if r == 2 else 2 * MiB * r, oom=False)))
        (d / f"rank{r}.meta.json").write_text(json.dumps({"rank": r, "gpu_total_memory_bytes": 900 * MiB}))
    traces = load_ranks([str(d)], skipped=[])
    at_once = render_json(pipeline.build_report(traces))
    outcomes = [pipeline.summarize_rank(t) for t in traces]
    merged = render_json(merge_reports([o.report for o in outcomes], [o.profile for o in outcomes], in_job=False))
    serial = render_json(job_report(read_ranks([str(d)], Want(), jobs=1)))
    pooled = render_json(job_report(read_ranks([str(d)], Want(), jobs=2)))
    assert merged == serial == pooled == at_once
    assert [f["id"] for f in json.loads(merged)["findings"]] == ["rank-imbalance"]


STAGES = [device, detect_module, rank_predictions, decide_module]  # in order: 1, 2, 2 (on demand), 3


def _imports(module) -> set[str]:
    """The modules of the package that ``module`` imports, at any depth of its code (relative names resolved)."""
    tree = ast.parse(Path(module.__file__).read_text())
    pkg = module.__name__.rsplit(".", 1)[0]
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module is not None:
            base = pkg.rsplit(".", n.level - 1)[0] if n.level > 1 else pkg
            name = f"{base}.{n.module}" if n.level else n.module
            out |= {name} | {f"{name}.{a.name}" for a in n.names}
    return {m for m in out if m.startswith("oomdoctor.")}


def test_each_stage_is_a_module_that_calls_only_the_stages_below_it():
    """pipeline.py holds the path only (its functions call the stages' modules, never a stage function of its own);
    each stage's module imports no later stage and not the pipeline."""
    src = Path(pipeline.__file__).read_text()
    defined = {n.name for n in ast.parse(src).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert defined == {"RankContext", "RankOutcome", "report_of", "summarize_analysis", "summarize_rank",
                       "build_report"}
    names = [m.__name__ for m in STAGES]
    for i, m in enumerate(STAGES):
        got = _imports(m)
        assert pipeline.__name__ not in got, m.__name__
        later = set(names[i + 1:]) - ({rank_predictions.__name__} if m is detect_module else set())
        assert not got & later, (m.__name__, got & later)
    assert rank_predictions.__name__ in _imports(decide_module) and detect_module.__name__ not in _imports(
        decide_module)
