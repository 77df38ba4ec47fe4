"""The verdict of an out-of-memory rank, and the time ``empty_cache()`` churn costs, pinned rule by rule.

- ``report/verdict.py``: ``_oom_verdict`` (each branch of the module doc's list: growth, imbalance, capacity
  with the room known or not, deferred-free, fragmentation, and capacity again when the defragmented replay
  still runs out), with its evidence (``need = allocated + request``, ``shortfall = need - room``,
  ``free = room - allocated``, ``reserved_unallocated = reserved - allocated``), its bytes, ranks and finding,
  and the boundaries between branches (``need == room``, a shortfall of one byte, 64 MiB kept); ``_imbalance``
  through it; ``_fit_sentence`` for each kind of answer about what fits.
- ``detectors/cache_flush.py``: ``_flush_cost`` (the event clock's arithmetic), ``_empty_cache_bursts`` (how
  bursts are classified: free stacks, ``num_alloc_retries`` or unknown), and what a single burst means.

The OOM traces are built here with :class:`builder.SnapBuilder` (blocks at chosen offsets of one segment), and
``_oom_verdict`` is given the room, the rank's findings and the kept outputs directly, so every expected
number is arithmetic on the bytes placed here; the flush traces have their clock set by hand.
"""

from __future__ import annotations

import json
import pickle
import re
from types import SimpleNamespace

import numpy as np
import pytest
from builder import USER, MiB, SnapBuilder, frames

from oomdoctor import load
from oomdoctor.analysis import analyze
from oomdoctor.detectors import cache_flush
from oomdoctor.detectors.context import Context
from oomdoctor.detectors.finding import Finding
from oomdoctor.render.format import format_bytes
from oomdoctor.render.words import verdict as words
from oomdoctor.report.fits import Fits, Room
from oomdoctor.report.verdict import MIN_DECISIVE_BYTES, _fit_reason, _oom_verdict
from oomdoctor.trace.model import SEGMENT_FREE

GiB = 1024 * MiB
RANK = 3


# --------------------------------------------------------------------------- an OOM rank

def _analysis(tmp_path, b: SnapBuilder, meta: dict | None = None, name: str = f"rank{RANK}"):
    path = b.write(tmp_path / f"{name}.pickle")
    if meta is not None:
        (tmp_path / f"{name}.meta.json").write_text(json.dumps(meta))
    return analyze(load(path))


def oom_rank(tmp_path, request: int, pending: int = 0, graph_pool: int = 0):
    """One 1 GiB segment: 256 MiB live at offset 0 and 256 MiB live at 512 MiB (allocated 512 MiB, two free
    gaps of 256 MiB: the largest free block is 256 MiB); with ``pending``, a block of that size at 256 MiB
    freed by Python but held for another stream (``record_stream``), so the first gap shrinks by it; with
    ``graph_pool``, an empty segment of that size in a CUDA graph's private pool. Then an OOM asking for
    ``request`` bytes."""
    b = SnapBuilder()
    seg = b.segment(GiB)
    b.alloc(seg, 0, 256 * MiB)
    b.alloc(seg, 512 * MiB, 256 * MiB)
    if pending:
        p = b.alloc(seg, 256 * MiB, pending)
        b.free(p, deferred=True)
    graph = b.segment(graph_pool) if graph_pool else None
    b.oom(request, device_free=0)
    snap = b.snapshot()
    for s in snap["segments"]:
        if s["address"] == graph:
            s["segment_pool_id"] = (1, 7)  # torch.compile mode='reduce-overhead': a graph's own pool
    path = tmp_path / f"rank{RANK}.pickle"
    path.write_bytes(pickle.dumps(snap))
    return analyze(load(path))


ALLOCATED = 512 * MiB
RESERVED = GiB


def _finding(id: str, bytes_: int, per_rank: dict | None = None, ranks=(RANK,), severity="high") -> Finding:
    return Finding(id, severity, list(ranks), bytes_, per_rank_bytes=dict(per_rank or {}))


class Calls:
    """A ``get_fits`` that counts its calls (a replay costs time: only capacity and fragmentation ask)."""

    def __init__(self, fits: Fits | None) -> None:
        self.fits, self.n = fits, 0

    def __call__(self) -> Fits | None:
        self.n += 1
        return self.fits


