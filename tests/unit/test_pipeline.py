"""Issue 37: one path a rank takes (report/pipeline.py): analysis → predictions → decisions, each stage calling only
downward; the job merges the ranks' outcomes on every executor."""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

from builder import MiB, SnapBuilder

import oomdoctor.report.pipeline as pipeline
from oomdoctor.detectors import rank_imbalance
from oomdoctor.render.json import render_json
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
    a = pipeline.analyse(from_snapshot(snap, "rank3.pickle", dict(meta)))
    assert got.rank == 3 and [r.rank for r in got.report.ranks] == [3]
    assert render_json(got.report) == render_json(pipeline.report_of([a]))
    assert profile_to_plain(got.profile) == profile_to_plain(rank_imbalance.profile(a))
    # the stages, called one by one, are the same path
    predictors: dict = {}
    staged = pipeline.decide([a], pipeline.predict([a], predictors), predictors, micro_batch=None,
                             rule=pipeline.RankContext().rule)
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


def test_each_stage_calls_only_the_stages_below_it():
    """No function of the module calls one of a later stage: analysis (1) calls no prediction (2), predictions no
    decision (3), decisions none of the path functions (report_of, summarize_*, build_report)."""
    src = Path(pipeline.__file__).read_text()
    funcs = {n.name: n for n in ast.parse(src).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    stage = {"analyse": 1, "rank_facts": 1, "predict": 2, "_versions": 2, "defragmenting_setting": 2, "defragmenting_settings": 2,
             "_recorded_micro_batch": 2, "RankPredictions": 2, "decide_rank": 3, "decide": 3, "report_of": 4,
             "summarize_analysis": 5, "summarize_rank": 6, "build_report": 5}
    assert set(stage) == {n for n in funcs if not n.startswith("__")} - {"RankContext", "RankOutcome"}
    for name, node in funcs.items():
        if name not in stage:
            continue
        called = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        assert all(stage[c] <= stage[name] for c in called & set(stage)), (name, called & set(stage))
