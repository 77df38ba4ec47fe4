"""The words, against golden files; the ids and bytes, against the core (issue 53 item 4).

Each command below runs once on the bundled demo snapshot (``oomdoctor.cli.diagnose.demo_path()``, copied as
``demo.pickle`` so that no path of this machine is in the output), or, for preflight, on a tiny script
(``tests/data/golden/step.py``); its text and its JSON, as ``-o`` writes them (fixed widths, no terminal), are
compared byte for byte with ``tests/data/golden/<case>``. A change of words fails here; regenerate the files with
``OOMDOCTOR_UPDATE_GOLDEN=1`` and read the diff before committing them (docs/testing.md).

Beside them, rule tests on the same runs: the ids (verdict, findings, configurations) and the bytes (peaks) in the
JSON are those the core computed, called directly. A change of words alone fails only the golden test; a change of
numbers fails the rule tests too.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import shutil
import time
from pathlib import Path
from unittest import mock

import pytest
from builder import llama3_8b_plan_specs

from oomdoctor.cli.diagnose import demo_path
from oomdoctor.cli.main import main

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
UPDATE = os.environ.get("OOMDOCTOR_UPDATE_GOLDEN") == "1"
_PLAN = ["plan", "estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "2"]
_PREFLIGHT = ["--gpu", "H100-80GB", "--", "python", "step.py"]

#: golden file -> the command that writes it (-o, or preflight's --report-output, is added)
CASES = {
    "diagnose.txt": ["diagnose", "demo.pickle", "-j", "1"],
    "diagnose.json": ["diagnose", "demo.pickle", "-j", "1", "--format", "json"],
    "simulate.txt": ["simulate", "demo.pickle", "--immediate-frees"],
    "simulate.json": ["simulate", "demo.pickle", "--immediate-frees", "--format", "json"],
    "plan-estimate.txt": _PLAN,
    "plan-estimate.json": [*_PLAN, "--format", "json"],
    "diff.txt": ["diff", "demo.pickle", "demo.pickle", "-j", "1"],
    "diff.json": ["diff", "demo.pickle", "demo.pickle", "-j", "1", "--format", "json"],
    "preflight.txt": ["preflight", "-o", "step.pickle", *_PREFLIGHT],
    "preflight.json": ["preflight", "-o", "step.pickle", "--format", "json", *_PREFLIGHT],
}


@contextlib.contextmanager
def _still_clock():
    """preflight's seconds (its trace's wall time) are the clock's: held still, they are 0.0 every run."""
    with mock.patch.multiple(time, monotonic=lambda: 1000.0, perf_counter=lambda: 1000.0, time=lambda: 1.7e9,
                             time_ns=lambda: 1_700_000_000_000_000_000):
        yield


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("golden")
    shutil.copy(demo_path(), d / "demo.pickle")
    shutil.copy(GOLDEN / "step.py", d / "step.py")
    return d


@pytest.fixture(scope="module")
def outputs(workdir):
    """case -> the bytes its command wrote (each command run once, in ``workdir``)."""
    got: dict[str, bytes] = {}
    old = os.getcwd()
    os.chdir(workdir)
    try:
        for case, args in CASES.items():
            if args[0] == "preflight":
                pytest.importorskip("torch")
            out = workdir / f"out-{case}"
            at = args.index("--") if "--" in args else len(args)
            opt = "--report-output" if args[0] == "preflight" else "-o"
            with _still_clock():
                code = main([*args[:at], opt, str(out), *args[at:]])
            assert code == 0, case
            got[case] = out.read_bytes()
    finally:
        os.chdir(old)
    return got


@pytest.mark.parametrize("case", list(CASES))
def test_the_words_are_the_golden_files(case, outputs):
    golden = GOLDEN / case
    if UPDATE:
        golden.write_bytes(outputs[case])
    assert golden.exists(), f"{golden} is missing: run with OOMDOCTOR_UPDATE_GOLDEN=1"
    want, got = golden.read_text(encoding="utf-8"), outputs[case].decode("utf-8")
    diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), f"golden/{case}", "now", n=1))
    assert got == want, f"the words changed (OOMDOCTOR_UPDATE_GOLDEN=1 regenerates the golden files):\n{diff[:4000]}"