def judge(a, room: int | None, mine=(), outputs: int = 0, fits: Fits | None = None, defragmented=None,
          in_flight: int | None = None, schedule: str | None = "sidecar-stage"):
    """``_oom_verdict`` as ``rank_verdict`` calls it, with the evidence it starts from (``schedule``: what says the
    job runs a pipeline, :func:`oomdoctor.report.verdict.schedule_evidence`)."""
    ev = {"rank": a.rank, "phase": "forward", "room_bytes": room}
    if in_flight is not None:
        ev["in_flight"] = in_flight
        if schedule is not None:
            ev["schedule_evidence"] = schedule
    calls = Calls(fits)
    bd = SimpleNamespace(categories={"outputs": outputs}, phase="forward")
    v = _oom_verdict(a, list(mine), Room(bytes=room, kind="device" if room is not None else "none",
                                         source="test"), bd, calls,
                     (lambda: defragmented), ev)
    return v, calls


def said(v) -> str:
    """The summary as the user reads it (strict: every field must be in the evidence, see conftest)."""
    return words.summary(v)


def test_oom_evidence_is_the_arithmetic_of_the_state_at_the_failure(tmp_path):
    request = 768 * MiB
    room = RESERVED + 128 * MiB  # the segment plus 128 MiB the device still had
    v, _ = judge(oom_rank(tmp_path, request), room)
    ev = v.evidence
    assert ev["request_bytes"] == request and ev["allocated_bytes"] == ALLOCATED
    assert ev["need_bytes"] == ALLOCATED + request
    assert ev["reserved_unallocated_bytes"] == RESERVED - ALLOCATED  # PyTorch's "reserved but unallocated"
    assert ev["largest_free_block_bytes"] == 256 * MiB and ev["pending_free_bytes"] == 0
    assert ev["shortfall_bytes"] == ALLOCATED + request - room
    assert ev["free_bytes"] == room - ALLOCATED


def test_the_request_is_the_block_the_allocator_would_have_made(tmp_path):
    # round_size: under 512 bytes -> 512, else the next multiple of 512
    v, _ = judge(oom_rank(tmp_path, 100), RESERVED)
    assert v.evidence["request_bytes"] == 512 and v.evidence["need_bytes"] == ALLOCATED + 512
    (tmp_path / "b").mkdir()
    v, _ = judge(oom_rank(tmp_path / "b", 300 * MiB + 1), RESERVED)
    assert v.evidence["request_bytes"] == 300 * MiB + 512


def test_capacity_when_the_live_tensors_and_the_request_exceed_the_room(tmp_path):
    request = 768 * MiB
    room = RESERVED + 128 * MiB
    short = ALLOCATED + request - room  # 128 MiB
    fits = Fits(room, "test", largest_micro_batch=3)
    v, calls = judge(oom_rank(tmp_path, request), room, fits=fits)
    assert (v.kind, v.bytes, v.ranks, v.finding, v.headroom_bytes) == ("capacity", short, [RANK], None, None)
    assert calls.n == 1 and v.evidence["largest_micro_batch"] == 3
    text = said(v)
    for n in (ALLOCATED, request, ALLOCATED + request, short, room):
        assert format_bytes(n) in text
    assert "no allocator setting helps" in text  # the rule of the kind: not a setting, the tensors do not fit
    assert "in flight" not in text and "KV cache" not in text


def test_capacity_by_one_byte_and_not_at_need_equal_to_room(tmp_path):
    request = 512 * MiB
    need = ALLOCATED + request
    a = oom_rank(tmp_path, request)
    v, _ = judge(a, need - 1)
    assert v.kind == "capacity" and v.bytes == 1 and v.evidence["shortfall_bytes"] == 1
    v, _ = judge(a, need)  # need <= room: enough was free, not in one piece
    assert v.kind == "fragmentation" and v.evidence["shortfall_bytes"] == 0 and v.bytes == need - ALLOCATED


@pytest.mark.parametrize("in_flight, schedule, says", [(None, None, False), (1, "sidecar-stage", False),
                                                       (2, "sidecar-stage", True), (4, "point-to-point", True),
                                                       (2, None, False)])
def test_capacity_names_the_micro_batches_in_flight_from_two(tmp_path, in_flight, schedule, says):
    # two passes alive without anything saying the job runs a pipeline: no schedule is named (issue 49)
    v, _ = judge(oom_rank(tmp_path, 768 * MiB), RESERVED, in_flight=in_flight, schedule=schedule)
    assert v.kind == "capacity"
    text = said(v)
    assert ("micro-batches were in flight" in text) is says
    if says:
        assert f" {in_flight} micro-batches were in flight" in text


def test_capacity_with_an_unknown_room_cannot_tell_capacity_from_fragmentation(tmp_path):
    request = 768 * MiB
    v, _ = judge(oom_rank(tmp_path, request), None)
    assert (v.kind, v.bytes, v.ranks, v.finding) == ("capacity", request, [RANK], None)
    assert "shortfall_bytes" not in v.evidence and "free_bytes" not in v.evidence
    text = said(v)
    assert re.search(r"\bout of memory\b", text)
    assert format_bytes(request) in text and format_bytes(ALLOCATED) in text
    # the reason, in the names of the two kinds
    assert re.search(r"\bcapacity cannot be told from fragmentation\b", text)


