"""Issue 27: a job's ranks read in parallel (process pool, Dask), merged, grouped like a job."""

from __future__ import annotations

import json
import pickle

import pytest
from builder import MiB, SnapBuilder

from oomdoctor.analysis.device import analyze
from oomdoctor.cli.main import main
from oomdoctor.render.json import render_json
from oomdoctor.report.job import Want, job_report, read_ranks
from oomdoctor.report.pipeline import report_of
from oomdoctor.trace import load_ranks


def _rank(extra: int, oom: bool = False) -> dict:
    b = SnapBuilder()
    s = b.segment(512 * MiB)
    x = b.alloc(s, 0, 256 * MiB)
    y = b.alloc(s, 256 * MiB, 128 * MiB)
    b.free(y)
    if extra:
        e = b.segment(extra)
        b.alloc(e, 0, extra)
    if oom:
        b.oom(512 * MiB, device_free=0)
    b.free(x)
    return b.snapshot()


def _job(tmp_path, n: int, odd: int | None = None, odd_extra: int = 512 * MiB, oom: bool = False):
    d = tmp_path / f"job{n}"
    d.mkdir()
    for r in range(n):
        extra = odd_extra if r == odd else 2 * MiB * (r % 2)
        (d / f"rank{r}.pickle").write_bytes(pickle.dumps(_rank(extra, oom=oom and r == odd)))
        (d / f"rank{r}.meta.json").write_text(json.dumps({"rank": r, "gpu_total_memory_bytes": 900 * MiB}))
    return d


def _old(d) -> str:
    return render_json(report_of([analyze(t) for t in load_ranks([str(d)], skipped=[])]))


def test_parallel_serial_and_all_at_once_give_the_same_report(tmp_path):
    d = _job(tmp_path, 10, odd=7)
    old = _old(d)
    serial = render_json(job_report(read_ranks([str(d)], Want(), jobs=1)))
    pooled = render_json(job_report(read_ranks([str(d)], Want(), jobs=2)))
    assert serial == pooled == old
    doc = json.loads(pooled)
    assert [r["rank"] for r in doc["ranks"]] == list(range(10))
    assert [f["id"] for f in doc["findings"]] == ["rank-imbalance"] and doc["findings"][0]["ranks"] == [7]


def test_the_ranks_summaries_share_one_copy_of_what_they_have_in_common(tmp_path):
    """Each worker's summary arrives with its own copies of file names, frames and labels; the parent keeps
    one (report/job.py share): 512 ranks' peak RSS went from 1.89x to 1.19x the 8-rank figure."""
    d = _job(tmp_path, 4)
    results = read_ranks([str(d)], Want(), jobs=2)
    keys = [next(iter(r.profile.sites_at_peak)) for r in results]
    assert len(set(keys)) == 1 and all(k is keys[0] for k in keys)
    stacks = [r.profile.sites_at_peak[keys[0]].ref.stack for r in results]
    assert stacks[0] and all(s == stacks[0] and s[0] is stacks[0][0] for s in stacks)
    paths = [r.report.ranks[0].path for r in results]
    assert len(set(paths)) == 4  # what differs stays apart
    assert render_json(job_report(results)) == _old(d)


def test_an_oom_rank_holding_the_excess_is_imbalance_after_the_merge_too(tmp_path):
    d = _job(tmp_path, 4, odd=2, odd_extra=640 * MiB, oom=True)
    old = json.loads(_old(d))
    new = json.loads(render_json(job_report(read_ranks([str(d)], Want(), jobs=2))))
    assert old["verdict"]["kind"] == "imbalance" and old["verdict"]["ranks"] == [2]
    assert new["verdict"] == old["verdict"]
    assert new["ranks"][2]["verdict"] == old["ranks"][2]["verdict"]
    # the rank judged alone computed what fits for its capacity verdict, and keeps it
    assert new["ranks"][2].pop("fits")["room_bytes"] == old["ranks"][2].pop("fits")["room_bytes"]
    assert new == old


