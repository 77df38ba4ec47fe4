"""``--fail-on``: the CI gate of ``diagnose`` and ``report`` (report/gate.py), on real snapshots."""

from __future__ import annotations

import pytest

from oomdoctor.cli.main import main
from oomdoctor.render.words.gate import why_failed
from oomdoctor.report.gate import gate as decide
from oomdoctor.report.pipeline import build_report
from oomdoctor.trace import load_ranks


def gate(report, levels):
    """Why ``report`` fails at ``levels``, in words (one line), or None when it passes."""
    g = decide(report, levels)
    return why_failed(g) if g.failed else None


@pytest.fixture(scope="module")
def demo_report():
    from oomdoctor.cli.diagnose import demo_path

    return build_report(load_ranks([demo_path()], skipped=[]))


def test_the_demo_fails_at_its_findings_severity_and_passes_above(demo_report):
    # the demo (tp-allreduce, legacy record_stream): one deferred-free finding, HIGH, and that verdict
    assert [(f.id, f.severity) for f in demo_report.findings] == [("deferred-free", "high")]
    assert gate(demo_report, "low") and gate(demo_report, "medium") and gate(demo_report, "high")
    assert "deferred-free HIGH" in gate(demo_report, "high")
    assert gate(demo_report, "critical") is None
    assert gate(demo_report, "unhealthy") == "the verdict is deferred-free (rank 0)"


def test_a_healthy_job_passes_every_level(snapshots):
    r = build_report(load_ranks([str(snapshots / "ddp-clean")], skipped=[]))
    assert r.verdict.kind == "healthy" and not r.findings
    assert all(gate(r, lvl) is None for lvl in ("low", "medium", "high", "critical", "unhealthy"))


def test_a_medium_finding_on_a_healthy_rank_fails_up_to_medium_and_not_unhealthy(snapshots):
    # all_gather into a list: a MEDIUM finding, and the rank ran (healthy verdict)
    r = build_report(load_ranks([str(snapshots / "allgather" / "list-rank0.pickle")], skipped=[]))
    assert [(f.id, f.severity) for f in r.findings] == [("allgather-list", "medium")]
    assert r.verdict.kind == "healthy"
    assert gate(r, "medium") == "1 finding at or above medium: allgather-list MEDIUM"
    assert gate(r, "low") == "1 finding at or above low: allgather-list MEDIUM"
    assert gate(r, "high") is None and gate(r, "unhealthy") is None


def test_an_unknown_level_raises(demo_report):
    with pytest.raises(ValueError, match="unknown --fail-on level"):
        gate(demo_report, "severe")
    with pytest.raises(ValueError, match="no --fail-on level"):
        gate(demo_report, ())


def test_several_levels_fail_when_any_does_and_the_lowest_severity_counts(demo_report):
    assert gate(demo_report, ("critical", "unhealthy")) == "the verdict is deferred-free (rank 0)"
    assert gate(demo_report, ("critical", "high")) == "1 finding at or above high: deferred-free HIGH"
    g = decide(demo_report, ("unhealthy", "medium"))
    assert g.verdict == ("deferred-free", [0]) and g.findings == [("deferred-free", "high")] and g.floor == "medium"
    assert decide(demo_report, "critical").passed_findings == []  # a severity level asked: nothing to point out


@pytest.mark.parametrize("level,code", [("high", 1), ("critical", 0), ("unhealthy", 1)])
def test_the_cli_exit_code_follows_the_gate_after_writing_the_report(tmp_path, capsys, level, code):
    out = tmp_path / "d.json"
    assert main(["diagnose", "--demo", "--format", "json", "-o", str(out), "--fail-on", level]) == code
    assert out.stat().st_size > 0  # written before the gate decides
    err = capsys.readouterr().err
    assert (f"--fail-on {level}:" in err) == bool(code)
    page = tmp_path / "r.html"
    assert main(["report", "--demo", "-o", str(page), "--fail-on", level]) == code
    assert page.stat().st_size > 0


def test_without_fail_on_findings_never_change_the_exit_code(capsys):
    assert main(["diagnose", "--demo", "--format", "json"]) == 0


# --- a rank that cannot be read makes the job incomplete, and the gate fails (issue 52) -------------------------