def test_growth_when_the_kept_outputs_cover_the_shortfall(tmp_path):
    request = 768 * MiB
    room = RESERVED + 128 * MiB
    short = ALLOCATED + request - room
    a = oom_rank(tmp_path, request)
    kept = 200 * MiB  # >= the shortfall (128 MiB) and >= 64 MiB
    v, calls = judge(a, room, outputs=kept)
    assert (v.kind, v.bytes, v.ranks, v.finding) == ("growth", kept, [RANK], None)
    assert v.evidence["kept_bytes"] == kept and calls.n == 0  # no replay for a verdict that needs none
    text = said(v)
    assert re.search(r"\bout of memory\b", text) and format_bytes(kept) in text
    # kept under the shortfall: the tensors do not fit even without them
    v, _ = judge(a, room, outputs=short - 1)
    assert v.kind == "capacity"


def test_growth_needs_64MiB_kept_at_least(tmp_path):
    request = 512 * MiB + 1 * MiB
    a = oom_rank(tmp_path, request)
    room = ALLOCATED + 512 * MiB  # a shortfall of 1 MiB
    v, _ = judge(a, room, outputs=MIN_DECISIVE_BYTES)
    assert v.kind == "growth" and v.bytes == 64 * MiB
    v, _ = judge(a, room, outputs=MIN_DECISIVE_BYTES - 1)
    assert v.kind == "capacity"


def test_growth_with_an_unknown_room_from_64MiB_kept(tmp_path):
    a = oom_rank(tmp_path, 768 * MiB)
    v, _ = judge(a, None, outputs=64 * MiB)
    assert v.kind == "growth" and v.evidence["kept_bytes"] == 64 * MiB
    v, _ = judge(a, None, outputs=64 * MiB - 1)
    assert v.kind == "capacity"


def test_kept_outputs_without_a_shortfall_or_a_growth_finding_are_no_growth(tmp_path):
    # need <= room: what was kept did not make the difference, unless a finding says memory grows
    request = 384 * MiB
    room = RESERVED + 128 * MiB
    a = oom_rank(tmp_path, request)
    v, _ = judge(a, room, outputs=GiB)
    assert v.kind == "fragmentation"
    v, _ = judge(a, ALLOCATED + request, outputs=GiB)  # need == room: still no shortfall
    assert v.kind == "fragmentation" and v.evidence["shortfall_bytes"] == 0
    v, _ = judge(a, room, mine=[_finding("memory-growth", 100 * MiB)])
    assert (v.kind, v.bytes, v.finding) == ("growth", 100 * MiB, "memory-growth")


def test_growth_names_the_growth_finding_with_the_most_bytes_on_this_rank(tmp_path):
    a = oom_rank(tmp_path, 768 * MiB)
    room = RESERVED + 128 * MiB
    # the output-accumulation finding has more bytes in all, but fewer on this rank: the rank's share decides
    many = _finding("output-accumulation", 1000 * MiB, per_rank={RANK: 100 * MiB, 0: 900 * MiB},
                    ranks=(0, RANK))
    mine = _finding("memory-growth", 300 * MiB, per_rank={RANK: 300 * MiB})
    for order in ([many, mine], [mine, many]):
        v, _ = judge(a, room, mine=order, outputs=150 * MiB)
        assert (v.kind, v.bytes, v.finding) == ("growth", 300 * MiB, "memory-growth")
        assert v.evidence["kept_bytes"] == 300 * MiB
    # the outputs in the breakdown count when they are more than any finding's share
    v, _ = judge(a, room, mine=[many, mine], outputs=400 * MiB)
    assert (v.kind, v.bytes, v.finding) == ("growth", 400 * MiB, "memory-growth")


def test_imbalance_when_this_ranks_excess_covers_the_shortfall(tmp_path):
    request = 768 * MiB
    room = RESERVED + 128 * MiB
    short = ALLOCATED + request - room
    a = oom_rank(tmp_path, request)
    for excess in (short, 5 * short):
        v, calls = judge(a, room, mine=[_finding("rank-imbalance", 9 * GiB, per_rank={RANK: excess})])
        assert (v.kind, v.bytes, v.ranks, v.finding) == ("imbalance", excess, [RANK], "rank-imbalance")
        assert v.evidence["excess_bytes"] == excess and v.evidence["shortfall_bytes"] == short
        assert format_bytes(excess) in said(v) and calls.n == 0
    # one byte short of the shortfall, or a finding on several ranks: capacity
    v, _ = judge(a, room, mine=[_finding("rank-imbalance", 0, per_rank={RANK: short - 1})])
    assert v.kind == "capacity"
    both = _finding("rank-imbalance", 0, per_rank={RANK: short, 0: short}, ranks=(0, RANK))
    v, _ = judge(a, room, mine=[both])
    assert v.kind == "capacity"


