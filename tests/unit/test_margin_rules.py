"""The margins of a prediction (``report/margin.py``, issue 49) and what they do to a claim (``report/predict.py``)
and to the verdict (``report/verdict.py``): a claim about the recorded steps keeps free only the model's measured
error on the trace and the memory outside the allocator counted once (its growth after the room was read from the
device); what the recorded steps do not cover has its own margin, measured from the job's reserved step peaks, or
none (a condition). A fix whose spare room is inside the recorded steps' margin is at the edge, never a fix; the
continuation never changes the cause.

The traces are built here (``builder.SnapBuilder``), so every expected number is arithmetic on the bytes placed.
"""

from __future__ import annotations

import json

import pytest
from builder import MiB, SnapBuilder

from oomdoctor import load
from oomdoctor.analysis import analyze
from oomdoctor.render.words import predict as predict_words
from oomdoctor.report.fits import device_room, fits
from oomdoctor.report.margin import (
    OUTSIDE_GROWTH_BYTES,
    PLANNER_SHORTFALL_BYTES,
    Margin,
    at_edge,
    margin,
    margin_inputs,
    outside_allocator,
)
from oomdoctor.report.pipeline import report_of
from oomdoctor.report.predict import Predictor

GiB = 1024 * MiB


def fragmented(tmp_path, outside: int, meta: dict | None = None, device_free: int = 128 * MiB):
    """One 1 GiB segment, split: 256 MiB live at 0 and at 512 MiB (two free gaps of 256 MiB), then an OOM
    asking for 384 MiB while the device has ``device_free`` free (the segment cannot be released: it holds live
    blocks): the room is 1 GiB + ``device_free``, 640 MiB of it free but not in one piece. The GPU's total memory is
    the room plus ``outside`` (what lives outside the allocator)."""
    b = SnapBuilder()
    seg = b.segment(GiB)
    b.free(b.alloc(seg, 0, GiB))  # a 1 GiB block made its segment, then was freed: the segment stays cached
    b.alloc(seg, 0, 256 * MiB)  # three blocks split it, the middle one freed
    middle = b.alloc(seg, 256 * MiB, 256 * MiB)
    b.alloc(seg, 512 * MiB, 256 * MiB)
    b.free(middle)
    b.oom(384 * MiB, device_free=device_free)
    path = b.write(tmp_path / "rank0.pickle")
    side = {"format": "oomdoctor.sidecar/1", "kind": "oom", "rank": 0, "world_size": 1,
            "gpu_total_memory_bytes": GiB + device_free + outside, **(meta or {})}
    (tmp_path / "rank0.meta.json").write_text(json.dumps(side))
    return analyze(load(path))


ROOM = GiB + 128 * MiB
# with expandable segments the replay maps 20 MiB pages: the 1 GiB block's 52 pages (1040 MiB) are its peak;
# at the request, the free pages are unmapped (release_cached_blocks) and the request gets pages of its own
# within the room, so it gets past with 112 MiB to spare
EXPANDABLE_PEAK = 52 * 20 * MiB
SPARE = ROOM - EXPANDABLE_PEAK


@pytest.mark.parametrize("outside", [0, 300 * MiB, 3 * GiB])
def test_outside_memory_read_with_the_room_is_counted_once_only_its_growth_is_kept(tmp_path, outside):
    # the room was read at the OOM (reserved + cudaMemGetInfo's free): whatever lived outside then is off it already,
    # however much it was; the margin keeps what it grew by at most on the corpus
    a = fragmented(tmp_path, outside=outside)
    assert device_room(a).bytes == ROOM
    assert outside_allocator(a) == (OUTSIDE_GROWTH_BYTES, "outside-growth")
    assert OUTSIDE_GROWTH_BYTES == 96_468_992  # docs/margin_terms.json: pipelining-1f1b-b32 rank 1


def test_a_memory_fraction_cap_leaves_nothing_outside(tmp_path):
    a = fragmented(tmp_path, outside=300 * MiB, meta={"memory_cap_bytes": ROOM})
    assert outside_allocator(a) == (0, "fraction-cap")


def test_a_cap_read_off_the_oom_leaves_nothing_outside_either(tmp_path):
    # the device still had the failed segment's bytes free: a fraction cap refused it (simulate/capacity.py rule 3)
    a = fragmented(tmp_path, outside=300 * MiB, device_free=8 * GiB)
    assert outside_allocator(a) == (0, "fraction-cap")


@pytest.mark.parametrize("world, shortfall", [(1, 1_058_111_232), (2, 327_074_560), (8, 327_074_560)])
def test_a_room_estimated_from_the_planners_constants_keeps_their_measured_shortfall(tmp_path, world, shortfall):
    b = SnapBuilder()
    b.alloc(b.segment(GiB), 0, 256 * MiB)
    b.write(tmp_path / "rank0.pickle")
    (tmp_path / "rank0.meta.json").write_text(json.dumps({"format": "oomdoctor.sidecar/1", "rank": 0,
                                                           "world_size": world, "gpu_total_memory_bytes": 80 * GiB}))
    a = analyze(load(tmp_path / "rank0.pickle"))
    assert device_room(a).source == "gpu-total"
    assert outside_allocator(a) == (shortfall, "planner-constants")
    assert PLANNER_SHORTFALL_BYTES[min(world, 2)] == shortfall
    # the process's own count of its outside memory: the room is the total less it, once; only its growth is kept
    room = device_room(a, outside_bytes=900 * MiB)
    assert (room.bytes, room.source) == (80 * GiB - 900 * MiB, "gpu-total-less-outside")
    assert outside_allocator(a, outside_bytes=900 * MiB) == (OUTSIDE_GROWTH_BYTES, "outside-growth")


