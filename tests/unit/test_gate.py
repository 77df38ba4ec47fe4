"""``--fail-on``: the CI gate of ``diagnose`` and ``report`` (report/gate.py), on real snapshots."""

from __future__ import annotations

import pytest

from oomdoctor.cli.main import main
from oomdoctor.report.gate import gate
from oomdoctor.report.pipeline import build_report
from oomdoctor.trace import load_ranks


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