def test_imbalance_needs_a_shortfall_one_byte_is_enough(tmp_path):
    request = 512 * MiB
    need = ALLOCATED + request
    a = oom_rank(tmp_path, request)
    imb = [_finding("rank-imbalance", 200 * MiB)]
    v, _ = judge(a, need - 1, mine=imb)
    assert v.kind == "imbalance" and v.evidence["shortfall_bytes"] == 1
    v, _ = judge(a, need, mine=imb)  # nothing short: the excess did not make the difference
    assert v.kind == "fragmentation"
    v, _ = judge(a, None, mine=imb)  # the shortfall unknown: cannot say
    assert v.kind == "capacity"


def test_deferred_free_when_the_pending_frees_made_the_difference(tmp_path):
    pending = 128 * MiB
    request = 384 * MiB
    need = ALLOCATED + request  # 896 MiB
    a = oom_rank(tmp_path, request, pending=pending)
    assert a.anatomy_at(int(a.oom_events[-1])).pending_free_bytes == pending
    # need <= room < need + pending
    for room in (need, need + pending - 1):
        v, calls = judge(a, room)
        assert (v.kind, v.bytes, v.ranks, v.finding) == ("deferred-free", pending, [RANK], "deferred-free")
        assert v.evidence["pending_free_bytes"] == pending and calls.n == 0
        assert v.evidence["reserved_unallocated_bytes"] == RESERVED - ALLOCATED  # the pending block included
        assert format_bytes(pending) in said(v)
    v, _ = judge(a, need + pending)  # room for both: the pending frees were not the difference
    assert v.kind == "fragmentation"


def test_deferred_free_however_few_bytes_pending_made_the_difference(tmp_path):
    """Issue 36: 32 MiB held gives the verdict 64 MiB held gives, where need <= room < need + pending; the
    free bytes said exclude the pending ones."""
    request = 384 * MiB
    need = ALLOCATED + request
    got = []
    for pending in (64 * MiB, 32 * MiB, 512):
        (tmp_path / str(pending)).mkdir()
        v, _ = judge(oom_rank(tmp_path / str(pending), request, pending=pending), need)
        got.append((v.kind, v.bytes, v.evidence["free_bytes"]))
    assert got == [("deferred-free", 64 * MiB, request - 64 * MiB), ("deferred-free", 32 * MiB, request - 32 * MiB),
                   ("deferred-free", 512, request - 512)]


def test_fragmentation_when_enough_was_free_but_not_in_one_piece(tmp_path):
    request = 384 * MiB  # more than the largest free block (256 MiB), less than the free bytes
    room = RESERVED + 128 * MiB
    fits = Fits(room, "test", batch_scale=1.5)
    v, calls = judge(oom_rank(tmp_path, request), room, fits=fits)
    free = room - ALLOCATED
    assert (v.kind, v.bytes, v.ranks, v.finding) == ("fragmentation", free, [RANK], "fragmentation")
    assert v.evidence["free_bytes"] == free and v.evidence["shortfall_bytes"] == ALLOCATED + request - room
    assert "defragmented_config" not in v.evidence and "graph_pool_bytes" not in v.evidence
    assert calls.n == 1 and v.evidence["batch_scale"] == 1.5
    text = said(v)
    for n in (room - ALLOCATED, request, 256 * MiB):
        assert format_bytes(n) in text
    assert "1.5x" in text


