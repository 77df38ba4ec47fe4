"""Issue 37's Done-when, as a test: every command's output piped at 80 columns reads whole (no long line, no cut
number, no internal word, indents kept, every column headed) and every headline agrees with its report, on the
shared snapshots and the bundled demo (``benchmarks/words_sweep.py`` runs the same checks on every snapshot file,
out of process). The checker's own tests come first: it must catch each defect the issue found."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from oomdoctor.cli.diagnose import demo_path
from oomdoctor.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("words_sweep", ROOT / "benchmarks" / "words_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)

FOLDERS = ["allgather", "ddp-clean", "ddp-imbalance", "fragmentation-oom", "fsdp2-gpt2", "pp-microbatch",
           "tp-allreduce"]


# --- the checker catches what the issue found ---------------------------------------------------------------

@pytest.mark.parametrize("text, what", [
    ("x" * 81, "81 columns"),
    ("PYTORCH_CUDA_ALLOC_CONF     peak r…   peak all…   O…", "cut"),
    ("  max_split_size_mb:512,garbage_collection_thresh…   35.31 …", "cut"),
    ("end of a line ", "trailing spaces"),
    ("oomdoctor 0.1.0: capacity on rank 0 (1 rank(s) read)", "rank(s)"),
    ("(recorded: peak reserved 38.44 GiB, OOM at event 13760; reach: step-completed)", "reach:"),
    ("not reproduce this recording under the device's room", "device's room"),
    ("at the OOM (step 7, backward phase, from inferred): 30.45 GiB", "from inferred"),
    ("capacity: 38.44 GiB (41269854208 bytes, fraction limit, bounded)", "raw byte count"),
    ("Set PYTORCH_ALLOC_CONF=x (PYTORCH_ALLOC_CONF (PyTorch >= 2.9; alias)): segments", "nested parentheses"),
    ("completes (peak reserved 34.36\nGiB) with 4.07 GiB to spare", "unit on two lines"),
    ("  note: the trace starts after some blocks were allocated (0 frees without their\n"
     "alloc, 225 blocks never seen): their state at the start was reconstructed", "lost its indent"),
    ("a table\n name    bytes\n ─────────────────────\n x       1.00 GiB    in forward\n", "no header"),
    ("no OOM and no material finding; peak reserved 5.97 GiB", "material finding"),
    ("  the rest read from the trace", "the rest read from the trace"),
    ("[deferred-free] rank 0 · 1.62 GiB at stake · PyTorch >= 2.10 (snapshot has 'user_metadata')", "snapshot has"),
    ("  workspaces 65.00 MiB + communication 24.03 MiB + outputs kept 4 B", "a category of a few bytes"),
    ("1 trials of 2 optimizer steps", "1 + plural"),
    ("gpt2: TP1 PP1 DP2, 1f1b, 1 micro-batches of 8 x 1024 tokens", "1 + plural"),
], ids=lambda x: x if len(x) < 20 else None)
def test_the_checker_catches_each_defect_the_issue_found(text, what):
    found = sweep.problems(text)
    assert any(what in p for p in found), found


def test_the_checker_passes_a_hanging_indent():
    """A line wrapped with a hanging indent (its continuation two columns in), then the next item at the left edge:
    preflight's output (issue 52)."""
    text = ("oomdoctor preflight: /tmp/a/long/path/to/the/users/script/train.py, micro-batch\n"
            "  8 x 1024 tokens, bf16, adamw, and so on until the line is filled to the edge\n"
            "traced on the CPU under fake tensors in 0.8 s (131 events)\n")
    assert sweep.problems(text) == []


def test_the_checker_passes_what_reads_well():
    text = ("rank 0: 20 collectives (all_gather), no forward or backward\n"
            "  note: the trace starts after some blocks were allocated: 0 frees without their\n"
            "        alloc; call work.wait() (or torch.cuda.current_stream().wait_stream(s))\n"
            " bytes   site\n ─────────────────\n  1.00 GiB   a.py:3\n")
    assert sweep.problems(text) == []


def _verdict_doc(summary: str, evidence: dict, findings=(), kind="fragmentation") -> dict:
    return {"verdict": {"kind": kind, "summary": summary, "evidence": evidence, "ranks": [0]},
            "findings": list(findings), "ranks": [{"rank": 0, "oom": None, "peak_reserved_bytes": 41269854208,
                                                   "peak_allocated_bytes": 32690781696}]}


