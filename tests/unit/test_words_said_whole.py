"""Words a first-time user read as contradicting the numbers beside them (a new user's trial of the tool, docs in
docs/testing.md): an upgrade the user's PyTorch already has, a finding's part of a rank's saving in ``diff``, and
``simulate`` under a ``--cap`` its recorded settings do not fit under."""

from __future__ import annotations

import os
import subprocess
import sys

from oomdoctor.cli.diagnose import demo_path
from oomdoctor.detectors.finding import FindingTitle, Fix
from oomdoctor.render.words import diff as diff_words
from oomdoctor.render.words import findings as finding_words
from oomdoctor.report.diff import FindingChange
from oomdoctor.units import MiB


def _run(args: list[str]) -> str:
    p = subprocess.run([sys.executable, "-m", "oomdoctor", *args], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_an_upgrade_the_users_pytorch_has_is_said_to_be_there_not_missing():
    up = Fix("upgrade-collectives-current-stream", versions=">=2.8", source="s", kind="upgrade", applies=False)
    assert finding_words.applies_mark(up) == "✗ already in your PyTorch"
    assert finding_words.applies_mark(Fix("x", versions=">=2.8", source="s", kind="upgrade", applies=True)) \
        == "✓ in your PyTorch"
    env = Fix("avoid-record-streams", versions="2.1-2.7", source="s", kind="env", applies=False)
    assert finding_words.applies_mark(env) == "✗ not in your PyTorch"
    # the bundled demo: PyTorch 2.10 or later, legacy record_stream-ed all-reduces
    out = _run(["diagnose", str(demo_path())])
    assert "PyTorch 2.10 or later" in out
    assert "✗ already in your PyTorch" in out and "Upgrade to PyTorch >= 2.8" in out


def test_a_findings_saving_in_diff_is_said_as_its_part_of_the_ranks_saving():
    f = FindingChange(id="allgather-list", status="resolved",
                      title=FindingTitle("allgather-list", "", {}), before_bytes=int(94.81 * MiB), after_bytes=0,
                      before_ranks=[0], after_ranks=[], peak_reserved_saved_bytes=int(94.81 * MiB))
    assert diff_words.finding(f) == ("94.81 MiB at stake before; of the peak reserved saved on rank 0, its own "
                                     "blocks account for +94.81 MiB")


def test_simulate_under_a_cap_says_the_recorded_settings_run_out_first():
    out = _run(["simulate", str(demo_path()), "--cap", "1GiB", "--immediate-frees"])
    head = out.splitlines()[0]
    assert head.startswith("oomdoctor simulate: under 1.00 GiB the recorded settings run out of memory at event ")
    assert "(recorded: peak reserved 2.84 GiB, no OOM)" in head
    assert head.endswith("; 0 of 1 setting tried run without an OOM under it")
    # a limit the recording fits under says the replay as before
    assert _run(["simulate", str(demo_path()), "--cap", "64GiB"]).startswith(
        "oomdoctor simulate: the recorded run replays")