def test_fragmentation_says_its_free_bytes_as_the_finding_counts_them(tmp_path):
    """Issue 52 met issue 49 on default-oom: the verdict (now fragmentation) said 7.99 GiB free under the cap, its
    fragmentation finding 7.67 GiB at stake, and nothing said how they meet. The free bytes are the reserved but
    unallocated ones (the finding's), less the deferred frees among them, plus those not yet reserved under the
    room; the verdict says both parts, and they add up to its bytes."""
    request = 384 * MiB  # more than the largest free block (256 MiB), less than the free bytes
    room = RESERVED + 128 * MiB
    v, _ = judge(oom_rank(tmp_path, request), room)
    ev = v.evidence
    assert (v.kind, ev["reserved_unallocated_bytes"], ev["unreserved_bytes"]) == (
        "fragmentation", RESERVED - ALLOCATED, 128 * MiB)
    assert v.bytes == ev["free_bytes"] == ev["reserved_unallocated_bytes"] + ev["unreserved_bytes"]
    assert "free-split" in v.reasons
    assert (f"{format_bytes(room - ALLOCATED)} were free ({format_bytes(RESERVED - ALLOCATED)} reserved but not "
            f"allocated and {format_bytes(128 * MiB)} not yet reserved on the device)") in said(v)
    # 64 MiB freed by Python but held for another stream: not free yet, said as such (need + pending <= room); the
    # verdict's bytes are the free bytes it says (they were room - allocated, the pending frees counted as free)
    (tmp_path / "p").mkdir()
    v, _ = judge(oom_rank(tmp_path / "p", 128 * MiB + 512, pending=64 * MiB), room)
    ev = v.evidence
    assert (v.kind, ev["pending_free_bytes"]) == ("fragmentation", 64 * MiB)
    assert v.bytes == ev["reserved_unallocated_bytes"] - ev["pending_free_bytes"] + ev["unreserved_bytes"]
    assert (f"({format_bytes(RESERVED - ALLOCATED)} reserved but not allocated, less {format_bytes(64 * MiB)} held "
            f"by deferred frees, and {format_bytes(128 * MiB)} not yet reserved on the device)") in said(v)


def test_fragmentation_names_the_bytes_of_cuda_graph_pools(tmp_path):
    request = 384 * MiB
    room = RESERVED + 128 * MiB
    v, _ = judge(oom_rank(tmp_path, request, graph_pool=128 * MiB), room)
    assert v.kind == "fragmentation" and v.evidence["graph_pool_bytes"] == 128 * MiB
    assert v.evidence["reserved_unallocated_bytes"] == RESERVED + 128 * MiB - ALLOCATED
    text = said(v)
    assert format_bytes(128 * MiB) in text and "private pools" in text


def test_fragmentation_says_what_the_defragmented_replay_did(tmp_path):
    fixed = {"config": "expandable_segments:True", "reach": "step-completed", "outcome": "step-completed",
             "peak_reserved_bytes": 900 * MiB, "extended_peak_reserved_bytes": 900 * MiB, "spare_bytes": 77 * MiB,
             "margin_bytes": 10 * MiB, "at_edge": False,
             "continuation": {"outcome": "step-completed", "heaviest_step_peak_allocated_bytes": 800 * MiB,
                              "margin_bytes": None, "margin": {"reserved_step_spread_bytes": None,
                                                               "unrecorded_bytes": 0}}}
    v, _ = judge(oom_rank(tmp_path, 384 * MiB), RESERVED + 128 * MiB, defragmented=fixed)
    assert v.kind == "fragmentation"
    ev = v.evidence
    assert ev["defragmented_config"] == "expandable_segments:True"
    assert ev["defragmented_reach"] == "step-completed"
    # every field of the prediction is kept under fix_; its outcome is the prediction's id
    assert all(ev[f"fix_{k}"] == x for k, x in fixed.items())
    assert ev["defragmented_outcome_template"] == "step-completed" and "fix-simulated" in v.reasons
    text = said(v)
    assert "expandable_segments:True" in text and format_bytes(77 * MiB) in text


def test_a_fix_through_the_recorded_steps_is_fragmentation_even_when_the_rest_of_the_step_runs_out(tmp_path):
    # issue 49: the cause is the recorded OOM's; whether the job keeps running is a second statement that never flips
    # it. The rest of the step, replayed, running out is said with its request; no micro-batch cut is advised
    fixed = {"config": "expandable_segments:True", "reach": "step-ran-out", "outcome": "step-ran-out", "oom": None,
             "peak_reserved_bytes": 900 * MiB, "spare_bytes": 77 * MiB, "margin_bytes": 10 * MiB, "at_edge": False,
             "extended_oom_requested_bytes": 900 * MiB}
    fits = Fits(None, "test", largest_micro_batch=2)
    v, calls = judge(oom_rank(tmp_path, 384 * MiB), RESERVED + 128 * MiB, defragmented=fixed, fits=fits)
    assert (v.kind, v.bytes, v.ranks, v.finding) == ("fragmentation", RESERVED + 128 * MiB - ALLOCATED, [RANK],
                                                     "fragmentation")
    assert v.evidence["extended_request_bytes"] == 900 * MiB and "continuation-runs-out" in v.reasons
    assert calls.n == 1
    text = said(v)
    assert format_bytes(900 * MiB) in text


# --------------------------------------------------------------------------- _fit_reason (its words: test_words_verdict)


