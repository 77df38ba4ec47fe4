"""The allocator model against a job whose GC rerun ran out (issue 35): a GraphSAGE-like job on graphs of 10k to
300k nodes under a memory-fraction cap (``scenarios/graphsage_gc.py``, one H200, torch 2.11, device round 6;
``docs/corpus/graphsage-gc.tar.xz``). Every capped run ran out at step 10, the 300k-node graph: with no setting,
with ``garbage_collection_threshold:0.8``, with it and ``max_split_size_mb:256``, and with expandable segments.
Each run self-replays exactly, and the replay of the run without a setting predicts each setting's real run:
the same OOM, and the peak reserved that run recorded."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from oomdoctor import load
from oomdoctor.simulate.whatif import simulate_recorded

ARCHIVE = Path(__file__).resolve().parents[2] / "docs" / "corpus" / "graphsage-gc.tar.xz"
SETTINGS = {"cap-gc0.8": "garbage_collection_threshold:0.8",
            "cap-gc0.8-mss256": "garbage_collection_threshold:0.8,max_split_size_mb:256",
            "cap-expandable": "expandable_segments:True"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("graphsage")
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(root, filter="data")
    return root / "graphsage-gc"


def trace(runs: Path, run: str):
    return load(runs / f"graphsage-{run}" / "rank0_oom.pickle")


def test_every_capped_run_ran_out_at_the_largest_graph(runs):
    for run in ["cap-default", *SETTINGS]:
        t = json.loads((runs / f"graphsage-{run}" / "truth.json").read_text())
        assert t["oom_step"] == 10 and t["cap_bytes"] == 10_930_503_168 and "out of memory" in t["oom"]
    assert json.loads((runs / "graphsage-nocap" / "truth.json").read_text())["oom_step"] is None


@pytest.mark.parametrize("run", ["cap-default", *SETTINGS])
def test_self_replay_is_exact_and_reproduces_the_oom(runs, run):
    sim = simulate_recorded(trace(runs, run))
    v = sim.self_replay.validation
    assert v.segment_events_differing == 0 and v.reserved_events_differing == 0 and v.oom_matches
    assert sim.capacity.limit_bytes == 10_930_503_168 and sim.capacity.kind == "fraction"


def test_the_run_without_a_setting_predicts_each_settings_real_run(runs):
    sim = simulate_recorded(trace(runs, "cap-default"), configs=list(SETTINGS.values()))
    by_setting = dict(zip(SETTINGS, sim.results[1:]))
    oom_event = sim.results[0].oom.event_index
    for run, res in by_setting.items():
        real = simulate_recorded(trace(runs, run)).self_replay
        assert res.oom is not None and res.oom.event_index == oom_event, run  # the GC does not get it through
        assert res.peak_reserved_bytes == real.peak_reserved_bytes, run  # the setting's own run, to the byte
