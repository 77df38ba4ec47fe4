"""The allocator model against the real H200 recordings of shared/snapshots (PyTorch 2.11)."""

import json

import pytest

from oomdoctor import load
from oomdoctor.analysis.lifetimes import lifetimes
from oomdoctor.analysis.timeline import timeline
from oomdoctor.cli.main import main
from oomdoctor.simulate.capacity import Capacity, infer_capacity
from oomdoctor.simulate.config import parse_config
from oomdoctor.simulate.replay import IMMEDIATE, prepare, replay
from oomdoctor.simulate.whatif import simulate

GiB = 1 << 30
FRAG_CAP = 41_519_093_862  # shared/snapshots/README.md: 1.10 x the peak allocated of a max-length step
ALL = ["allgather/list-rank0.pickle", "allgather/tensor-rank0.pickle", "ddp-clean/rank0.pickle",
       "ddp-clean/rank1.pickle", "ddp-imbalance/rank0.pickle", "ddp-imbalance/rank1.pickle",
       "fragmentation-oom/default-oom.pickle", "fragmentation-oom/expandable-end.pickle", "fsdp2-gpt2/rank0.pickle",
       "fsdp2-gpt2/rank1.pickle", "large/fsdp2-gpt2-60steps-rank0.pickle.xz",
       "pp-microbatch/no-return-outputs-rank0.pickle", "pp-microbatch/no-return-outputs-rank1.pickle",
       "pp-microbatch/return-outputs-rank0.pickle", "pp-microbatch/return-outputs-rank1.pickle",
       "tp-allreduce/legacy-cppstacks-rank0.pickle", "tp-allreduce/legacy-expandable-rank0.pickle",
       "tp-allreduce/legacy-rank0.pickle", "tp-allreduce/legacy-rank1.pickle", "tp-allreduce/modern-rank0.pickle",
       "tp-allreduce/noallreduce-rank0.pickle"]


def _stats(snapshots, folder, tag, rank):
    for line in (snapshots / folder / "stats.jsonl").read_text().splitlines():
        d = json.loads(line)
        if d["tag"] == tag and d["rank"] == rank:
            return d
    raise KeyError(tag)


@pytest.mark.parametrize("name", ALL)
def test_self_replay_is_exact(snapshots, name):
    trace = load(snapshots / name)
    prepared = prepare(trace)
    cap = infer_capacity(trace, prepared.device)
    r = replay(prepared, capacity=cap)
    v = r.validation
    assert v.segment_events_differing == 0, v
    assert v.reserved_events_differing == 0 and v.max_reserved_difference_bytes == 0, v
    assert v.segment_events_recorded == v.segment_events_simulated
    assert v.oom_matches and r.matches_recorded is True
    r.model.check(r.live_blocks)  # the model's own byte identities hold at the end
    if r.oom is None:  # the simulated end state is the snapshot's
        assert r.end_reserved_bytes == prepared.device.final_reserved_bytes
        assert r.events_replayed == prepared.device.num_events


def test_all_shared_snapshots_are_covered(snapshots):
    found = sorted(str(p.relative_to(snapshots)) for p in snapshots.rglob("*.pickle*"))
    assert found == sorted(ALL)


def test_fragmentation_oom_at_the_recorded_allocation(snapshots):
    prepared = prepare(load(snapshots / "fragmentation-oom/default-oom.pickle"))
    r = replay(prepared, capacity=Capacity(limit_bytes=FRAG_CAP, kind="fraction", source="README"))
    assert r.matches_recorded is True
    assert r.oom.event_index == 13760 == prepared.recorded_oom
    assert r.oom.requested_bytes == 4_063_232_000 and r.num_alloc_retries == 1


def test_expandable_segments_avoid_the_oom_within_1_percent_of_the_real_run(snapshots):
    # The real expandable run (expandable-end.pickle) made the same requests: its peak reserved up to
    # the request that failed in default-oom is the target.
    exp = load(snapshots / "fragmentation-oom/expandable-end.pickle").primary
    default = load(snapshots / "fragmentation-oom/default-oom.pickle")
    act = exp.events["action"]
    allocs = [i for i, a in enumerate(act.tolist()) if a == 0]
    n = int((default.primary.events["action"] == 0).sum())
    assert (exp.events["size"][allocs[:n]] == default.primary.events["size"][default.primary.events["action"] == 0]).all()
    tl = timeline(exp, lifetimes(load(snapshots / "fragmentation-oom/expandable-end.pickle"), exp))
    target = int(tl.reserved[: allocs[n] + 1].max())
    assert target == 37_381_734_400  # 34.81 GiB
    prepared = prepare(default)
    r = replay(prepared, parse_config("expandable_segments:True"), capacity=Capacity(limit_bytes=FRAG_CAP,
                                                                                     kind="fraction",
                                                                                     source="README"))
    assert r.oom is None
    assert abs(r.peak_reserved_bytes - target) / target < 0.01


def test_a_setting_past_the_recorded_oom_says_the_replay_ends_there(snapshots):
    """Issue 52: ``simulate default-oom.pickle --config expandable_segments:True`` said "none" in its OOM column: the
    replay gets past the recorded OOM (event 13760), where the recording ends; it says so, and the text says how far
    every replay reaches."""
    from oomdoctor.render.json import simulation_dict
    from oomdoctor.render.text import render_simulation_text_plain

    sim = simulate(load(snapshots / "fragmentation-oom/default-oom.pickle"), configs=["expandable_segments:True"])
    assert sim.reach == "recorded" and sim.results[1].oom is None
    text = render_simulation_text_plain(sim, width=200)
    (row,) = [x for x in text.splitlines() if x.strip().startswith("expandable_segments:True")]
    assert row.split()[-1] == "it" and row.endswith("past it")
    assert "replayed: up to the recorded OOM (event 13760), where the recording ends" in text
    assert [r["reach"] for r in simulation_dict(sim)["results"]] == ["recorded", "recorded"]