def _two_ranks(tmp_path, broken: bytes | None = None, name: str = "rank0.pickle"):
    """A directory of two ranks of the demo job (the demo's snapshot as rank 1, and ``broken`` as ``name``: by
    default the same file cut in half, as a rank that crashed leaves its dump)."""
    import shutil

    from oomdoctor.cli.diagnose import demo_path

    d = tmp_path / "job"
    d.mkdir()
    shutil.copy(demo_path(), d / "rank1.pickle")
    data = (d / "rank1.pickle").read_bytes()
    (d / name).write_bytes(data[: len(data) // 2] if broken is None else broken)
    return d


def _unsafe_pickle() -> bytes:
    """A pickle whose unpickling would call os.system (protocol 2: GLOBAL + REDUCE); nothing here runs it."""
    return b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03."


@pytest.mark.parametrize("level", ["low", "medium", "high", "critical", "unhealthy"])
def test_a_truncated_rank_file_fails_every_gate_and_is_named(tmp_path, capsys, level):
    d = _two_ranks(tmp_path)
    assert main(["diagnose", str(d), "--fail-on", level]) == 1
    out, err = capsys.readouterr()
    assert "1 of 2 ranks read" in out.splitlines()[0]
    assert f"--fail-on {level}:" in err and "rank0.pickle" in err and "rank 0" in err


def test_a_truncated_rank_file_is_listed_under_unread_in_the_json(tmp_path, capsys):
    import json

    d = _two_ranks(tmp_path)
    assert main(["diagnose", str(d), "--format", "json"]) == 0  # no gate asked: the report, exit 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"] == [str(d / "rank1.pickle")]
    assert [(u["path"], u["rank"]) for u in doc["unread"]] == [(str(d / "rank0.pickle"), 0)]
    assert "truncated" in doc["unread"][0]["reason"]
    assert [r["rank"] for r in doc["ranks"]] == [1]


def test_a_rank_file_that_would_run_code_fails_the_gate(tmp_path, capsys):
    d = _two_ranks(tmp_path, _unsafe_pickle())
    assert main(["diagnose", str(d), "--fail-on", "unhealthy", "--format", "json"]) == 1
    doc = __import__("json").loads(capsys.readouterr().out)
    assert [u["rank"] for u in doc["unread"]] == [0]
    assert "os" in doc["unread"][0]["reason"] and "system" in doc["unread"][0]["reason"]


def test_a_large_rank_file_that_would_run_code_is_refused_from_its_head_and_still_unread(tmp_path, monkeypatch,
                                                                                        capsys):
    import importlib

    load_module = importlib.import_module("oomdoctor.trace.load")

    monkeypatch.setattr(load_module, "SNIFF_WALK_MIN_BYTES", 16)  # walk every file's head, as above 64 MiB
    d = _two_ranks(tmp_path, _unsafe_pickle())
    assert main(["diagnose", str(d), "--fail-on", "critical", "--format", "json"]) == 1
    doc = __import__("json").loads(capsys.readouterr().out)
    assert [u["rank"] for u in doc["unread"]] == [0]


def test_a_sidecar_claims_the_rank_of_a_file_whose_name_does_not(tmp_path, capsys):
    d = _two_ranks(tmp_path, name="dump_a.pickle")
    (d / "dump_a.meta.json").write_text('{"rank": 3}')
    assert main(["diagnose", str(d), "--fail-on", "critical"]) == 1
    out = capsys.readouterr().out
    assert "1 of 2 ranks read" in out.splitlines()[0]


def test_files_plainly_not_snapshots_stay_skipped_and_the_gate_passes(tmp_path, capsys):
    import zipfile

    d = _two_ranks(tmp_path)
    (d / "rank0.pickle").unlink()
    (d / "train.log").write_text("step 1 loss 2.3\n")
    (d / "metrics_rank0.json").write_text('{"loss": 2.3, "step": 1}')  # claims rank 0 by name: a JSON of metrics
    with zipfile.ZipFile(d / "rank0_model.pickle", "w") as z:  # a torch.save checkpoint, named like a rank's file
        z.writestr("archive/data.pkl", b"x")
    assert main(["diagnose", str(d), "--fail-on", "critical", "--format", "json"]) == 0
    cap = capsys.readouterr()
    assert __import__("json").loads(cap.out)["unread"] == []
    assert "skipped 3 files" in cap.err


def test_a_named_file_that_does_not_load_is_still_an_error(tmp_path, capsys):
    d = _two_ranks(tmp_path)
    assert main(["diagnose", str(d / "rank0.pickle"), str(d / "rank1.pickle"), "--fail-on", "critical"]) == 2
    assert "rank0.pickle" in capsys.readouterr().err


def test_the_html_report_fails_the_gate_on_an_unread_rank(tmp_path, capsys):
    d = _two_ranks(tmp_path)
    page = tmp_path / "r.html"
    assert main(["report", str(d), "-o", str(page), "--fail-on", "critical", "-j", "1"]) == 1
    assert page.stat().st_size > 0 and "1 of 2 ranks read" in page.read_text()


def test_the_library_says_which_ranks_it_could_not_read(tmp_path):
    import oomdoctor

    d = _two_ranks(tmp_path)
    got = oomdoctor.diagnose(d)
    assert [(u.rank, u.path) for u in got.report.unread] == [(0, str(d / "rank0.pickle"))]
    assert gate(got.report, "critical") is not None


def test_the_issues_job_a_rank_cut_at_1_mb_fails_unhealthy(snapshots, tmp_path, capsys):
    """issue 52: ``rank0.pickle`` cut at 1 MB, ``rank1.pickle`` intact, ``--fail-on unhealthy`` exited 0."""
    import shutil

    d = tmp_path / "ddp"
    d.mkdir()
    shutil.copy(snapshots / "ddp-clean" / "rank1.pickle", d / "rank1.pickle")
    (d / "rank0.pickle").write_bytes((snapshots / "ddp-clean" / "rank0.pickle").read_bytes()[: 1 << 20])
    assert main(["diagnose", str(d), "--fail-on", "unhealthy", "-j", "1"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "oomdoctor 0.1.0: healthy on rank 1; 1 of 2 ranks read"
    assert "--fail-on unhealthy" in err and "rank0.pickle" in err


# --- a HIGH finding under a healthy verdict: the verdict gate says what the severity gate would do ---------------

def test_a_high_finding_under_a_healthy_verdict_fails_high_and_unhealthy_says_so(snapshots, capsys):
    f = str(snapshots / "pp-microbatch" / "return-outputs-rank1.pickle")
    assert main(["diagnose", f, "--format", "json", "--fail-on", "high"]) == 1
    assert "pipeline-output-cache HIGH" in capsys.readouterr().err
    assert main(["diagnose", f, "--format", "json", "--fail-on", "unhealthy"]) == 0
    err = capsys.readouterr().err
    assert "passes" in err and "pipeline-output-cache" in err and "--fail-on high" in err
    # both gates at once: the verdict's and the findings'
    assert main(["diagnose", f, "--format", "json", "--fail-on", "unhealthy", "--fail-on", "high"]) == 1