def test_the_headline_check_catches_the_issues_contradictions():
    medium = {"id": "allgather-list", "severity": "medium", "bytes": 99_418_112, "fixes": []}
    doc = _verdict_doc("no OOM and nothing worth fixing; peak reserved 1.07 GiB", {"peak_reserved_bytes": 1_148_846_080},
                       [medium], kind="healthy")
    assert any("nothing worth fixing" in p for p in sweep.headline_problems(doc))
    pred = {"rank": 0, "config": "expandable_segments:True", "peak_reserved_bytes": 37339791360,
            "extended_peak_reserved_bytes": None, "capacity_kind": "fraction", "self_replay_exact": True,
            "outcome": "gets past the recorded OOM, and the rest of the step completes (peak reserved 31.06 GiB)"}
    frag = {"id": "fragmentation", "severity": "critical", "bytes": 8233042944, "fixes": [{"prediction": pred}]}
    doc = _verdict_doc("108.60 GiB were free (cached or on the device) for a request of 3.78 GiB. What fits is not "
                       "said: the allocator model does not reproduce this recording.",
                       {"free_bytes": 116612940800, "request_bytes": 4063232000, "fix_self_replay_exact": True},
                       [frag])
    found = sweep.headline_problems(doc)
    assert any("device's free memory under a memory-fraction cap" in p for p in found), found
    assert any("does not reproduce" in p for p in found), found
    assert any("quotes peak reserved 31.06 GiB, its replay's is 34.78 GiB" in p for p in found), found
    doc = _verdict_doc("7.99 GiB were free for a request of 9.99 GiB", {"free_bytes": 8579073024})
    assert sweep.headline_problems(doc) == ["headline quotes 9.99 GiB, which no number of its report formats to"]


# --- every output on the shared snapshots ------------------------------------------------------------------

def _run(args: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("OOMDOCTOR_STRICT_TEMPLATES", raising=False)  # what a user runs
    rc = main(args)
    out = capsys.readouterr()
    assert rc in (0, 1), (args, out.err[-500:])
    return out.out


def _sweep(cmds: list[list[str]], capsys, monkeypatch) -> list[str]:
    found = []
    for args in cmds:
        text = _run(args, capsys, monkeypatch)
        found += [f"{' '.join(args)}: {p}" for p in sweep.problems(text)]
        if args[0] == "diagnose" and "--help" not in args:
            doc = json.loads(_run([*args, "--format", "json"], capsys, monkeypatch))
            found += [f"{' '.join(args)}: {p}" for p in sweep.headline_problems(doc)]
    return found


def test_every_help_and_plan_reads_at_80_columns(capsys, monkeypatch, tmp_path):
    cmds = [c for c in sweep.commands(None, demo_path(), str(tmp_path), tools=False)
            if c[0] == "plan" or "--help" in c]
    assert len(cmds) == len(sweep.HELPS) + 3
    assert _sweep(cmds, capsys, monkeypatch) == []


def test_the_demo_reads_at_80_columns(capsys, monkeypatch, tmp_path):
    cmds = [c for c in sweep.commands(None, demo_path(), str(tmp_path), tools=False)
            if c[0] != "plan" and "--help" not in c]
    assert {c[0] for c in cmds} == {"diagnose", "simulate", "report", "slice", "export"}
    assert _sweep(cmds, capsys, monkeypatch) == []


def test_preflight_run_fit_and_verify_read_at_80_columns(capsys, monkeypatch, tmp_path):
    """Issue 52: every command, preflight included: preflight of a Hugging Face config and of a script, diagnose and
    simulate of preflight's own snapshot, run, fit and verify of a short script, plan estimate of a Trainer job."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # the commands name their files relative to it
    cmds = sweep.tool_commands(str(tmp_path), search=False)
    assert {c[0] for c in cmds} == {"preflight", "diagnose", "simulate", "run", "fit", "verify", "plan"}
    assert _sweep(cmds, capsys, monkeypatch) == []


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_command_on_the_shared_snapshots_reads_at_80_columns(snapshots, folder, capsys, monkeypatch,
                                                                    tmp_path):
    pickles = sorted(str(p) for p in (snapshots / folder).glob("*.pickle"))
    assert pickles
    cmds = [["diagnose", pickles[0]], ["simulate", pickles[0], "--search", "-j", "1"],
            ["simulate", pickles[0], "--config", "expandable_segments:True"]]
    by_run: dict[str, list[str]] = {}
    for p in pickles:
        by_run.setdefault(Path(p).stem.rsplit("rank", 1)[0], []).append(p)
    cmds += [["diagnose", *group, "-j", "1"] for group in by_run.values() if len(group) > 1][:1]
    assert _sweep(cmds, capsys, monkeypatch) == []
