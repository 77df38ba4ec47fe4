"""The allocator model against fresh recordings on this GPU (``scenarios/allocator_traces.py``): runs at a
memory-fraction cap with garbage collection and ``max_split_size``, a ``torch.cuda.graph`` capture, and
an expandable-segments pair. Each must self-replay exactly, with its sidecar and from the snapshot
alone, and the expandable what-if must land within 1% of the real expandable run.

Run: ``python -m pytest -m gpu tests/gpu/test_allocator_gpu.py -v`` (results in docs/simulate.md).
With ``OOMDOCTOR_SCENARIO_LOG=FILE`` each run appends one JSON line to FILE.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
RUNS = ["cap-gc0.6-mss128", "cap-gc0.8", "cap-mss256", "graph-manual", "nocap-default", "nocap-expandable"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("allocator")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "scenarios"),
                                                       os.environ.get("PYTHONPATH", "")]))
    args = [a for r in RUNS for a in ("--only", r)]
    proc = subprocess.run([sys.executable, str(ROOT / "scenarios" / "allocator_traces.py"), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=580, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("run", RUNS)
def test_fresh_recordings_self_replay_exactly(recorded, run, tmp_path):
    from oomdoctor import load
    from oomdoctor.simulate.whatif import simulate_recorded

    truth = json.loads((recorded / run / "truth.json").read_text())
    bare = tmp_path / "rank0.pickle"
    shutil.copy(recorded / run / "rank0.pickle", bare)
    rows = []
    for path in (recorded / run / "rank0.pickle", bare):
        sim = simulate_recorded(load(path))
        v = sim.self_replay.validation
        rows.append({"run": run, "sidecar": path != bare, "capacity": sim.capacity.limit_bytes,
                     "certainty": sim.capacity.certainty, "segment_events": v.segment_events_recorded,
                     "differing": v.segment_events_differing, "reserved_events_differing": v.reserved_events_differing,
                     "peak_reserved_bytes": sim.self_replay.peak_reserved_bytes,
                     "measured_peak_reserved_bytes": truth["memory_stats"]["reserved_bytes.all.peak"],
                     "alloc_retries": truth["memory_stats"].get("num_alloc_retries"), "oom": truth["oom"]})
        assert v.exact, rows[-1]
        assert sim.self_replay.peak_reserved_bytes == truth["memory_stats"]["reserved_bytes.all.peak"]
        if run.startswith("cap-") and path != bare:
            assert sim.capacity.limit_bytes == truth["cap_bytes"] and sim.capacity.certainty == "exact"
    if os.environ.get("OOMDOCTOR_SCENARIO_LOG"):
        with open(os.environ["OOMDOCTOR_SCENARIO_LOG"], "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def test_expandable_what_if_within_one_percent(recorded):
    from oomdoctor import load
    from oomdoctor.simulate.whatif import simulate_recorded

    sim = simulate_recorded(load(recorded / "nocap-default" / "rank0.pickle"), configs=["expandable_segments:True"])
    measured = json.loads((recorded / "nocap-expandable" / "truth.json").read_text())["memory_stats"][
        "reserved_bytes.all.peak"]
    predicted = sim.results[1].peak_reserved_bytes
    if os.environ.get("OOMDOCTOR_SCENARIO_LOG"):
        with open(os.environ["OOMDOCTOR_SCENARIO_LOG"], "a") as f:
            f.write(json.dumps({"what_if": "expandable_segments:True", "predicted": predicted, "measured": measured})
                    + "\n")
    assert abs(predicted - measured) <= 0.01 * measured