@pytest.mark.parametrize("fits, reason, ev", [
    (Fits(1, "t", largest_micro_batch=3), "fit-micro-batch", {"largest_micro_batch": 3}),
    # the whole micro-batch wins over the scale, and only its number is kept
    (Fits(1, "t", largest_micro_batch=3, batch_scale=0.75, notes=["n"]), "fit-micro-batch", {"largest_micro_batch": 3}),
    (Fits(1, "t", batch_scale=0.75, notes=["n"]), "fit-batch-scale", {"batch_scale": 0.75}),
    (Fits(1, "t", largest_micro_batch=0), "fit-micro-batch", {"largest_micro_batch": 0}),  # none fits is an answer
    (Fits(1, "t", batch_scale=0.0), "fit-batch-scale", {"batch_scale": 0.0}),
], ids=["whole", "whole-over-scale", "scale", "whole-zero", "scale-zero"])
def test_fit_reason_is_the_whole_micro_batch_else_the_scale(fits, reason, ev):
    got = {}
    assert _fit_reason(fits, got) == [reason]
    assert got == ev


def test_fit_reason_is_an_estimate_with_its_assumptions():
    assumptions = ["the optimizer state is twice the parameters", "the pass ends as its first layers ran"]
    got = {}
    fits = Fits(1, "t", estimated_largest_micro_batch=5, assumptions=assumptions, notes=["n"])
    assert _fit_reason(fits, got) == ["fit-estimate"]
    assert got["estimated_fit"] == 5
    assert all(x in got["estimate_assumptions"] for x in assumptions)
    assert _fit_reason(Fits(1, "t", estimated_largest_micro_batch=5, bound="lower"), {}) == ["fit-lower-bound"]
    # only a scale estimated: the scale, said of the current micro-batch
    got = {}
    assert _fit_reason(Fits(1, "t", estimated_batch_scale=0.5, assumptions=["a"]), got) == ["fit-estimate"]
    assert re.fullmatch(r"0\.5x\b.*micro-batch", got["estimated_fit"])


def test_fit_reason_without_an_answer_gives_the_last_reason_else_nothing():
    got = {}
    f = Fits(1, "t", notes=["held-to-job-peak", "replay-failed"], note_values={"replay_error": "x"})
    assert _fit_reason(f, got) == ["fit-not-said"]
    assert got == {"no_fit_reason": "replay-failed", "fit_note_values": {"replay_error": "x"}}
    got = {}
    assert _fit_reason(Fits(1, "t", notes=["nothing-grows"]), got) == ["fit-not-said"]
    assert got == {"no_fit_reason": "nothing-grows"}
    for fits in (None, Fits(1, "t")):
        got = {}
        assert _fit_reason(fits, got) == [] and got == {}


# --------------------------------------------------------------------------- cache-flush

EMPTY_CACHE = frames(("/venv/lib/python3.12/site-packages/torch/cuda/memory.py", 224, "empty_cache"),
                     ("/w/train.py", 70, "main"))
# an allocation through torch.cuda.caching_allocator_alloc that made the allocator flush and retry: a frame of
# torch/cuda/memory.py, but not empty_cache()
RETRY_IN_MEMORY_PY = frames(("/venv/lib/python3.12/site-packages/torch/cuda/memory.py", 90,
                             "caching_allocator_alloc"), ("/w/train.py", 80, "main"))
ALL = {"rank": RANK, "recording": {"context": "all"}}  # free stacks recorded
ALLOC_ONLY = {"rank": RANK, "recording": {"context": "alloc"}}
T0 = 1_000_000


def _flushes(fr1=EMPTY_CACHE, fr2=EMPTY_CACHE) -> SnapBuilder:
    """Two flushes on a clock set by hand (µs after T0):

    - 0, 10: segments A, B (before any flush: not counted)
    - 20..40: a block in A allocated and freed
    - 1000, 1300: A and B freed, one burst (no allocation between): 1300 - 40 = 1260
    - 5000: segment C made after the flush: 5000 - 1300 = 3700
    - 5010..5030: a block in C allocated and freed
    - 6000: C freed, a second burst: 6000 - 5030 = 970
    - 6500: an expandable segment D mapped: 6500 - 6000 = 500, then a block allocated in it
    """
    b = SnapBuilder()
    b.t = T0
    sa, sb = b.segment(256 * MiB), b.segment(256 * MiB)
    b.free(b.alloc(sa, 0, 128 * MiB))
    b.t = T0 + 1000
    b.free_segment(sa, fr=fr1)
    b.t = T0 + 1300
    b.free_segment(sb, fr=fr1)
    b.t = T0 + 5000
    sc = b.segment(512 * MiB)
    b.free(b.alloc(sc, 0, 400 * MiB))
    assert b.events[-1]["time_us"] == T0 + 5030
    b.t = T0 + 6000
    b.free_segment(sc, fr=fr2)
    b.t = T0 + 6500
    sd = b.segment(512 * MiB, expandable=True)
    b.alloc(sd, 0, 400 * MiB)
    return b


