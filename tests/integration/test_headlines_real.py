"""Issue 37 on the shared snapshots: the headline agrees with its report, and ``diagnose`` and ``simulate`` print the
same peak for the same setting on the same trace. Facts first (the verdict's evidence, the predictions' bytes),
then the words the two commands print."""

from __future__ import annotations

import json

import pytest

from oomdoctor import load
from oomdoctor.cli.main import main
from oomdoctor.render.format import format_bytes
from oomdoctor.render.words import predict as predict_words
from oomdoctor.render.words import verdict as verdict_words
from oomdoctor.simulate.whatif import simulate

FRAG = "fragmentation-oom/default-oom.pickle"
EXPANDABLE = "expandable_segments:True"


def _out(args, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    assert main(args) in (0, 1)
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def frag(snapshots):
    import oomdoctor

    return oomdoctor.diagnose(str(snapshots / FRAG)).report


def _prediction(report, config: str) -> dict:
    return next(fx.prediction for f in report.findings for fx in f.fixes
                if fx.prediction and fx.prediction["config"] == config)


def test_diagnose_and_simulate_give_one_peak_for_expandable_segments(snapshots, frag, capsys, monkeypatch):
    """The real run with expandable segments peaked at 34.82 GiB reserved (stats.jsonl); the replay of the
    recorded events says 37,339,791,360 bytes (34.78 GiB) in both commands. diagnose once quoted the extended
    step's 31.06 GiB (later 34.36 GiB), a number simulate never prints."""
    p = _prediction(frag, EXPANDABLE)
    sim = simulate(load(snapshots / FRAG), configs=[EXPANDABLE])
    replayed = next(r for r in sim.results if str(r.config) == EXPANDABLE)
    assert p["peak_reserved_bytes"] == replayed.peak_reserved_bytes == 37_339_791_360
    assert p["reach"] == "step-completed"
    # issue 49: the recorded steps' spare room is the cap less their replay's peak; the rest of the step's (the
    # continuation's) the cap less the higher of that peak and the completed step's
    assert p["spare_bytes"] == p["capacity_bytes"] - p["peak_reserved_bytes"]
    claim = max(p["peak_reserved_bytes"], p["extended_peak_reserved_bytes"])
    assert p["continuation"]["spare_bytes"] == p["capacity_bytes"] - claim
    # the words: the same 34.78 GiB in both commands' text and in the verdict's sentence
    said = format_bytes(37_339_791_360)
    assert said == "34.78 GiB"
    assert p["outcome"] == "step-completed"
    assert f"through the recorded steps (peak reserved {said})" in predict_words.outcome(p)
    assert said in _out(["simulate", str(snapshots / FRAG), "--config", EXPANDABLE], capsys, monkeypatch)
    text = " ".join(_out(["diagnose", str(snapshots / FRAG)], capsys, monkeypatch).split())
    assert f"(peak reserved {said})" in text
    assert format_bytes(p["extended_peak_reserved_bytes"]) not in text  # below the recorded events' peak: not quoted
    doc = json.loads(_out(["simulate", str(snapshots / FRAG), "--config", EXPANDABLE, "--format", "json"], capsys,
                          monkeypatch))
    assert [r["peak_reserved_bytes"] for r in doc["results"] if r["config"] == EXPANDABLE] == [37_339_791_360]


def test_the_recorded_oom_is_fragmentation_and_its_fix_the_setting(snapshots, frag):
    """Issue 49 on default-oom: the job ran 30 steps at micro-batch 8 with expandable_segments:True (peak reserved
    37,383,831,552 bytes, stats.jsonl). The setting gets the replay past the recorded OOM and through every recorded
    step with 3.66 GiB to spare; the claim's margin is the model's error on this trace (0: exact) and the outside
    memory counted once (0: under a fraction cap the allocator's own limit): fragmentation, the setting first, no
    micro-batch cut. Whether later steps fit is the continuation's: inside the 5.99 GiB the reserved step peaks spread
    by, said as a condition (steps whose tensors peak at up to 34.23 GiB), never the cause."""
    v = frag.verdict
    ev = v.evidence
    assert v.kind == "fragmentation" and ev["defragmented_config"] == EXPANDABLE
    assert [a.id for a in v.to_do] == ["alloc-conf-simulated"]
    sim = simulate(load(snapshots / FRAG), configs=[EXPANDABLE])
    replayed = next(r for r in sim.results if str(r.config) == EXPANDABLE)
    assert replayed.oom is None and ev["fix_oom"] is None
    assert ev["fix_peak_reserved_bytes"] == replayed.peak_reserved_bytes == 37_339_791_360
    assert ev["fix_margin"] == {"model_error_bytes": 0, "outside_bytes": 0} and ev["fix_margin_bytes"] == 0
    assert ev["fix_spare_bytes"] == 41_269_854_208 - 37_339_791_360 and ev["fix_at_edge"] is False
    c = ev["fix_continuation"]
    assert c["outcome"] == "step-completed" and c["at_edge"] is True
    assert c["margin"]["reserved_step_spread_bytes"] == c["margin_bytes"] > c["spare_bytes"]
    assert c["heaviest_step_peak_allocated_bytes"] == replayed.peak_allocated_bytes
    stats = [json.loads(ln) for ln in (snapshots / "fragmentation-oom" / "stats.jsonl").read_text().splitlines()]
    real = next(r for r in stats if r["tag"] == "frag-expandable")
    assert real["oom"] is None  # the claim is confirmed: 30 steps ran with the setting
    text = " ".join(verdict_words.actions(v)[0].split())
    assert text.startswith("Set PYTORCH_ALLOC_CONF=expandable_segments:True")


def test_fragmentation_under_a_memory_fraction_cap_quotes_the_cap(snapshots, frag):
    """The OOM came from set_per_process_memory_fraction (the device still had 100 GiB free): the room is the cap,
    as simulate infers it (its lower end, 41,269,854,208 bytes), not the device's 139 GiB; what was free is the cap
    less the allocated bytes; what fits is replayed, since under the cap the replay reproduces the recording."""
    v = frag.verdict
    ev = v.evidence
    sim = simulate(load(snapshots / FRAG))
    assert sim.capacity.kind == "fraction" and sim.self_replay.matches_recorded
    assert (ev["room_kind"], ev["room_bytes"]) == ("fraction", sim.capacity.limit_bytes) == ("fraction", 41_269_854_208)
    assert ev["free_bytes"] == ev["room_bytes"] - ev["allocated_bytes"] - ev["pending_free_bytes"]
    words = verdict_words.summary(v)
    assert {"fraction-cap", "cap-lower-end"} <= set(v.reasons)  # read off the OOM: known from below, as simulate says
    assert words.startswith(f"{format_bytes(ev['free_bytes'])} were free under a memory-fraction cap of at least "
                            "38.44 GiB")
    assert "on the device" not in words and "does not reproduce" not in words
    fits = frag.ranks[0].fits
    assert fits.batch_scale is not None and fits.room_bytes == 41_269_854_208
    assert not any("does not reproduce" in n for n in fits.notes)


def test_a_healthy_verdict_beside_a_medium_finding_says_so(snapshots):
    """allgather/list: 20 all_gathers into a list; the allgather-list finding is MEDIUM and decides no verdict of its
    own, so the headline is healthy without saying "nothing worth fixing"; the trace is a loop of collectives,
    PyTorch's nccl:all_gather scopes, not "setup only"."""
    import oomdoctor

    report = oomdoctor.diagnose(str(snapshots / "allgather" / "list-rank0.pickle")).report
    v = report.verdict
    assert v.kind == "healthy"
    assert [(f.id, f.severity) for f in report.findings] == [("allgather-list", "medium")]
    assert v.evidence["material_findings"] == 1
    words = verdict_words.summary(v)
    assert "material-findings" in v.reasons
    assert "nothing worth fixing" not in words
    assert words.endswith("The finding below is worth fixing, but it decides no other verdict.")
    assert report.ranks[0].trace_kind == "20 collectives (all_gather), no forward or backward"
    clean = oomdoctor.diagnose(str(snapshots / "allgather" / "tensor-rank0.pickle")).report
    assert clean.verdict.kind == "healthy" and "material_findings" not in clean.verdict.evidence
    assert verdict_words.summary(clean.verdict).startswith("no OOM and nothing worth fixing; ")