def test_without_the_gpus_size_nothing_is_read_outside(tmp_path):
    b = SnapBuilder()
    b.alloc(b.segment(GiB), 0, 256 * MiB)
    a = analyze(load(b.write(tmp_path / "rank0.pickle")))
    assert outside_allocator(a) == (0, "gpu-size-unknown")


def test_the_recorded_steps_margin_is_model_error_plus_outside_and_the_continuation_its_own():
    m = Margin(model_error_bytes=10, outside_bytes=1000, reserved_step_spread_bytes=100, unrecorded_bytes=10000)
    assert m.bytes == 1010 and m.parts() == {"model_error_bytes": 10, "outside_bytes": 1000}
    assert m.continuation_bytes == 10100
    assert m.continuation_parts() == {"reserved_step_spread_bytes": 100, "unrecorded_bytes": 10000}
    # no two complete steps: no number for what the recorded steps do not cover, whatever else is known
    assert Margin(outside_bytes=5, unrecorded_bytes=7).continuation_bytes is None


@pytest.mark.parametrize("spare, margin_bytes, edge", [(99, 100, True), (100, 100, False), (-1, 0, True),
                                                      (None, 5, None), (5, None, None)])
def test_at_the_edge_is_spare_room_inside_the_margin(spare, margin_bytes, edge):
    assert at_edge(spare, margin_bytes) is edge


def test_the_jobs_own_peak_above_the_traces_is_unrecorded(tmp_path):
    a = fragmented(tmp_path, outside=0)
    peak = int(a.peak_reserved[0])
    m = margin(a, job_peak_reserved_bytes=peak + 5 * MiB)
    assert m.unrecorded_bytes == 5 * MiB and m.sources["unrecorded_bytes"] == "job-peak-above-trace"
    assert m.bytes == OUTSIDE_GROWTH_BYTES  # not a part of the recorded steps' margin
    assert margin(a, job_peak_reserved_bytes=peak - 5 * MiB).unrecorded_bytes == 0
    got = margin(a)
    assert got.unrecorded_bytes == 0 and got.sources["unrecorded_bytes"] == "job-peak-unknown"


def test_the_sidecar_gives_the_margins_inputs(tmp_path):
    # PyTorch's OOM message: the process's memory in use less allocated and reserved-but-unallocated; the job's peak
    # reserved from the counters of the sidecar
    msg = ("CUDA out of memory. Tried to allocate 384.00 MiB. GPU 0 has a total capacity of 2.00 GiB of which "
           "128.00 MiB is free. Including non-PyTorch memory, this process has 1.50 GiB memory in use. Of the "
           "allocated memory 512.00 MiB is allocated by PyTorch, and 512.00 MiB is reserved by PyTorch but "
           "unallocated.")
    a = fragmented(tmp_path, outside=0, meta={"oom": {"device": 0, "message": msg},
                                              "memory_stats": {"reserved_bytes.all.peak": GiB + 64 * MiB,
                                                               "allocated_bytes.all.peak": GiB}})
    assert margin_inputs(a) == {"outside_bytes": 512 * MiB, "job_peak_reserved_bytes": GiB + 64 * MiB}
    a = fragmented(tmp_path, outside=0)
    assert margin_inputs(a) == {"outside_bytes": None, "job_peak_reserved_bytes": None}


# the room less the expandable replay's peak: the margin (92 MiB of outside growth) decides the edge
@pytest.mark.parametrize("device_free, edge", [(128 * MiB, False), (100 * MiB, True)])
def test_a_fix_that_gets_through_inside_the_margin_is_at_the_edge(tmp_path, device_free, edge):
    a = fragmented(tmp_path, outside=3 * GiB, device_free=device_free)
    p = Predictor(a)
    assert p.reproduces and p.self_replay.matches_recorded
    pred = p.run({"config": "expandable_segments:True"})
    room = GiB + device_free
    assert pred["oom"] is None and pred["reach"] == "recorded"
    assert pred["peak_reserved_bytes"] == EXPANDABLE_PEAK and pred["capacity_bytes"] == room
    assert pred["spare_bytes"] == room - EXPANDABLE_PEAK and pred["margin_bytes"] == OUTSIDE_GROWTH_BYTES
    assert pred["margin"] == {"model_error_bytes": 0, "outside_bytes": OUTSIDE_GROWTH_BYTES}
    assert pred["at_edge"] is edge
    assert pred["outcome"] == "past-recorded-oom"
    # the rest of the step was not recorded: a condition, no number (no complete step to measure a spread on)
    c = pred["continuation"]
    assert c["outcome"] == "later-steps" and c["margin_bytes"] is None and c["at_edge"] is None
    assert c["heaviest_step_peak_allocated_bytes"] == pred["peak_allocated_bytes"]
    said = predict_words.outcome(pred)
    assert ("inside its margin of" in said and "(at the edge: it may still run out)" in said) is edge
    assert ("to spare (margin" in said) is not edge


