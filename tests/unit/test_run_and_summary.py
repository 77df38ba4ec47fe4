"""``oomdoctor run`` on a machine without a GPU, snapshots recorded by ``oomdoctor run`` on GPUs, and
the in-job summary's merge, checked against diagnosing all ranks in one process."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from oomdoctor import diagnose
from oomdoctor.capture.gather import Gathered
from oomdoctor.jobsummary import merge_payloads, rank_payload
from oomdoctor.render import render_json
from oomdoctor.trace import load

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded"


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oomdoctor", "run", *args], capture_output=True, text=True,
                          timeout=120, **kw)


@pytest.mark.parametrize("code", [0, 3])
def test_run_passes_the_exit_code_and_output_through(tmp_path, code):
    p = run("--out", str(tmp_path / "o"), "--", sys.executable, "-c",
            f"import sys; print('from the job'); sys.stderr.write('job err\\n'); sys.exit({code})")
    assert p.returncode == code
    assert p.stdout == "from the job\n"
    assert "job err" in p.stderr and f"exit code {code}" in p.stderr
    # one message, not "snapshots in DIR" then "no snapshot was written in DIR"
    assert "no snapshot was written" in p.stderr and "snapshots in" not in p.stderr
    assert p.stderr.count(str(tmp_path / "o")) == 1


def test_run_warns_without_cuda_and_changes_nothing(tmp_path):
    pytest.importorskip("torch")
    script = "import torch; print(torch.arange(4).sum().item())"
    plain = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    p = run("--out", str(tmp_path / "o"), "--", sys.executable, "-c", script)
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert p.returncode == plain.returncode == 0 and p.stdout == plain.stdout == "6\n"
    assert "CUDA is not available in this process" in p.stderr and "nothing was recorded" in p.stderr
    assert not (tmp_path / "o").exists()  # made for the run and left empty: removed (issue 52)


def test_run_reaches_processes_started_by_a_shell_script(tmp_path):
    """The injection reaches grandchildren: a shell script starting Python sees the configuration."""
    p = run("--out", str(tmp_path / "o"), "--", "sh", "-c",
            f"{sys.executable} -c \"import os, sys; print(os.environ['OOMDOCTOR_RUN_CONFIG']); "
            f"print('sitecustomize' in sys.modules)\"")
    lines = p.stdout.splitlines()
    assert json.loads(lines[0])["out"] == str(tmp_path / "o") and lines[1] == "True"
    assert json.loads(lines[0])["stack_steps"] == "3/10"  # the default: stacks in steps 0-2 and every 10th
    p = run("--out", str(tmp_path / "o"), "--stack-steps", "3/10", "--", sys.executable, "-c",
            "import os; print(os.environ['OOMDOCTOR_RUN_CONFIG'])")
    assert json.loads(p.stdout)["stack_steps"] == "3/10"


def test_run_dies_of_the_commands_signal(tmp_path):
    p = run("--out", str(tmp_path / "o"), "--", sys.executable, "-c",
            "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert p.returncode == -15 and "signal SIGTERM" in p.stderr


@pytest.mark.parametrize("args, code, message", [
    (["--out", "/proc/oomdoctor-no/x", "--", "true"], 2, "cannot create the output directory"),
    (["--", "no-such-command-xyz"], 127, "no-such-command-xyz: command not found"),
    (["--steps", "4:2", "--", "true"], 2, "expected 0 <= A <= B"),
    (["--stack-steps", "0/4", "--", "true"], 2, "stack steps '0/4': expected K >= 1 and N >= 0"),
    (["--stack-steps", "every", "--", "true"], 2, "stack steps 'every': expected 'all'"),
])
def test_run_bad_use_is_one_line(args, code, message):
    p = run(*args)
    assert p.returncode == code
    assert p.stderr.strip().splitlines() == [f"oomdoctor: error: {p.stderr.split('error: ', 1)[1].strip()}"]
    assert message in p.stderr


def test_recorded_tp_legacy_whole_run():
    """Recorded by ``oomdoctor run`` on 2 H200s (scenarios/tp_allreduce.py --variant legacy): the whole run,
    model creation and teardown included. The peak of reserved memory is set by a small segment after
    the held blocks were returned, and the finding must still be made."""
    t = load(RECORDED / "tp-legacy" / "rank0.pickle")
    assert t.meta["world_size"] == 2 and t.meta["torch_version"] == "2.11.0+cu130"
    assert t.meta["gpu_name"] == "NVIDIA H200" and t.meta["kind"] == "final"
    report = diagnose([RECORDED / "tp-legacy"])
    (f,) = report.findings
    assert f.id == "deferred-free" and f.ranks == [0, 1]
    assert f.evidence.peak_allocated_bytes == 1_308_622_848
    assert f.evidence.held_at_peak_bytes >= 1 << 30


def test_recorded_pipeline_two_steps():
    """Two ``step()``s in one trace: the cached outputs are freed in one burst per step."""
    report = diagnose([RECORDED / "pp-return-outputs"])
    (f,) = [f for f in report.findings if f.id == "pipeline-output-cache"]
    assert f.ranks == [1] and f.evidence.outputs_kept == 8
    assert f.bytes == 8 * 2048 * 128256 * 2  # 8 micro-batches of [2048, 128256] bf16 logits


def _payloads(paths: list[Path]) -> Gathered:
    got = Gathered()
    for p in paths:
        t = load(p)
        snap = pickle.loads(p.read_bytes())
        got.payloads[t.rank] = rank_payload(snap, {k: v for k, v in t.meta.items() if k in ("rank", "world_size",
                                                                                             "torch_version")}, str(p))
    return got


@pytest.mark.parametrize("folder, files", [
    ("ddp-imbalance", ["rank0.pickle", "rank1.pickle"]),
    ("tp-allreduce", ["legacy-rank0.pickle", "legacy-rank1.pickle"]),
])
def test_in_job_summary_equals_diagnose(snapshots, folder, files):
    paths = [snapshots / folder / f for f in files]
    whole = json.loads(render_json(diagnose(paths).report))
    merged = json.loads(render_json(merge_payloads(_payloads(paths), world_size=2)))
    assert merged["ranks"] == whole["ranks"]
    strip = [{k: v for k, v in f.items() if k != "prediction" and k != "fixes"} for f in whole["findings"]]
    assert [{k: v for k, v in f.items() if k != "prediction" and k != "fixes"} for f in merged["findings"]] == strip
    assert [x["text"] for f in merged["findings"] for x in f["fixes"]] == \
        [x["text"] for f in whole["findings"] for x in f["fixes"]]


def test_in_job_summary_names_missing_and_unreadable_ranks(snapshots):
    got = _payloads([snapshots / "ddp-imbalance" / "rank0.pickle"])
    got.payloads[2] = b"not json"
    got.missing = [1, 3]
    got.waited_s = 120.0
    report = merge_payloads(got, world_size=4)
    assert [r.rank for r in report.ranks] == [0]
    assert report.extra["missing_ranks"] == [1, 2, 3]
    assert any("ranks 1–3 within 120 s" in n for n in report.notes)  # spans as every rank list (units.span)
    assert os.path.basename(report.inputs[0]) == "rank0.pickle"
