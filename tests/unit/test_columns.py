"""Every text output fits 80 columns when piped: no line is longer, no cell is cut ("…"), and a file:line is
never broken across lines (the path is shortened instead)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from oomdoctor.cli.diagnose import demo_path

ROOT = Path(__file__).resolve().parents[2]
DEMO = demo_path()
WIDTH = 80


def _run(args: list[str]) -> str:
    env = {**os.environ, "COLUMNS": str(WIDTH)}
    p = subprocess.run([sys.executable, "-m", "oomdoctor", *args], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _check(text: str, labels: list[str] = ()) -> None:
    long = [ln for ln in text.splitlines() if len(ln) > WIDTH]
    assert not long, f"{len(long)} lines over {WIDTH} columns, e.g. {long[0]!r}"
    assert "…" not in text, [ln for ln in text.splitlines() if "…" in ln][:3]
    for label in labels:
        m = re.search(r"([^/\s]+\.py):(\d+)", label)
        if m:
            where = f"{m.group(1)}:{m.group(2)}"
            assert re.search(rf"(?<![\w.]){re.escape(where)}(?!\d)", text), f"{where} is broken or missing"


def _labels(doc: dict) -> list[str]:
    out = []
    for r in doc.get("ranks", []):
        out += [h["label"] for h in r.get("holders", [])[:6]] + [s["label"] for s in r.get("sites", [])]
    return out


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    with tarfile.open(ROOT / "docs" / "corpus" / "own-optimizer-lion.tar.xz") as tar:
        tar.extractall(tmp, filter="data")
    return str(tmp / "own-optimizer-lion")


def test_diagnose_fits_80_columns(corpus_run):
    for target in (["--demo"], [corpus_run]):
        doc = json.loads(_run(["diagnose", *target, "--format", "json"]))
        _check(_run(["diagnose", *target]), _labels(doc))


def test_diff_fits_80_columns(snapshots):
    before, after = str(snapshots / "ddp-imbalance"), str(snapshots / "ddp-clean")
    doc = json.loads(_run(["diff", before, after, "--format", "json"]))
    _check(_run(["diff", before, after]), _labels(doc))


def test_simulate_fits_80_columns_with_its_check_column():
    text = _run(["simulate", DEMO, "--search", "-j", "1"])
    _check(text)
    assert "check" in text and "exact" in text


@pytest.mark.parametrize("args", [
    ["plan", "estimate", "--model", "llama3-70b", "--gpus", "32", "--seq", "4096", "--gbs", "32", "--tp", "4",
     "--pp", "4", "--vpp", "5"],
    ["plan", "search", "--model", "llama3-8b", "--gpus", "16", "--seq", "8192", "--gbs", "64", "--sharding", "fsdp",
     "--framework", "torch"],
    ["plan", "validate", str(ROOT / "tests" / "data" / "golden_memory_sample.csv")],
], ids=["estimate", "search", "validate"])
def test_plan_fits_80_columns(args):
    _check(_run(args))