def test_alike_ranks_collapse_and_the_odd_rank_comes_first(tmp_path, capsys, monkeypatch):
    d = _job(tmp_path, 12, odd=5)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["diagnose", str(d), "--jobs", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) < 80 and max(map(len, lines)) <= 80
    named = next(i for i, x in enumerate(lines) if x.startswith("odd ranks: "))
    assert named < 20 and lines[named].startswith("odd ranks: 5 (verdict imbalance (the others: healthy)")
    assert any("ranks 0–4, 6–11 alike: healthy" in x for x in lines)
    text = " ".join(lines)
    assert "min 512.00 MiB (rank 0)" in text and "(rank 5)" in text.split("max ")[-1]
    groups = json.loads(render_json(job_report(read_ranks([str(d)], Want(), jobs=1))))["groups"]
    assert [g["ranks"] for g in groups["groups"]] == [[5], [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]]
    assert groups["groups"][0]["odd"] and not groups["groups"][1]["odd"]
    assert groups["max"]["rank"] == 5
    assert main(["diagnose", str(d), "--all-ranks"]) == 0
    full = capsys.readouterr().out
    assert {f"rank {r}:" for r in range(12)} <= {x.split(" ")[0] + " " + x.split(" ")[1] for x in full.splitlines()
                                                if x.startswith("rank ")}


def test_a_file_that_does_not_load_is_named_and_the_others_go_on(tmp_path, capsys):
    d = _job(tmp_path, 3)
    (d / "rank9.pickle").write_bytes(b"\x80\x04not a pickle")
    assert main(["diagnose", str(d), "--format", "json", "--jobs", "2"]) == 0
    out = capsys.readouterr()
    assert [r["rank"] for r in json.loads(out.out)["ranks"]] == [0, 1, 2]
    assert "rank9.pickle" in out.err
    assert main(["diagnose", str(d / "rank9.pickle"), "--jobs", "2"]) == 2


def test_the_page_of_a_big_job_has_the_heatmap_and_few_rank_sections(tmp_path):
    d = _job(tmp_path, 10, odd=3)
    out = tmp_path / "r.html"
    assert main(["report", str(d), "-o", str(out), "--jobs", "2"]) == 0
    page = out.read_text()
    assert "data-heatmap" in page and "Ranks, grouped" in page
    data = json.loads(page.split('id="oomdoctor-data" type="application/json">')[1].split("</script>")[0])
    assert data["heat"]["ranks"] == list(range(10)) and len(data["heat"]["values"]) == 10
    assert max(max(r) for r in data["heat"]["values"]) == 255
    assert len(data["views"]) == 2  # the odd rank and one of the typical group


def test_diff_and_export_in_parallel_equal_one_process(tmp_path, capsys):
    a, b = _job(tmp_path, 3), _job(tmp_path, 4, odd=1)
    outs = []
    for j in ("1", "2"):
        assert main(["diff", str(a), str(b), "--format", "json", "--jobs", j]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert "rank 3 is only in the after run" in outs[0]
    outs = []
    for j in ("1", "2"):
        assert main(["export", str(b), "--jobs", j]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and len(json.loads(outs[0])["traceEvents"]) > 20


def test_dask_gives_the_json_of_the_default_executor(tmp_path, capsys):
    pytest.importorskip("distributed")
    d = _job(tmp_path, 3, odd=1)
    assert main(["diagnose", str(d), "--format", "json"]) == 0
    default = capsys.readouterr().out
    assert main(["diagnose", str(d), "--format", "json", "--executor", "dask"]) == 0
    assert capsys.readouterr().out == default


def test_dask_missing_or_a_scheduler_without_dask_is_one_line(tmp_path, capsys, monkeypatch):
    d = _job(tmp_path, 2)
    assert main(["diagnose", str(d), "--scheduler", "tcp://127.0.0.1:1"]) == 2
    assert "--scheduler applies to --executor dask only" in capsys.readouterr().err
    import builtins

    real = builtins.__import__

    def no_dask(name, *a, **k):
        if name == "distributed":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_dask)
    assert main(["diagnose", str(d), "--executor", "dask"]) == 2
    assert "pip install distributed" in capsys.readouterr().err
