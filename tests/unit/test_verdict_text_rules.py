"""The verdict as the user reads it: its sentences, its evidence and its actions, pinned rule by rule.

- ``report/verdict.py`` ``rank_verdict``: the evidence every rank's verdict starts from (rank, peak reserved and
  allocated bytes, the room and its source, phase, step or ``-``, kept outputs), the KV cache named from
  :data:`KV_CACHE_FRACTION` of the allocated bytes, the micro-batches in flight at an OOM, the healthy summaries
  (with the room, at the edge under :data:`EDGE_FRACTION` of it with ``headroom_percent`` to one decimal, with a
  KV cache at the edge, without the room), and which kinds ask ``fits()`` for their actions.
- ``_oom_verdict``: the whole sentence of every branch (growth, capacity with the room known or not, with the
  micro-batches in flight, the KV cache and each answer about what fits, deferred-free, fragmentation with CUDA
  graph pools and the defragmented replay, capacity when that replay still runs out), and the boundaries a
  shortfall of one byte and 64 MiB pending decide.
- ``_actions``: the exact list of actions of each kind: capacity (pipeline knob from two micro-batches in flight,
  the KV cache, the largest micro-batch or else the scale, activation checkpointing, sharding the optimizer from
  64 MiB, the first detected framework with an ``activations`` knob), fragmentation (the setting not simulated,
  simulated and enough, simulated and not enough, the smaller micro-batch), the fix of the finding a verdict rests
  on (its first applicable one, taken literally; for ``imbalance`` the finding on this rank alone), the loss's
  logits with a framework's ``logits`` knob or the generic advice.
- ``with_findings``: which finding decides a rank without an OOM (growth at any size, the others from
  :data:`VERDICT_FRACTION` of the peak reserved, on this rank's share), its sentence and its action.
- ``_logits``: which holders are the loss's logits and from which share of the allocated bytes they are named.
- ``_fit_sentence``: the estimate's whole sentence.

The OOM traces are ``test_verdict_rules.oom_rank``'s (one 1 GiB segment, 512 MiB live, free gaps of 256 MiB),
the trace without OOM is built here; findings, fits and frames are given directly, so every expected number is
arithmetic on the bytes placed here and every sentence is the documented one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from builder import MiB, SnapBuilder
from test_verdict_rules import ALLOCATED, RANK, RESERVED, Calls, oom_rank

from oomdoctor import load
from oomdoctor.analysis import analyze
from oomdoctor.detectors.finding import Finding, FindingTitle, Fix, SiteRef
from oomdoctor.frameworks import framework
from oomdoctor.render.format import fill, format_bytes
from oomdoctor.render.words import findings as finding_words
from oomdoctor.render.words import verdict as words
from oomdoctor.report.fits import Fits, Room
from oomdoctor.report.verdict import (
    EDGE_FRACTION,
    KV_CACHE_FRACTION,
    LOGITS_FRACTION,
    VERDICT_FRACTION,
    Action,
    Verdict,
    _actions,
    _fit_reason,
    _logits,
    _oom_verdict,
    rank_verdict,
    with_findings,
)

GiB = 1024 * MiB
B = format_bytes

LIGHTNING = "/venv/lib/python3.12/site-packages/lightning/pytorch/trainer/trainer.py"
HF_TRAINER = "/venv/lib/python3.12/site-packages/transformers/trainer.py"
DDP = "/venv/lib/python3.12/site-packages/torch/nn/parallel/distributed.py"
ACCELERATE = "/venv/lib/python3.12/site-packages/accelerate/accelerator.py"
DEEPSPEED = "/venv/lib/python3.12/site-packages/deepspeed/runtime/engine.py"
TRAIN = "/work/train.py"

PIPELINE = ("Hold fewer micro-batches in flight: a 1F1B schedule holds at most one per later stage, GPipe all of "
            "them; or an interleaved schedule, more pipeline stages, or activation checkpointing inside the stages.")
KV = "Make the KV cache smaller or steadier: " + framework("generate").knobs["kv-cache"] + "."
CHUNKS = "compute the loss in chunks or fuse the LM head with the cross-entropy"


def use_mb(n) -> str:
    return f"Use a per-device micro-batch of at most {n} and more gradient accumulation steps to keep the global batch."


def cut(scale) -> str:
    return (f"Cut the per-device micro-batch to {scale}x the current one (give --micro-batch N to get the number) and "
            "accumulate gradients to keep the global batch.")


def ckpt(n) -> str:
    return (f"Activation checkpointing frees at most {B(n)} (the activations saved for backward at the peak; "
            "recomputation adds back one layer's).")


def shard(n) -> str:
    return f"Sharding the optimizer state over the data-parallel ranks (ZeRO-1 / FSDP) frees {B(n)}."


def not_simulated(setting) -> str:
    return (f"Set PYTORCH_ALLOC_CONF={setting} (PYTORCH_CUDA_ALLOC_CONF before PyTorch 2.9) so that free memory is not "
            "stranded between segments (not simulated: the allocator model cannot replay this recording).")


HEAVIEST = 800 * MiB  # the heaviest recorded step's peak allocated: the condition a claim holds under (issue 49)
CONT = {"outcome": "later-steps", "heaviest_step_peak_allocated_bytes": HEAVIEST, "margin_bytes": None,
        "margin": {"reserved_step_spread_bytes": None, "unrecorded_bytes": 0}}
CONDITION = f"for steps whose tensors peak at up to {B(HEAVIEST)}, the heaviest recorded"
PAST_PEAK = 700 * MiB
PAST = (f"gets past the recorded OOM and through the recorded steps (peak reserved {B(PAST_PEAK)}); the rest of the "
        "step was not recorded (no complete step before it to replay): it holds " + CONDITION)


def completes(peak: int, extended: int) -> str:
    """The words of a ``step-completed`` prediction without a known room (render/words/predict.py)."""
    return (f"gets past the recorded OOM and through the recorded steps (peak reserved {B(peak)}); the rest of the "
            "step, replayed as the previous step ran it, completes"
            + (f", peaking at {B(extended)}" if extended > peak else "") + ", " + CONDITION)


def ran_out(peak: int, request: int) -> str:
    """The words of a ``step-ran-out`` prediction without a known room."""
    return (f"gets past the recorded OOM and through the recorded steps (peak reserved {B(peak)}), but the rest of "
            f"the step, replayed as the previous step ran it, runs out of memory asking for {B(request)}")


def simulated(setting, outcome) -> str:
    return f"Set PYTORCH_ALLOC_CONF={setting} (PYTORCH_CUDA_ALLOC_CONF before PyTorch 2.9): simulated, it {outcome}."


def not_enough(setting) -> str:
    return (f"Set PYTORCH_ALLOC_CONF={setting} (PYTORCH_CUDA_ALLOC_CONF before PyTorch 2.9) to stop stranding free "
            "memory; simulated, it is not enough here: lower the micro-batch too.")


def logits(n, sites, knob=CHUNKS) -> str:
    return f"The loss's logits hold {B(n)} ({sites}): {knob}."


def fixed(*fixes: tuple[str, bool | None]) -> list[Fix]:
    """Fixes by id (the words of a fix id are render/words/findings.py's, tested in test_words_findings)."""
    return [Fix(fix_id, "any", "test", applies=applies) for fix_id, applies in fixes]


def finding(id: str, bytes_: int, per_rank: dict | None = None, ranks=(RANK,), severity="high", fixes=(),
            variant="") -> Finding:
    return Finding(id, severity, list(ranks), bytes_, per_rank_bytes=dict(per_rank or {}), fixes=list(fixes),
                   variant=variant)


def rendered(v: Verdict) -> list[str]:
    """The actions: a finding's fix by its id (the fix itself is the action), the others in words."""
    ev = finding_words.verdict_evidence(v.evidence)
    return [a.fix.id if a.fix is not None else fill(words.action_template(a, v.evidence), ev) for a in v.to_do]


def bd(outputs=0, kv=None, allocated=ALLOCATED, step=None, phase="forward"):
    cats = {"outputs": outputs}
    if kv is not None:
        cats["kv_cache"] = kv
    return SimpleNamespace(phase=phase, step=step, categories=cats, allocated_bytes=allocated)


def fake(*files: str):
    """What ``_actions`` reads of an analysis: the frames of its stacks, ``(file, line, name)``, in one stack."""
    return SimpleNamespace(trace=SimpleNamespace(stacks=SimpleNamespace(frames=[(f, 1, "f") for f in files],
                                                                        stacks=[tuple(range(len(files)))])))


# --------------------------------------------------------------------------- the traces

@pytest.fixture(scope="module")
def a768(tmp_path_factory):
    """Asks 768 MiB with 512 MiB live: need 1.25 GiB."""
    return oom_rank(tmp_path_factory.mktemp("a768"), 768 * MiB)


@pytest.fixture(scope="module")
def a384(tmp_path_factory):
    """Asks 384 MiB with 512 MiB live: need 896 MiB, under the 1 GiB reserved."""
    return oom_rank(tmp_path_factory.mktemp("a384"), 384 * MiB)


CAP_ROOM = RESERVED + 128 * MiB  # with a768: need 1280 MiB, a shortfall of 128 MiB
CAP_SHORT = ALLOCATED + 768 * MiB - CAP_ROOM
FRAG_ROOM = RESERVED + 128 * MiB  # with a384: 640 MiB free for 384 MiB, not in one piece (256 MiB gaps)


def verdict(a, room, findings=(), b=None, holders=(), fits=None, defragmented=None):
    calls = Calls(fits)
    v = rank_verdict(a, list(findings), Room(bytes=room, kind="device" if room is not None else "none",
                                             source="oom-device"),
                     b if b is not None else bd(), list(holders), calls, lambda: defragmented)
    return v, calls


def judge(a, room, ev_extra=None, mine=(), outputs=0, fits=None, defragmented=None):
    """``_oom_verdict`` as ``rank_verdict`` calls it, with the evidence it starts from."""
    ev = {"rank": a.rank, "phase": "forward", "room_bytes": room, **(ev_extra or {})}
    calls = Calls(fits)
    v = _oom_verdict(a, list(mine), Room(bytes=room, kind="device" if room is not None else "none",
                                         source="oom-device"),
                     bd(outputs), calls, (lambda: defragmented), ev)
    return v, calls


CAPACITY = (f"the live tensors ({B(ALLOCATED)}) plus the failed request ({B(768 * MiB)}) need "
            f"{B(ALLOCATED + 768 * MiB)}, {B(CAP_SHORT)} more than the {B(CAP_ROOM)} the allocator could use on this "
            "GPU: no allocator setting helps.")
FRAGMENTATION = (f"{B(FRAG_ROOM - ALLOCATED)} were free ({B(RESERVED - ALLOCATED)} reserved but not allocated and "
                 f"{B(FRAG_ROOM - RESERVED)} not yet reserved on the device) for a request of {B(384 * MiB)}, "
                 f"but not in one piece (largest free block {B(256 * MiB)}).")


# --------------------------------------------------------------------------- _oom_verdict: its sentences

def test_capacity_sentence_whole(a768):
    v, _ = judge(a768, CAP_ROOM)
    assert v.kind == "capacity" and words.summary(v) == CAPACITY


@pytest.mark.parametrize("in_flight, kv, fits, tail", [
    (3, None, None, " 3 micro-batches were in flight, their activations awaiting their backward: the pipeline "
                    "schedule holds them at once."),
    (-2, None, None, ""),  # two passes alive without a pipeline (issue 49): nothing said of a schedule
    (1, 300 * MiB, None, f" The KV cache holds {B(300 * MiB)}, and grows with the batch and every generated token."),
    (2, 300 * MiB, Fits(1, "t", largest_micro_batch=2),
     " 2 micro-batches were in flight, their activations awaiting their backward: the pipeline schedule holds them at "
     f"once. The KV cache holds {B(300 * MiB)}, and grows with the batch and every generated token. The largest "
     "micro-batch that fits: 2."),
    (None, None, Fits(1, "t", batch_scale=0.5), " What fits: 0.5x the current micro-batch."),
], ids=["in-flight", "no-pipeline", "kv-cache", "all", "scale"])
def test_capacity_sentence_with_its_additions(a768, in_flight, kv, fits, tail):
    extra = {}
    if in_flight is not None:  # negative: that many passes alive, without a pipeline's evidence
        extra["in_flight"] = abs(in_flight)
        if in_flight > 0:
            extra["schedule_evidence"] = "sidecar-stage"
    if kv is not None:
        extra["kv_cache_bytes"] = kv
    v, calls = judge(a768, CAP_ROOM, extra, fits=fits)
    assert v.kind == "capacity" and calls.n == 1
    assert words.summary(v) == CAPACITY + tail


def test_capacity_with_an_unknown_room_sentence_whole(a768):
    v, _ = judge(a768, None)
    assert words.summary(v) == (
        f"out of memory asking for {B(768 * MiB)} with {B(ALLOCATED)} allocated; the GPU's room is unknown, so "
        "capacity cannot be told from fragmentation.")


def test_growth_sentence_whole_and_a_shortfall_of_one_byte_is_enough(a768):
    need = ALLOCATED + 768 * MiB
    v, _ = judge(a768, need - 1, outputs=64 * MiB)  # short == 1: kept 64 MiB covers it
    assert (v.kind, v.bytes) == ("growth", 64 * MiB) and v.evidence["shortfall_bytes"] == 1
    assert words.summary(v) == (
        f"out of memory after {B(64 * MiB)} were kept across micro-batches (outputs gathered or cached, forward "
        "phase): the job accumulates; a larger GPU only delays it.")


def test_deferred_free_sentence_whole(tmp_path):
    a = oom_rank(tmp_path, 384 * MiB, pending=128 * MiB)
    v, _ = judge(a, ALLOCATED + 384 * MiB)
    assert v.kind == "deferred-free"
    assert words.summary(v) == (
        f"{B(128 * MiB)} freed by Python were still held for other streams (record_stream) at the OOM; without them "
        "the request fits.")


@pytest.mark.parametrize("fits, tail", [
    (None, ""),
    (Fits(1, "t", largest_micro_batch=2), " With the recorded settings the largest micro-batch that fits is 2."),
    (Fits(1, "t", batch_scale=0.5), " With the recorded settings 0.5x the current micro-batch fits."),
], ids=["none", "whole", "scale"])
def test_fragmentation_sentence_whole(a384, fits, tail):
    v, calls = judge(a384, FRAG_ROOM, fits=fits)
    assert v.kind == "fragmentation" and calls.n == 1
    assert words.summary(v) == FRAGMENTATION + tail


def test_fragmentation_sentence_with_graph_pools_and_the_defragmented_replay(tmp_path):
    a = oom_rank(tmp_path, 384 * MiB, graph_pool=128 * MiB)
    pred = {"config": "expandable_segments:True", "reach": "step-completed", "oom": None, "outcome": "step-completed",
            "peak_reserved_bytes": 800 * MiB, "extended_peak_reserved_bytes": 900 * MiB, "continuation": CONT}
    v, _ = judge(a, FRAG_ROOM, defragmented=pred, fits=Fits(1, "t", largest_micro_batch=4))
    assert v.kind == "fragmentation"
    # the graph's segment is reserved too: every free byte is reserved, none is left to reserve
    assert words.summary(v) == (
        f"{B(FRAG_ROOM - ALLOCATED)} were free ({B(FRAG_ROOM - ALLOCATED)} reserved but not allocated) for a request "
        f"of {B(384 * MiB)}, but not in one piece (largest free block {B(256 * MiB)}). {B(128 * MiB)} were reserved "
        "by CUDA graph private pools (torch.compile "
        "mode='reduce-overhead'): their free space serves only their graphs, and the allocator cannot release "
        "cached segments while a graph is being captured. Simulated with expandable_segments:True, it "
        + completes(800 * MiB, 900 * MiB) + ". With the recorded settings the largest micro-batch that fits is 4.")


@pytest.mark.parametrize("fits, tail", [
    (Fits(1, "t", largest_micro_batch=2), " With the recorded settings the largest micro-batch that fits is 2."),
    (Fits(1, "t", batch_scale=0.25), " With the recorded settings 0.25x the current micro-batch fits."),
], ids=["whole", "scale"])
def test_step_ran_out_sentence_whole(a384, fits, tail):
    # issue 49: the fix gets through the recorded steps, so the recorded OOM was fragmentation; the rest of the step
    # running out is said, and changes no cause
    pred = {"config": "expandable_segments:True", "reach": "step-ran-out", "oom": None, "outcome": "step-ran-out",
            "peak_reserved_bytes": 800 * MiB, "extended_oom_requested_bytes": 900 * MiB, "continuation": CONT}
    v, _ = judge(a384, FRAG_ROOM, defragmented=pred, fits=fits)
    assert v.kind == "fragmentation" and "continuation-runs-out" in v.reasons
    assert words.summary(v) == (
        FRAGMENTATION + " Simulated with expandable_segments:True, it " + ran_out(800 * MiB, 900 * MiB) + "." + tail)


# --------------------------------------------------------------------------- _fit_reason: the estimate

def test_fit_reason_estimate_whole():
    ev = {}
    f = Fits(1, "t", estimated_largest_micro_batch=5, assumptions=["parameters-trained", "optimizer-state-seen"])
    assert _fit_reason(f, ev) == ["fit-estimate"]
    # ids; their words: test_words_verdict, test_words_fits
    assert ev == {"estimated_fit": 5, "estimate_assumptions": ["parameters-trained", "optimizer-state-seen"]}


# --------------------------------------------------------------------------- rank_verdict: healthy

def healthy_rank(tmp_path, segment: int, first: int, second: int):
    """One segment of ``segment`` bytes, two blocks allocated one after the other (peak allocated their sum at the
    second, peak reserved the segment at the first event); no OOM."""
    b = SnapBuilder()
    s = b.segment(segment)
    b.alloc(s, 0, first)
    b.alloc(s, first, second)
    return analyze(load(b.write(tmp_path / f"rank{RANK}.pickle")))


@pytest.fixture(scope="module")
def h900(tmp_path_factory):
    """900 MiB reserved, 256 + 512 MiB allocated."""
    return healthy_rank(tmp_path_factory.mktemp("h900"), 900 * MiB, 256 * MiB, 512 * MiB)


PEAK = 900 * MiB
PEAK_ALLOC = 768 * MiB


def test_healthy_evidence_and_sentence_with_the_room(h900):
    room = 2 * GiB
    v, calls = verdict(h900, room, b=bd(outputs=5 * MiB, step=7, allocated=PEAK_ALLOC))
    assert (v.kind, v.bytes, v.ranks, v.headroom_bytes, v.finding, v.to_do) == (
        "healthy", PEAK, [RANK], room - PEAK, None, [])
    assert v.evidence == {"rank": RANK, "peak_reserved_bytes": PEAK, "peak_allocated_bytes": PEAK_ALLOC,
                          "room_bytes": room, "room_source": "oom-device", "room_source_values": {}, "phase": "forward", "step": 7,
                          "outputs_bytes": 5 * MiB, "window_peak_reserved_bytes": PEAK,
                          "window_peak_allocated_bytes": PEAK_ALLOC, "job_peak_reserved_bytes": PEAK,
                          "job_peak_allocated_bytes": PEAK_ALLOC, "peak_source": "trace",
                          "headroom_bytes": room - PEAK}
    assert words.summary(v) == (
        f"no OOM and nothing worth fixing; peak reserved {B(PEAK)} of the {B(room)} the allocator could use on this "
        f"GPU ({B(room - PEAK)} headroom), peak allocated {B(PEAK_ALLOC)} in the forward phase.")
    assert calls.n == 0


def test_healthy_without_the_room(h900):
    v, _ = verdict(h900, None, b=bd(step=None, phase="backward"))
    assert v.headroom_bytes is None and "headroom_bytes" not in v.evidence and v.evidence["step"] == "-"
    assert v.evidence["room_bytes"] is None and v.evidence["room_source"] == "oom-device"
    assert words.summary(v) == (
        f"no OOM and nothing worth fixing; peak reserved {B(PEAK)}, peak allocated {B(PEAK_ALLOC)} in the backward "
        "phase (the GPU's size is not recorded).")


def test_headroom_of_exactly_a_tenth_of_the_room_is_not_the_edge(h900):
    room = 1000 * MiB  # headroom 100 MiB == EDGE_FRACTION * room exactly
    assert room - PEAK == EDGE_FRACTION * room
    v, _ = verdict(h900, room)
    assert "headroom_percent" not in v.evidence
    assert words.summary(v).startswith("no OOM and nothing worth fixing; ")
    v, _ = verdict(h900, room - 1)  # one byte less room: under a tenth
    assert v.evidence["headroom_percent"] == 10.0
    assert words.summary(v) == (
        f"at the edge: no OOM and nothing worth fixing; peak reserved {B(PEAK)} of the {B(room - 1)} the allocator "
        f"could use on this GPU ({B(room - 1 - PEAK)} headroom), peak allocated {B(PEAK_ALLOC)} in the forward phase.")


@pytest.mark.parametrize("room, exact, percent", [
    (993_701_590, 5.030, 5.0),  # headroom 49_983_190 B
    (996_114_841, 5.260, 5.3),  # headroom 52_396_441 B
])
def test_headroom_percent_to_one_decimal(h900, room, exact, percent):
    assert round(100 * (room - PEAK) / room, 3) == exact
    v, _ = verdict(h900, room)
    assert v.evidence["headroom_percent"] == percent


def test_no_headroom_is_zero_percent(tmp_path):
    a = healthy_rank(tmp_path, 4096, 512, 512)
    v, _ = verdict(a, 1000)  # the room (1000 B) under the 4 KiB reserved: headroom -3096 B
    assert v.headroom_bytes == 1000 - 4096 and v.evidence["headroom_percent"] == 0.0


def test_kv_cache_named_at_the_edge_only(h900):
    kv = 200 * MiB
    v, _ = verdict(h900, 950 * MiB, b=bd(kv=kv, allocated=PEAK_ALLOC))
    assert v.evidence["kv_cache_bytes"] == kv
    assert words.summary(v) == (
        f"at the edge: no OOM and nothing worth fixing; peak reserved {B(PEAK)} of the {B(950 * MiB)} the allocator "
        f"could use on this GPU ({B(50 * MiB)} headroom), peak allocated {B(PEAK_ALLOC)} in the forward phase. The KV "
        f"cache holds {B(kv)}: it grows with the batch and with every generated token.")
    v, _ = verdict(h900, 2 * GiB, b=bd(kv=kv, allocated=kv))
    assert v.evidence["kv_cache_bytes"] == kv and "KV cache" not in words.summary(v)


@pytest.mark.parametrize("kv, allocated, named", [
    (200 * MiB, 1000 * MiB, True),  # exactly KV_CACHE_FRACTION of the allocated bytes
    (200 * MiB - 1, 1000 * MiB, False),
    (1, 0, True),  # nothing allocated: measured against one byte
    (None, 0, False),  # no KV cache category at all
    (0, 1000 * MiB, False),
])
def test_kv_cache_from_a_fifth_of_the_allocated_bytes(h900, kv, allocated, named):
    if kv == 200 * MiB:
        assert kv == KV_CACHE_FRACTION * allocated
    v, _ = verdict(h900, 2 * GiB, b=bd(kv=kv, allocated=allocated))
    assert ("kv_cache_bytes" in v.evidence) is named
    if named:
        assert v.evidence["kv_cache_bytes"] == kv


def test_healthy_rank_re_read_against_its_findings(h900):
    f = finding("deferred-free", PEAK // 10 + 1, fixes=fixed(("free earlier", None)), variant="at-peak")
    v, _ = verdict(h900, 2 * GiB, findings=[f])
    assert (v.kind, v.finding, v.headroom_bytes) == ("deferred-free", "deferred-free", 2 * GiB - PEAK)
    assert rendered(v) == ["free earlier"]


# --------------------------------------------------------------------------- rank_verdict at an OOM

def test_oom_evidence_has_the_micro_batches_in_flight(a768):
    # the builder's blocks are allocated in /work/train.py, none an activation: none in flight
    v, _ = verdict(a768, CAP_ROOM)
    assert v.evidence["in_flight"] == 0 and v.evidence["step"] == "-"


def test_capacity_actions_through_rank_verdict(a768):
    fits = Fits(CAP_ROOM, "t", largest_micro_batch=3, checkpointing_frees_at_most_bytes=300 * MiB)
    v, calls = verdict(a768, CAP_ROOM, fits=fits)
    assert v.kind == "capacity" and calls.n == 2  # what fits, for the sentence and for the actions
    assert rendered(v) == [use_mb(3), ckpt(300 * MiB)]
    assert v.evidence["checkpointing_frees_bytes"] == 300 * MiB


def test_growth_asks_nothing_of_fits(a768):
    v, calls = verdict(a768, CAP_ROOM, b=bd(outputs=200 * MiB), fits=Fits(1, "t", largest_micro_batch=3))
    assert v.kind == "growth" and calls.n == 0 and v.to_do == []


def test_fragmentation_actions_through_rank_verdict(a384):
    v, _ = verdict(a384, FRAG_ROOM, fits=Fits(1, "t", largest_micro_batch=2))
    assert v.kind == "fragmentation"
    assert rendered(v) == [not_simulated("expandable_segments:True")]  # no micro-batch cut: the setting is the fix
    v, _ = verdict(a384, FRAG_ROOM, fits=Fits(1, "t", batch_scale=0.5))
    assert rendered(v) == [not_simulated("expandable_segments:True")]


@pytest.mark.parametrize("pred, action", [
    ({"config": "max_split_size_mb:128", "reach": "step-completed", "oom": None, "outcome": "step-completed",
      "peak_reserved_bytes": 900 * MiB, "extended_peak_reserved_bytes": 900 * MiB, "continuation": CONT},
     simulated("max_split_size_mb:128", completes(900 * MiB, 900 * MiB))),
    ({"config": "expandable_segments:True", "reach": "recorded", "oom": None, "outcome": "past-recorded-oom",
      "peak_reserved_bytes": PAST_PEAK, "continuation": CONT},
     simulated("expandable_segments:True", PAST)),
], ids=["step-completed", "recorded-past"])
def test_fragmentation_action_says_what_the_replay_did(a384, pred, action):
    v, _ = verdict(a384, FRAG_ROOM, defragmented=pred)
    assert v.kind == "fragmentation" and rendered(v) == [action]


def test_a_fix_whose_replay_still_runs_out_is_capacity_fragmentation_hit_first(a384):
    pred = {"config": "expandable_segments:True", "reach": "recorded", "margin_bytes": 0,
            "oom": {"event_index": 5, "requested_bytes": 384 * MiB},
            "outcome": "still-oom"}
    v, _ = verdict(a384, FRAG_ROOM, defragmented=pred, fits=Fits(1, "t", batch_scale=0.5))
    assert (v.kind, v.bytes) == ("capacity", 384 * MiB) and rendered(v) == [cut(0.5)]
    assert "fragmentation hit first, but the job runs out even without it" in words.summary(v)


@pytest.mark.parametrize("spare, kind", [(99 * MiB, "capacity"), (100 * MiB, "fragmentation")])
def test_a_fix_that_gets_through_inside_its_margin_is_at_the_edge_and_capacity(a384, spare, kind):
    pred = {"config": "expandable_segments:True", "reach": "step-completed", "oom": None,
            "outcome": "step-completed", "peak_reserved_bytes": 900 * MiB, "extended_peak_reserved_bytes": 900 * MiB,
            "margin_bytes": 100 * MiB, "spare_bytes": spare, "continuation": CONT,
            "at_edge": spare < 100 * MiB}
    v, _ = verdict(a384, FRAG_ROOM, defragmented=pred, fits=Fits(1, "t", batch_scale=0.5))
    assert v.kind == kind
    if kind == "capacity":  # what the spare room lacks of the margin decides it
        assert v.bytes == 1 * MiB and v.evidence["margin_bytes"] == 100 * MiB and rendered(v) == [cut(0.5)]
        assert "the job is at the edge of the GPU even without it" in words.summary(v)


def test_step_ran_out_is_fragmentation_with_the_setting_alone(a384):
    pred = {"config": "expandable_segments:True", "reach": "step-ran-out", "oom": None, "outcome": "step-ran-out",
            "peak_reserved_bytes": 800 * MiB, "extended_oom_requested_bytes": 900 * MiB, "continuation": CONT}
    v, _ = verdict(a384, FRAG_ROOM, defragmented=pred, fits=Fits(1, "t", batch_scale=0.5))
    assert v.kind == "fragmentation"
    assert rendered(v) == [simulated("expandable_segments:True", ran_out(800 * MiB, 900 * MiB))]


def test_imbalance_action_is_the_fix_of_the_finding_on_this_rank_alone(a768):
    shared = finding("rank-imbalance", 500 * MiB, per_rank={RANK: 500 * MiB, 0: 0}, ranks=(0, RANK),
                     fixes=fixed(("the shared one's fix", None)))
    own = finding("rank-imbalance", 200 * MiB, fixes=fixed(("not here", False), ("balance {shards}", None),
                                                           ("second", True)))
    v, calls = verdict(a768, CAP_ROOM, findings=[shared, own])
    assert (v.kind, v.bytes, v.finding) == ("imbalance", 200 * MiB, "rank-imbalance") and calls.n == 0
    assert rendered(v) == ["balance {shards}"]  # taken literally: braces are no template field


def test_growth_action_is_the_fix_of_its_finding(a768):
    other = finding("deferred-free", 100 * MiB, fixes=fixed(("deferred fix", None)))
    grow = finding("memory-growth", 300 * MiB, fixes=fixed(("detach the kept {outputs}", True)))
    v, _ = verdict(a768, CAP_ROOM, findings=[other, grow])
    assert (v.kind, v.finding) == ("growth", "memory-growth")
    assert rendered(v) == ["detach the kept {outputs}"]


def test_no_action_without_an_applicable_fix_or_the_finding(a768, tmp_path):
    grow = finding("memory-growth", 300 * MiB, fixes=fixed(("no", False)))
    v, _ = verdict(a768, CAP_ROOM, findings=[grow])
    assert (v.kind, v.to_do) == ("growth", [])
    a = oom_rank(tmp_path, 384 * MiB, pending=128 * MiB)
    v, _ = verdict(a, ALLOCATED + 384 * MiB)  # deferred-free from the anatomy, no finding in hand
    assert (v.kind, v.finding, v.to_do) == ("deferred-free", "deferred-free", [])
    df = finding("deferred-free", 128 * MiB, fixes=fixed(("x", False), ("record_stream less", None)))
    v, _ = verdict(a, ALLOCATED + 384 * MiB, findings=[df])
    assert rendered(v) == ["record_stream less"]


def test_logits_named_in_the_evidence_and_the_actions(a768, a384):
    holders = [SiteRef("torch/nn/functional.py:3104 in cross_entropy", 200 * MiB, 1),
               SiteRef("/work/model.py:10 in forward", 900 * MiB, 1)]
    v, _ = verdict(a768, CAP_ROOM, b=bd(allocated=ALLOCATED), holders=holders)
    assert v.evidence["logits_bytes"] == 200 * MiB
    assert v.evidence["logits_sites"] == "torch/nn/functional.py:3104 in cross_entropy"
    assert rendered(v) == [logits(200 * MiB, "torch/nn/functional.py:3104 in cross_entropy")]
    v, _ = verdict(a384, FRAG_ROOM, b=bd(allocated=ALLOCATED), holders=holders)
    assert v.kind == "fragmentation"
    assert rendered(v) == [not_simulated("expandable_segments:True"),
                           logits(200 * MiB, "torch/nn/functional.py:3104 in cross_entropy")]
    v, _ = verdict(a768, CAP_ROOM, b=bd(outputs=200 * MiB, allocated=ALLOCATED), holders=holders)
    assert v.kind == "growth" and "logits_bytes" in v.evidence and v.to_do == []


# --------------------------------------------------------------------------- _actions, kind by kind

def actions(kind, ev=None, fits=None, files=(TRAIN,), mine=(), finding_id=None):
    v = Verdict(kind=kind, bytes=0, ranks=[RANK], headroom_bytes=None, finding=finding_id,
                evidence=dict(ev or {}))
    v.to_do = _actions(v, fake(*files), list(mine), fits)
    return rendered(v), v.evidence


@pytest.mark.parametrize("kind, in_flight, expected", [
    ("capacity", 1, []),
    ("capacity", 2, [PIPELINE]),
    ("capacity", 3, [PIPELINE]),
    ("capacity", -2, []),  # two passes alive without a pipeline's evidence (issue 49): no schedule advice
    ("capacity", None, []),
    ("fragmentation", 2, [not_simulated("expandable_segments:True")]),  # a schedule is no fragmentation's cause
])
def test_pipeline_knob_from_two_micro_batches_in_flight_at_capacity(kind, in_flight, expected):
    ev = {} if in_flight is None else {"in_flight": abs(in_flight)}
    if in_flight is not None and in_flight > 0:
        ev["schedule_evidence"] = "losses-in-one-forward"
    got, _ = actions(kind, ev)
    assert got == expected


@pytest.mark.parametrize("kind, expected", [
    ("capacity", [KV]),
    ("fragmentation", [KV, not_simulated("expandable_segments:True")]),
    ("growth", []),
    ("healthy", []),
])
def test_kv_cache_action_for_capacity_and_fragmentation(kind, expected):
    got, _ = actions(kind, {"kv_cache_bytes": 300 * MiB})
    assert got == expected


@pytest.mark.parametrize("fits, expected", [
    (Fits(1, "t", largest_micro_batch=3, batch_scale=0.75), [use_mb(3)]),
    (Fits(1, "t", largest_micro_batch=0), [use_mb(0)]),
    (Fits(1, "t", batch_scale=0.75), [cut(0.75)]),
    (Fits(1, "t"), []),
    (None, []),
    (Fits(1, "t", checkpointing_frees_at_most_bytes=300 * MiB), [ckpt(300 * MiB)]),
    (Fits(1, "t", sharding_optimizer_frees_bytes=64 * MiB), [shard(64 * MiB)]),
    (Fits(1, "t", sharding_optimizer_frees_bytes=64 * MiB - 1), []),
    (Fits(1, "t", batch_scale=0.5, checkpointing_frees_at_most_bytes=1 * MiB, sharding_optimizer_frees_bytes=GiB),
     [cut(0.5), ckpt(1 * MiB), shard(GiB)]),
], ids=["whole", "whole-zero", "scale", "nothing", "no-fits", "checkpointing", "sharding-64MiB",
        "sharding-under-64MiB", "all"])
def test_capacity_actions_from_what_fits(fits, expected):
    ev = {}
    _fit_reason(fits, ev)  # the summary puts the number what fits into the evidence, as _oom_verdict does
    got, ev = actions("capacity", ev, fits=fits, files=(TRAIN, DDP))  # DDP: data-parallel, unsharded
    assert got == expected
    cp = fits.checkpointing_frees_at_most_bytes if fits is not None else 0
    sh = fits.sharding_optimizer_frees_bytes if fits is not None else 0
    assert ev.get("checkpointing_frees_bytes") == (cp or None)
    assert ev.get("sharding_frees_bytes") == (sh if sh >= 64 * MiB else None)


@pytest.mark.parametrize("files", [(TRAIN,), (TRAIN, DDP, DEEPSPEED)], ids=["no-data-parallel", "sharded"])
def test_no_sharding_action_without_unsharded_data_parallel(files):
    fits = Fits(1, "t", sharding_optimizer_frees_bytes=GiB)
    got, ev = actions("capacity", {}, fits=fits, files=files)
    assert "sharding_frees_bytes" not in ev and shard(GiB) not in got


@pytest.mark.parametrize("files, fw", [
    ((DDP, LIGHTNING), "lightning"),  # DDP has no activations knob: the next detected framework's
    ((LIGHTNING, HF_TRAINER), "hf-trainer"),  # the table's order, not the stack's
    ((DEEPSPEED,), "deepspeed"),
    ((DDP,), None),
    ((TRAIN,), None),
])
def test_capacity_names_the_first_framework_with_an_activations_knob(files, fw):
    got, _ = actions("capacity", {"in_flight": 2, "schedule_evidence": "sidecar-stage"}, files=files)
    expected = [PIPELINE]
    if fw is not None:
        f = framework(fw)
        expected.append(f"{f.name}: {f.knobs['activations']}.")  # braces and quotes as the table writes them
    assert got == expected


def test_only_one_framework_activations_action_and_the_logits_after_it():
    ev = {"logits_bytes": 300 * MiB, "logits_sites": "loss.py:1 in cross_entropy"}
    got, _ = actions("capacity", ev, files=(LIGHTNING, HF_TRAINER))
    hf = framework("hf-trainer")
    assert got == [f"{hf.name}: {hf.knobs['activations']}.",
                   logits(300 * MiB, "loss.py:1 in cross_entropy", hf.knobs["logits"])]


@pytest.mark.parametrize("kind, files, knob", [
    ("capacity", (TRAIN,), CHUNKS),
    ("fragmentation", (DDP, ACCELERATE), framework("accelerate").knobs["logits"]),
    ("capacity", (DDP,), CHUNKS),
    ("growth", (HF_TRAINER,), None),
    ("imbalance", (TRAIN,), None),
])
def test_logits_action_with_the_framework_knob_else_the_generic_advice(kind, files, knob):
    ev = {"logits_bytes": 300 * MiB, "logits_sites": "a, b"}
    got, _ = actions(kind, ev, files=files)
    if kind == "fragmentation":
        assert got == [not_simulated("expandable_segments:True"), logits(300 * MiB, "a, b", knob)]
    elif kind == "capacity":
        assert got == [logits(300 * MiB, "a, b", knob)]
    else:
        assert got == []


@pytest.mark.parametrize("ev, expected", [
    ({}, [not_simulated("expandable_segments:True")]),
    ({"defragmented_config": "max_split_size_mb:64"}, [not_simulated("max_split_size_mb:64")]),
    ({"defragmented_config": "expandable_segments:True", "defragmented_reach": "complete",
      "fix_outcome": "no-oom", "fix_peak_reserved_bytes": GiB, "fix_continuation": CONT},  # to the end, whatever else
     [simulated("expandable_segments:True", f"no OOM, peak reserved {B(GiB)}; later steps: " + CONDITION)]),
    ({"defragmented_config": "expandable_segments:True", "defragmented_reach": "step-completed",
      "fix_oom": {"event_index": 3}, "fix_outcome": "step-completed", "fix_peak_reserved_bytes": GiB,
      "fix_extended_peak_reserved_bytes": GiB, "fix_continuation": CONT},
     [simulated("expandable_segments:True", completes(GiB, GiB))]),
    ({"defragmented_config": "max_split_size_mb:64", "defragmented_reach": "recorded", "fix_oom": None,
      "fix_outcome": "past-recorded-oom", "fix_peak_reserved_bytes": PAST_PEAK, "fix_continuation": CONT},
     [simulated("max_split_size_mb:64", PAST)]),
    ({"defragmented_config": "max_split_size_mb:64", "defragmented_reach": "recorded",
      "fix_oom": {"event_index": 3}, "fix_outcome": "still-oom"},
     [not_enough("max_split_size_mb:64")]),
    ({"defragmented_config": "expandable_segments:True", "defragmented_reach": "recorded",
      "fix_outcome": "past-recorded-oom"},  # no oom field: not said to get past
     [not_enough("expandable_segments:True")]),
    ({"largest_micro_batch": 2}, [not_simulated("expandable_segments:True")]),  # never a micro-batch cut
], ids=["not-simulated", "not-simulated-config", "complete", "step-completed", "recorded-past", "recorded-oom",
        "recorded-no-oom-field", "smaller-micro-batch"])
def test_fragmentation_actions(ev, expected):
    got, _ = actions("fragmentation", ev, fits=Fits(1, "t", largest_micro_batch=9, checkpointing_frees_at_most_bytes=1,
                                                    sharding_optimizer_frees_bytes=GiB))
    assert got == expected  # nothing of capacity's: no allocator setting is their answer


def test_finding_kinds_take_the_fix_of_their_finding():
    first = finding("memory-growth", 1, fixes=fixed(("growth fix", None)))
    df = finding("deferred-free", 1, fixes=fixed(("skip", False), ("use {stream}.synchronize()", None)))
    got, _ = actions("deferred-free", mine=[first, df], finding_id="deferred-free")
    assert got == ["use {stream}.synchronize()"]
    got, _ = actions("deferred-free", mine=[first], finding_id="deferred-free")  # not among the rank's
    assert got == []
    got, _ = actions("growth", mine=[first, df], finding_id=None)
    assert got == []
    imb_all = finding("rank-imbalance", 1, ranks=(0, RANK), fixes=fixed(("all ranks", None)))
    imb = finding("rank-imbalance", 1, fixes=fixed(("this rank", None)))
    got, _ = actions("imbalance", mine=[imb_all, imb], finding_id="rank-imbalance")
    assert got == ["this rank"]
    got, _ = actions("imbalance", mine=[imb_all], finding_id="rank-imbalance")
    assert got == []


# --------------------------------------------------------------------------- with_findings

def healthy(peak: int, headroom: int | None = 7 * MiB) -> Verdict:
    return Verdict(kind="healthy", bytes=peak, ranks=[RANK], headroom_bytes=headroom, finding=None,
                   evidence={"peak_reserved_bytes": peak, "rank": RANK})


def test_with_findings_sentence_evidence_and_action():
    peak = 1000 * MiB
    f = finding("deferred-free", 900 * MiB, per_rank={RANK: 150 * MiB, 0: 750 * MiB}, ranks=(0, RANK),
                variant="at-peak", fixes=fixed(("a", False), ("sync {s}", None)))
    v = with_findings(healthy(peak), [f])
    assert (v.kind, v.bytes, v.ranks, v.headroom_bytes, v.finding) == (
        "deferred-free", 150 * MiB, [RANK], 7 * MiB, "deferred-free")
    # the finding's title as data (its id and variant): the renderers put its words in
    assert v.evidence == {"peak_reserved_bytes": peak, "rank": RANK, "finding": "deferred-free",
                          "finding_bytes": 150 * MiB, "title": FindingTitle("deferred-free", "at-peak", f.evidence.as_dict())}
    assert words.summary(v) == (
        f"Frees deferred by record_stream hold memory across layers and steps: {B(150 * MiB)} at stake (no OOM in "
        f"this trace; peak reserved {B(peak)}).")
    assert rendered(v) == ["sync {s}"] and v.to_do == [Action(id="finding-fix", fix=f.fixes[1])]


def test_with_findings_no_applicable_fix_no_action():
    v = with_findings(healthy(1000 * MiB), [finding("deferred-free", 500 * MiB, fixes=fixed(("a", False)))])
    assert v.kind == "deferred-free" and v.to_do == []


def test_with_findings_from_a_tenth_of_the_peak_on_this_ranks_share():
    peak = 1000 * MiB
    tenth = 100 * MiB
    assert tenth == VERDICT_FRACTION * peak
    v = with_findings(healthy(peak), [finding("deferred-free", tenth)])
    assert (v.kind, v.bytes) == ("deferred-free", tenth)
    v = with_findings(healthy(peak), [finding("deferred-free", tenth - 1)])
    assert v.kind == "healthy"
    # 9 GiB in all, a tenth less one byte on this rank: not enough
    f = finding("rank-imbalance", 9 * GiB, per_rank={RANK: tenth - 1, 0: 9 * GiB - tenth + 1}, ranks=(0, RANK))
    assert with_findings(healthy(peak), [f]).kind == "healthy"


def test_with_findings_growth_decides_at_any_size():
    v = with_findings(healthy(1000 * MiB), [finding("memory-growth", 1 * MiB)])
    assert (v.kind, v.bytes, v.finding) == ("growth", 1 * MiB, "memory-growth")


def test_with_findings_without_a_peak_every_material_finding_counts():
    v = Verdict(kind="empty", bytes=0, ranks=[RANK], headroom_bytes=None, finding=None,
                evidence={"rank": RANK})
    got = with_findings(v, [finding("deferred-free", 0)])
    assert (got.kind, got.bytes) == ("deferred-free", 0)


def test_with_findings_picks_the_most_bytes_on_this_rank():
    peak = 1000 * MiB
    big_elsewhere = finding("deferred-free", 5 * GiB, per_rank={RANK: 200 * MiB, 0: 5 * GiB - 200 * MiB},
                            ranks=(0, RANK))
    mine = finding("memory-growth", 300 * MiB)
    for order in ([big_elsewhere, mine], [mine, big_elsewhere]):
        v = with_findings(healthy(peak), order)
        assert (v.kind, v.bytes, v.evidence["finding_bytes"]) == ("growth", 300 * MiB, 300 * MiB)


# --------------------------------------------------------------------------- _logits

SITES = ["torch/nn/functional.py:3104 in cross_entropy", "torch/nn/functional.py:2200 in log_softmax",
         "accelerate/utils/operations.py:800 in convert_to_fp32", "model.py:9 in softmax"]


@pytest.mark.parametrize("holders, allocated, ev", [
    ([(SITES[0], 200)], 1000, {"logits_bytes": 200, "logits_sites": SITES[0]}),  # exactly a fifth
    ([(SITES[0], 199)], 1000, {}),
    ([(SITES[0], 100), ("model.py:3 in forward", 900), (SITES[1], 100)], 1000,
     {"logits_bytes": 200, "logits_sites": f"{SITES[0]}, {SITES[1]}"}),
    # a softmax is no loss (an attention's): 300, not 400
    ([(s, 100) for s in SITES], 1000, {"logits_bytes": 300, "logits_sites": ", ".join(SITES[:3])}),
    ([("megatron/core/fusions/fused_softmax.py:210 in forward_torch_softmax", 900)], 1000, {}),
    ([("model.py:3 in forward", 900)], 1000, {}),
    ([(SITES[0], 1)], 0, {"logits_bytes": 1, "logits_sites": SITES[0]}),
    ([], 0, {}),
], ids=["fifth", "under", "mixed", "three-sites", "attention-softmax", "none", "nothing-allocated", "no-holder"])
def test_logits_from_a_fifth_of_the_allocated_bytes(holders, allocated, ev):
    assert LOGITS_FRACTION * 1000 == 200
    got = {}
    _logits([SiteRef(label, b, 1) for label, b in holders], bd(allocated=allocated), got)
    assert got == ev