def _doc(outputs, case: str) -> dict:
    return json.loads(outputs[case])


@pytest.fixture(scope="module")
def core(workdir):
    """The demo's report as the core computes it, without the CLI or a renderer."""
    from oomdoctor.analysis.device import analyze
    from oomdoctor.report.pipeline import report_of
    from oomdoctor.trace import load

    return report_of([analyze(load(str(workdir / "demo.pickle")))])


def test_diagnose_ids_and_bytes_are_the_cores(outputs, core):
    doc = _doc(outputs, "diagnose.json")
    assert core.verdict is not None and doc["verdict"]["kind"] == core.verdict.kind
    assert doc["verdict"]["bytes"] == core.verdict.bytes and doc["verdict"]["finding"] == core.verdict.finding
    assert doc["verdict"]["reasons"] == list(core.verdict.reasons)
    assert [(f["id"], f["severity"], f["bytes"]) for f in doc["findings"]] == \
        [(f.id, f.severity, f.bytes) for f in core.findings]
    assert [(r["rank"], r["peak_allocated_bytes"], r["peak_reserved_bytes"]) for r in doc["ranks"]] == \
        [(r.rank, r.peak_allocated_bytes, r.peak_reserved_bytes) for r in core.ranks]


def test_diagnose_text_says_the_cores_verdict_and_peak(outputs, core):
    """The text names the verdict's finding and the peak the core computed (in the units the text uses)."""
    from oomdoctor.render.format import format_bytes

    text = outputs["diagnose.txt"].decode()
    assert format_bytes(core.ranks[0].peak_reserved_bytes) in text


def test_simulate_configs_and_peaks_are_the_cores(outputs, workdir):
    from oomdoctor.simulate.whatif import simulate_recorded
    from oomdoctor.trace import load

    sim = simulate_recorded(load(str(workdir / "demo.pickle"), replay_only=True), configs=[], immediate_frees=True)
    doc = _doc(outputs, "simulate.json")
    assert [(r["config"], r["deferred_frees"], r["peak_reserved_bytes"], r["peak_allocated_bytes"])
            for r in doc["results"]] == \
        [(r.config.to_string(), r.deferred_frees, r.peak_reserved_bytes, r.peak_allocated_bytes) for r in sim.results]
    assert doc["capacity"]["limit_bytes"] == sim.capacity.limit_bytes


def test_plan_estimate_bytes_are_the_cores(outputs):
    from dataclasses import replace

    from oomdoctor.plan.estimate import estimate

    model, train, hw, base = llama3_8b_plan_specs()
    e = estimate(model, train, replace(base, tp=2, dp=4, sequence_parallel=True), hw)
    doc = _doc(outputs, "plan-estimate.json")
    assert doc["label"] == e.plan.label() and doc["peak_stage"] == e.peak.stage and doc["fits"] == e.fits
    assert [(s["stage"], s["reserved_bytes"], s["device_bytes"]) for s in doc["stages"]] == \
        [(s.stage, s.reserved_bytes, s.device_bytes) for s in e.stages]


def test_diff_peaks_are_the_cores(outputs, core):
    doc = _doc(outputs, "diff.json")
    peak = core.ranks[0].peak_reserved_bytes
    assert [(r["before_peak_reserved_bytes"], r["after_peak_reserved_bytes"], r["peak_reserved_saved_bytes"])
            for r in doc["ranks"]] == [(peak, peak, 0)]
    assert {f["status"] for f in doc["findings"]} <= {"unchanged"}
    assert sorted(f["id"] for f in doc["findings"]) == sorted(f.id for f in core.findings)


def test_preflight_bytes_are_those_of_its_snapshot(outputs, workdir):
    """preflight's peaks are the replay of the snapshot it wrote (-o), read by the core as diagnose reads it."""
    from oomdoctor.analysis.device import analyze
    from oomdoctor.trace import load

    doc = _doc(outputs, "preflight.json")
    a = analyze(load(str(workdir / "step.pickle")))
    assert doc["oom"] is False and doc["snapshot"] == "step.pickle"
    assert doc["peak_reserved_bytes"] == a.peak_reserved[0]
    assert doc["peak_allocated_bytes"] == a.peak_allocated[0]