FLUSH_US = 1260 + 3700 + 970 + 500


def _frees(a):
    return np.flatnonzero(a.device.events["action"] == SEGMENT_FREE)


def test_flush_cost_adds_each_burst_and_each_segment_made_after_the_first(tmp_path):
    a = _analysis(tmp_path, _flushes(), ALL)
    frees = _frees(a)
    assert frees.size == 3
    assert cache_flush._flush_cost(a, frees, np.array([0, 0, 1])) == (FLUSH_US, 2)
    # read as three bursts, A's and B's frees are timed apart: 1000 - 40 and 1300 - 1000 instead of 1300 - 40
    assert cache_flush._flush_cost(a, frees, np.array([0, 1, 2])) == (FLUSH_US, 2)
    # given the second flush alone, only D was made after it
    assert cache_flush._flush_cost(a, frees[2:], np.array([0])) == (970 + 500, 1)


def test_flush_cost_of_no_flush_is_nothing(tmp_path):
    a = _analysis(tmp_path, _flushes(), ALL)
    empty = np.zeros(0, dtype=np.int64)
    assert cache_flush._flush_cost(a, empty, empty) == (0, 0)


def test_flush_cost_times_a_burst_from_the_first_event_of_the_trace(tmp_path):
    b = SnapBuilder()
    b.t = T0
    s = b.segment(64 * MiB)  # event 0
    b.t = T0 + 700
    b.free_segment(s)  # event 1: the burst, 700 µs after the only event before it
    b.t = T0 + 900
    s = b.segment(64 * MiB)  # made after the flush: 200 µs
    b.alloc(s, 0, 64 * MiB)
    a = _analysis(tmp_path, b, ALL)
    frees = _frees(a)
    assert frees.tolist() == [1]
    assert cache_flush._flush_cost(a, frees, np.array([0])) == (700 + 200, 1)


def test_churn_evidence_carries_the_flush_time_and_the_cudamalloc_calls(tmp_path):
    (f,) = cache_flush.detect(Context([_analysis(tmp_path, _flushes(), ALL)]))
    ev = f.evidence
    assert ev.segment_free_bursts == 2 and ev.empty_cache_bursts == 2
    assert ev.allocator_retry_bursts == 0
    assert ev.freed_bytes == 1024 * MiB and ev.reallocated_after_bytes == 1024 * MiB
    assert ev.flush_time_us == FLUSH_US and ev.cuda_malloc_calls_after == 2
    assert f.bytes == 0 and f.severity == "low"  # a speed cost, not memory


def test_retries_counted_by_the_allocator_without_a_flush_in_the_trace_cost_no_time(tmp_path):
    b = SnapBuilder()
    s = b.segment(512 * MiB)
    b.free(b.alloc(s, 0, 400 * MiB))
    b.alloc(s, 0, 500 * MiB)
    meta = {**ALL, "memory_stats": {"num_alloc_retries": 2}}
    (f,) = cache_flush.detect(Context([_analysis(tmp_path, b, meta)]))
    assert f.evidence.num_alloc_retries == 2 and f.evidence.segment_free_bursts == 0
    assert f.evidence.flush_time_us == 0 and f.evidence.cuda_malloc_calls_after == 0


def test_empty_cache_bursts_are_read_off_the_empty_cache_frame(tmp_path):
    a = _analysis(tmp_path, _flushes(EMPTY_CACHE, RETRY_IN_MEMORY_PY), ALL)
    frees = _frees(a)
    burst = np.array([0, 0, 1])
    # another function of torch/cuda/memory.py is no empty_cache() call
    assert cache_flush._empty_cache_bursts(a, frees, burst, 2, 0, False) == (1, "free stacks")
    (f,) = cache_flush.detect(Context([a]))
    assert f.evidence.empty_cache_bursts == 1 and f.evidence.allocator_retry_bursts == 1


def test_one_empty_cache_burst_is_counted_and_is_neither_churn_nor_a_retry(tmp_path):
    a = _analysis(tmp_path, _flushes(EMPTY_CACHE, EMPTY_CACHE), ALL)
    frees = _frees(a)[:2]  # A's and B's: one burst
    assert cache_flush._empty_cache_bursts(a, frees, np.array([0, 0]), 1, 0, False) == (1, "free stacks")
    b = SnapBuilder()
    s = b.segment(256 * MiB)
    b.free(b.alloc(s, 0, 200 * MiB))
    b.free_segment(s, fr=EMPTY_CACHE)
    s = b.segment(256 * MiB)
    b.alloc(s, 0, 200 * MiB)
    (tmp_path / "one").mkdir()
    assert cache_flush.detect(Context([_analysis(tmp_path / "one", b, ALL)])) == []  # churn needs two