def test_search_recommends_a_setting_without_oom(snapshots):
    sim = simulate(load(snapshots / "fragmentation-oom/default-oom.pickle"), search=True,
                   capacity=Capacity(limit_bytes=FRAG_CAP, kind="fraction", source="README"))
    assert sim.self_replay.oom is not None
    rec = sim.recommendation
    assert rec is not None and rec.result.oom is None
    assert rec.result.peak_reserved_bytes == min(r.peak_reserved_bytes for r in sim.results if r.oom is None)
    assert rec.reason == "recorded-runs-out"
    from oomdoctor.simulate.whatif import INCOMPATIBILITIES
    changed = [f for f in INCOMPATIBILITIES if f != "immediate" and getattr(rec.result.config, f)
               and getattr(rec.result.config, f) != getattr(sim.recorded_config, f)]
    assert changed and rec.incompatibilities == [i for f in changed for i in INCOMPATIBILITIES[f]] + (
        INCOMPATIBILITIES["immediate"] if rec.result.deferred_frees == "immediate" else [])


def test_immediate_frees_predict_the_modern_run(snapshots):
    modern = _stats(snapshots, "tp-allreduce", "tp-modern-b4096", 0)["max_reserved"]
    legacy_exp = _stats(snapshots, "tp-allreduce", "tp-legacy-expandable-b4096", 0)["max_reserved"]
    prepared = prepare(load(snapshots / "tp-allreduce/legacy-rank0.pickle"))
    imm = replay(prepared, deferred_frees=IMMEDIATE)
    assert abs(imm.peak_reserved_bytes - modern) / modern <= 0.05
    exp = replay(prepared, parse_config("expandable_segments:True"))
    assert exp.peak_reserved_bytes > 1.8 * modern and legacy_exp > 1.8 * modern  # far above, like the real run


def test_cli_simulate_json_contract(snapshots, capsys):
    path = str(snapshots / "tp-allreduce/legacy-rank0.pickle")
    assert main(["simulate", path, "--immediate-frees", "--config", "expandable_segments:True",
                 "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recorded"] == {"config": "", "peak_reserved_bytes": 3_053_453_312,
                               "peak_allocated_bytes": 1_308_622_848, "oom_event_index": None}
    rows = [(r["config"], r["deferred_frees"]) for r in out["results"]]
    assert rows == [("", "recorded"), ("", "immediate"), ("expandable_segments:True", "recorded"),
                    ("expandable_segments:True", "immediate")]
    first = out["results"][0]
    assert first["matches_recorded"] is True and first["peak_reserved_bytes"] == 3_053_453_312
    assert out["results"][1]["matches_recorded"] is None and out["results"][1]["oom"] is None
    for r in out["results"]:
        assert set(r) >= {"config", "deferred_frees", "peak_reserved_bytes", "peak_allocated_bytes", "oom",
                          "matches_recorded"}


def test_cli_simulate_oom_with_cap(snapshots, capsys):
    path = str(snapshots / "fragmentation-oom/default-oom.pickle")
    assert main(["simulate", path, "--cap", str(FRAG_CAP), "--config", "expandable_segments:True",
                 "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["capacity"]["limit_bytes"] == FRAG_CAP and out["capacity"]["kind"] == "fraction"
    assert out["results"][0]["oom"] == {"event_index": 13760, "requested_bytes": 4_063_232_000,
                                        "alloc_size_bytes": 4_064_280_576}
    assert out["results"][1]["oom"] is None


@pytest.mark.parametrize("args, message", [
    (["--config", "bogus:1"], "Unrecognized key 'bogus'"),
    (["--config", "max_split_size_mb:8"], "too small"),
    (["--cap", "lots"], "cannot read 'lots' as a size"),
    (["--cap-kind", "device"], "--cap-kind needs --cap"),
])
def test_cli_simulate_bad_input_is_one_line(snapshots, capsys, args, message):
    assert main(["simulate", str(snapshots / "tp-allreduce/legacy-rank0.pickle"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_diagnose_carries_predictions(snapshots, capsys):
    assert main(["diagnose", str(snapshots / "tp-allreduce/legacy-rank0.pickle"), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    f = next(f for f in out["findings"] if f["id"] == "deferred-free")
    p = f["prediction"]
    assert p["deferred_frees"] == "immediate" and p["peak_reserved_bytes"] == 1_308_622_848
    assert p["recorded_peak_reserved_bytes"] == 3_053_453_312 and p["self_replay_exact"] is True
    exp = next(fx for fx in f["fixes"] if fx["what_if"] == {"config": "expandable_segments:True"})
    assert exp["prediction"]["peak_reserved_bytes"] > 2 * GiB


def test_diagnose_fragmentation_prediction(snapshots, capsys):
    assert main(["diagnose", str(snapshots / "fragmentation-oom/default-oom.pickle"), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    f = next(f for f in out["findings"] if f["id"] == "fragmentation")
    p = f["prediction"]
    assert p["config"] == "expandable_segments:True" and p["oom"] is None
    assert p["recorded_oom_event_index"] == 13760 and p["peak_reserved_bytes"] < p["recorded_peak_reserved_bytes"]
