"""The allocator model on its own GPU recordings (docs/corpus/allocator-traces.tar.xz, H100, PyTorch 2.11,
``scenarios/allocator_traces.py``): runs at a memory-fraction cap with garbage collection and
max_split_size, CUDA-graph private pools, and an expandable-segments pair. Self-replay must be exact with
the sidecar and, for the cap, from the trace alone."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from oomdoctor import load
from oomdoctor.cli.main import main
from oomdoctor.simulate.capacity import BOUNDED, EXACT, infer_capacity
from oomdoctor.simulate.replay import prepare, replay
from oomdoctor.simulate.whatif import simulate_recorded
from oomdoctor.trace.model import SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP

ARCHIVE = Path(__file__).resolve().parents[2] / "docs" / "corpus" / "allocator-traces.tar.xz"
CAPPED = ["cap-default", "cap-mss256", "cap-gc0.6", "cap-gc0.8", "cap-gc0.95", "cap-gc0.8-mss256", "cap-gc0.6-mss128",
          "cap-expandable"]
RUNS = CAPPED + ["nocap-default", "nocap-expandable", "graph-manual", "compiled-ro"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("allocator")
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(root, filter="data")
    return root / "allocator-traces"


def truth(traces: Path, run: str) -> dict:
    return json.loads((traces / run / "truth.json").read_text())


def bare(traces: Path, run: str, tmp_path: Path) -> Path:
    """The snapshot alone, as plain ``_dump_snapshot`` leaves it (no sidecar)."""
    dst = tmp_path / "rank0.pickle"
    shutil.copy(traces / run / "rank0.pickle", dst)
    return dst


def exact(sim) -> None:
    r = sim.self_replay
    v = r.validation
    assert v.segment_events_differing == 0 and v.segment_events_recorded == v.segment_events_simulated, v
    assert v.reserved_events_differing == 0 and v.max_reserved_difference_bytes == 0, v
    assert v.oom_matches


def test_the_runs_hit_the_paths_they_are_for(traces):
    stats = {r: truth(traces, r)["memory_stats"] for r in RUNS}
    cap = truth(traces, "cap-default")["cap_bytes"]
    assert cap == 15_629_237_913
    assert stats["cap-default"]["num_alloc_retries"] == 2  # release_cached_blocks ran at the cap
    assert stats["cap-gc0.6"]["num_alloc_retries"] == 0 and stats["cap-gc0.6"]["num_device_free"] == 11  # GC freed
    assert stats["cap-gc0.6-mss128"]["num_device_free"] == 287
    assert stats["nocap-default"]["reserved_bytes.all.peak"] == 25_773_998_080 > cap  # the cap mattered
    t = truth(traces, "cap-default")
    assert t["mem_get_info_total"] == t["props_total_memory"]  # the fraction's base, on this GPU


@pytest.mark.parametrize("run", RUNS)
def test_self_replay_is_exact_with_the_sidecar(traces, run):
    sim = simulate_recorded(load(traces / run / "rank0.pickle"))
    exact(sim)
    assert sim.self_replay.peak_reserved_bytes == truth(traces, run)["memory_stats"]["reserved_bytes.all.peak"]
    if run.startswith("cap-"):
        assert sim.capacity.certainty == EXACT and sim.capacity.limit_bytes == truth(traces, run)["cap_bytes"]
        assert sim.capacity.kind == "fraction"


@pytest.mark.parametrize("run", RUNS)
def test_self_replay_is_exact_from_the_trace_alone(traces, run, tmp_path):
    sim = simulate_recorded(load(bare(traces, run, tmp_path)))
    exact(sim)
    cap = truth(traces, run)["cap_bytes"]
    c = sim.capacity
    if run in CAPPED and run != "cap-expandable":  # expandable segments never hit the cap in this run
        assert c.certainty == BOUNDED and c.lower_bytes <= cap <= c.upper_bytes, c
        assert c.source == "fallbacks" and c.source_values["runs"] >= 1
    elif run != "graph-manual":
        assert c.limit_bytes is None


def test_the_trace_bounds_the_cap_tightly_where_max_split_size_frees_often(traces, tmp_path):
    t = load(bare(traces, "cap-mss256", tmp_path))
    c = infer_capacity(t, t.primary)
    assert (c.lower_bytes, c.upper_bytes) == (15_623_782_400, 15_651_045_375)
    assert c.upper_bytes - c.lower_bytes < 0.002 * c.lower_bytes


def test_graph_capture_empty_cache_is_not_read_as_a_cap(traces, tmp_path):
    """torch.cuda.graph's empty_cache(), and the one after the graph is deleted, free segments right
    before new ones; PyTorch 2.11 stamps them with the allocation's stack. With the sidecar (fraction 1,
    0 retries) they are no fallback; from the trace alone the replay settles it."""
    with_side = simulate_recorded(load(traces / "graph-manual" / "rank0.pickle"))
    assert (with_side.capacity.limit_bytes, with_side.capacity.source) == (None, "no-evidence")
    alone = simulate_recorded(load(bare(traces, "graph-manual", tmp_path)))
    assert (alone.capacity.limit_bytes, alone.capacity.source) == (None, "fallbacks-unreproduced")
    assert alone.capacity.source_values["runs"] >= 1


@pytest.mark.parametrize(("run", "pool", "segments"), [("compiled-ro", (0, 1), 22), ("graph-manual", (1, 0), 15)])
def test_private_pools_are_replayed_as_recorded_and_named(traces, run, pool, segments):
    sim = simulate_recorded(load(traces / run / "rank0.pickle"))
    exact(sim)
    note = next(n for n in sim.warnings if "private pool" in n)  # the replay's preparation noticed it
    assert f"{pool} ({segments} segments" in note
    # the default pools alone are compared: fewer segment events than the trace holds
    trace = load(traces / run / "rank0.pickle")
    p = prepare(trace)
    segment_entries = np.isin(trace.primary.events["action"], [SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP])
    assert len(p.rec_seg) + len(p.external) == int(segment_entries.sum()) and p.external
    r = replay(p, capacity=infer_capacity(trace, p.device))
    r.model.check(r.live_blocks)  # byte identities, private bytes counted as external
    assert r.model.external_reserved > 0


@pytest.mark.parametrize("base", ["nocap-default", "cap-default"])
def test_expandable_what_if_matches_the_real_expandable_run(traces, base):
    sim = simulate_recorded(load(traces / base / "rank0.pickle"), configs=["expandable_segments:True"])
    predicted = sim.results[1].peak_reserved_bytes
    measured = truth(traces, "nocap-expandable" if base == "nocap-default" else "cap-expandable")["memory_stats"][
        "reserved_bytes.all.peak"]
    assert abs(predicted - measured) <= 0.01 * measured
    assert predicted == measured == 13_725_859_840  # exact on these runs


def test_a_given_cap_with_a_recorded_gc_threshold_is_a_fraction(traces, tmp_path, capsys):
    """GC acts only under a fraction cap, so --cap on such a trace means one (it replayed 23.6 GiB off
    when --cap was read as the device's limit)."""
    path = bare(traces, "cap-gc0.8-mss256", tmp_path)
    sim = simulate_recorded(load(path), cap_bytes=truth(traces, "cap-gc0.8-mss256")["cap_bytes"])
    assert sim.capacity.kind == "fraction" and sim.capacity.certainty == "given"
    exact(sim)
    assert main(["simulate", str(path), "--cap", str(truth(traces, "cap-gc0.8-mss256")["cap_bytes"])]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "self-replay: 0 of 449 segment events differ (449 recorded, 449 simulated)" in out