@pytest.mark.parametrize("n_bursts, retries, known, expected", [
    (3, 1, True, (2, "memory_stats")),  # the allocator's count says which were retries
    (3, 0, True, (3, "memory_stats")),
    (3, 5, True, (0, "memory_stats")),  # more retries than bursts: none was empty_cache()
    (1, 0, False, (1, "unknown")),  # neither: every burst is counted as a flush
    (2, 0, False, (2, "unknown")),
    (0, 0, False, (0, "memory_stats")),
], ids=["one-retry", "no-retry", "more-retries-than-bursts", "unknown-one", "unknown-two", "none"])
def test_empty_cache_bursts_without_free_stacks(tmp_path, n_bursts, retries, known, expected):
    a = _analysis(tmp_path, _flushes(USER, USER), ALLOC_ONLY)
    assert not a.free_stacks
    frees = _frees(a)[:n_bursts]
    got = cache_flush._empty_cache_bursts(a, frees, np.arange(n_bursts), n_bursts, retries, known)
    assert got == expected


def test_no_burst_with_free_stacks_is_classified_by_them(tmp_path):
    a = _analysis(tmp_path, _flushes(), ALL)
    empty = np.zeros(0, dtype=np.int64)
    got = cache_flush._empty_cache_bursts(a, empty, empty, 0, 2, True)
    assert got == (0, "free stacks")


# --------------------------------------------------------------------------- generate(): capacity unless the fix carries on

def test_an_oom_inside_generate_is_capacity_unless_the_fix_leaves_a_tokens_growth(tmp_path):
    """Issue 36 class 10. 512 MiB allocated (448 MiB of it the KV cache), 1 GiB reserved, the largest free block
    256 MiB: a 384 MiB request fails although it fits the room (need 896 MiB). Expandable segments get past the
    recorded OOM; the cache then grows by G per generated token. With 96 MiB left beyond the request and the
    margin (32 MiB), G = 256 MiB is not one more token: capacity, with what fits as data; G = 32 MiB carries on
    (3 more tokens): fragmentation, with the same data."""
    a = oom_rank(tmp_path, 384 * MiB)
    fixed = {"config": "expandable_segments:True", "reach": "recorded", "oom": None, "at_edge": False,
             "outcome": "past-recorded-oom", "spare_bytes": 100 * MiB, "peak_reserved_bytes": RESERVED - 100 * MiB,
             "margin_bytes": 32 * MiB,
             "continuation": {"outcome": "later-steps", "heaviest_step_peak_allocated_bytes": 896 * MiB,
                              "margin_bytes": None, "margin": {"reserved_step_spread_bytes": None,
                                                               "unrecorded_bytes": 0}}}
    room = RESERVED
    for growth, kind, more in ((256 * MiB, "capacity", 0), (32 * MiB, "fragmentation", 3)):
        ev = {"rank": a.rank, "phase": "generation", "room_bytes": room, "kv_cache_growth_per_token_bytes": growth}
        bd = SimpleNamespace(categories={"outputs": 0, "kv_cache": 448 * MiB}, phase="generation")
        v = _oom_verdict(a, [], Room(bytes=room, kind="device", source="test"), bd, Calls(None), lambda: fixed, ev)
        assert v.kind == kind, growth
        e = v.evidence
        assert e["kv_room_after_fix_bytes"] == room - (ALLOCATED + 384 * MiB) - 32 * MiB == 96 * MiB
        assert e["kv_tokens_more"] == more and e["kv_cache_tokens"] == 448 * MiB // growth
        # the cache's length that fits: room - margin - the rest of what was needed (64 MiB + the request)
        assert e["kv_cache_tokens_fit"] == (room - 32 * MiB - (64 * MiB + 384 * MiB)) // growth
        assert e["kv_margin_bytes"] == 32 * MiB
        if kind == "capacity":
            assert v.bytes == growth - 96 * MiB and v.finding is None
        said(v)  # every field of the sentence is in the evidence
    # no growth (a static cache, or no cache): the fix's outcome decides as before
    ev = {"rank": a.rank, "phase": "generation", "room_bytes": room}
    bd = SimpleNamespace(categories={"outputs": 0, "kv_cache": 448 * MiB}, phase="generation")
    v = _oom_verdict(a, [], Room(bytes=room, kind="device", source="test"), bd, Calls(None), lambda: fixed, ev)
    assert v.kind == "fragmentation" and "kv_tokens_more" not in v.evidence