@pytest.mark.parametrize("device_free, kind", [(100 * MiB, "capacity"), (128 * MiB, "fragmentation")])
def test_the_verdict_is_fragmentation_only_when_the_fix_gets_through_with_margin(tmp_path, monkeypatch, device_free,
                                                                                kind):
    from oomdoctor.report import rank_predictions

    monkeypatch.setattr(rank_predictions, "defragmenting_settings", lambda a: ["expandable_segments:True"])
    a = fragmented(tmp_path, outside=300 * MiB, device_free=device_free)
    v = report_of([a]).verdict
    assert v.kind == kind
    assert v.evidence["fix_at_edge"] is (kind == "capacity")
    if kind == "capacity":  # what the spare room lacks of the margin; fragmentation hit first
        assert v.bytes == OUTSIDE_GROWTH_BYTES - (GiB + device_free - EXPANDABLE_PEAK)
        assert v.evidence["margin_bytes"] == OUTSIDE_GROWTH_BYTES
        assert "fragmentation-hit-first" in v.reasons and "at-edge-without-it" in v.reasons
    else:
        assert [x.id for x in v.to_do] == ["alloc-conf-simulated"]
        assert v.evidence["defragmented_config"] == "expandable_segments:True"


def test_the_verdict_takes_the_first_free_setting_that_clears_the_recorded_steps(tmp_path):
    # expandable segments get through with 84 MiB to spare, inside the 92 MiB margin; max_split_size_mb at half the
    # request stops the 1 GiB cached block from being split for the 256 MiB blocks (get_free_block: no oversized
    # block for a request under max_split_size), so the cached segment is released before the OOM's request and the
    # replay peaks at 1 GiB with 100 MiB to spare: the recorded OOM was fragmentation, and that setting is the fix
    a = fragmented(tmp_path, outside=300 * MiB, device_free=100 * MiB)
    v = report_of([a]).verdict
    assert v.kind == "fragmentation" and v.evidence["defragmented_config"] == "max_split_size_mb:192"
    assert (v.evidence["fix_peak_reserved_bytes"], v.evidence["fix_spare_bytes"]) == (GiB, 100 * MiB)
    assert [x.id for x in v.to_do] == ["alloc-conf-simulated"]


def test_the_jobs_answer_to_what_fits_is_its_tightest_rank():
    from oomdoctor.report.fits import Fits
    from oomdoctor.report.verdict import Verdict, with_tightest_rank

    def v():
        return Verdict(kind="capacity", bytes=1, ranks=[1], evidence={"largest_micro_batch": 30})

    stages = {0: Fits(1, "t", largest_micro_batch=26), 1: Fits(1, "t", largest_micro_batch=30), 2: None}
    got = with_tightest_rank(v(), stages)
    assert got.evidence["largest_micro_batch"] == 26 and got.evidence["largest_micro_batch_rank"] == 0
    got = with_tightest_rank(v(), {1: Fits(1, "t", largest_micro_batch=30), 0: Fits(1, "t", largest_micro_batch=31)})
    assert got.evidence == {"largest_micro_batch": 30}  # its own rank is the tightest: unchanged
    healthy = Verdict(kind="healthy", bytes=1, ranks=[0])
    assert with_tightest_rank(healthy, stages).evidence == {}  # says nothing of what fits: nothing added


def test_what_fits_keeps_outside_memory_once_and_leaves_the_jobs_peak_to_its_bound(tmp_path):
    from test_fits_main_rules import analysed as built
    from test_fits_main_rules import room, train

    from oomdoctor.report.margin import OUTSIDE_GROWTH_AFTER_STEP_BYTES
    a = built(tmp_path, train(3))
    f = fits(a, room(824), 4)
    g = fits(a, room(824), 4, outside_bytes=64 * MiB, job_peak_reserved_bytes=int(a.peak_reserved[0]) + 32 * MiB)
    # no device reading in the trace and no GPU size: nothing outside; with the process's own count (the room is
    # the total less it, once), only what it may grow by after a step ran: 2 MiB, not the 64 MiB again
    assert f.margin["outside_bytes"] == 0
    assert g.margin == {"model_error_bytes": 0, "outside_bytes": OUTSIDE_GROWTH_AFTER_STEP_BYTES}
    assert g.margin_bytes == f.margin_bytes + OUTSIDE_GROWTH_AFTER_STEP_BYTES
    # 528 MiB + 128 MiB x s within 824 MiB less the margins: s < 2.31 either way (9 of 4); the job's peak 32 MiB above
    # the window's is job_peak_bound's, not the margin's
    assert (f.largest_micro_batch, g.largest_micro_batch) == (9, 9)
    assert g.margin_bytes < 3 * MiB
