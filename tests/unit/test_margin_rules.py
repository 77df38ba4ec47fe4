"""The margin of a prediction (``report/margin.py``) and what it does to a claim (``report/predict.py``) and to
the verdict (``report/verdict.py``): a fix whose spare room is inside the margin is at the edge, never a fix.

The model case is the issue's ViT-L: with ``expandable_segments`` the replay gets through with a sliver to
spare, less than what lives outside the allocator (the GPU's total memory less the room read at the OOM), and
the rerun ran out. The traces are built here (``builder.SnapBuilder``), so every expected number is
arithmetic on the bytes placed.
"""

from __future__ import annotations

import json

import pytest
from builder import MiB, SnapBuilder

from oomdoctor import load
from oomdoctor.analysis import analyze
from oomdoctor.render.words import predict as predict_words
from oomdoctor.report.fits import fits
from oomdoctor.report.margin import Margin, at_edge, margin, outside_allocator
from oomdoctor.report.pipeline import report_of
from oomdoctor.report.predict import Predictor

GiB = 1024 * MiB


def fragmented(tmp_path, outside: int, meta: dict | None = None):
    """One 1 GiB segment, split: 256 MiB live at 0 and at 512 MiB (two free gaps of 256 MiB), then an OOM
    asking for 384 MiB while the device has 128 MiB free (the segment cannot be released: it holds live
    blocks): the room is 1 GiB + 128 MiB, 640 MiB of it free but not in one piece. The GPU's total memory is
    the room plus ``outside`` (what lives outside the allocator)."""
    b = SnapBuilder()
    seg = b.segment(GiB)
    b.free(b.alloc(seg, 0, GiB))  # a 1 GiB block made its segment, then was freed: the segment stays cached
    b.alloc(seg, 0, 256 * MiB)  # three blocks split it, the middle one freed
    middle = b.alloc(seg, 256 * MiB, 256 * MiB)
    b.alloc(seg, 512 * MiB, 256 * MiB)
    b.free(middle)
    b.oom(384 * MiB, device_free=128 * MiB)
    path = b.write(tmp_path / "rank0.pickle")
    side = {"format": "oomdoctor.sidecar/1", "kind": "oom", "rank": 0, "world_size": 1,
            "gpu_total_memory_bytes": GiB + 128 * MiB + outside, **(meta or {})}
    (tmp_path / "rank0.meta.json").write_text(json.dumps(side))
    return analyze(load(path))


ROOM = GiB + 128 * MiB
# with expandable segments the replay maps 20 MiB pages: the 1 GiB block's 52 pages (1040 MiB) are its peak;
# at the request, the free pages are unmapped (release_cached_blocks) and the request gets pages of its own
# within the room, so it gets past with 112 MiB to spare
EXPANDABLE_PEAK = 52 * 20 * MiB
SPARE = ROOM - EXPANDABLE_PEAK


def test_outside_the_allocator_is_the_gpus_total_less_the_room_read_at_the_oom(tmp_path):
    a = fragmented(tmp_path, outside=300 * MiB)
    got, how = outside_allocator(a)
    assert got == 300 * MiB and how == "device-free-at-oom"
    assert outside_allocator(a, outside_bytes=77)[0] == 77  # a sidecar's own count wins


def test_a_memory_fraction_cap_leaves_nothing_outside(tmp_path):
    a = fragmented(tmp_path, outside=300 * MiB, meta={"memory_cap_bytes": ROOM})
    assert outside_allocator(a) == (0, "fraction-cap")


def test_without_the_gpus_size_nothing_is_read_outside(tmp_path):
    b = SnapBuilder()
    b.alloc(b.segment(GiB), 0, 256 * MiB)
    a = analyze(load(b.write(tmp_path / "rank0.pickle")))
    assert outside_allocator(a)[0] == 0


def test_the_margin_adds_its_parts_and_the_extension_only_to_an_extended_claim():
    m = Margin(step_variation_bytes=1, model_error_bytes=10, extension_bytes=100, outside_bytes=1000,
               unrecorded_bytes=10000)
    assert m.bytes == 11011 and m.for_claim(False) == 11011 and m.for_claim(True) == 11111
    assert sum(m.parts().values()) == m.for_claim(True)


@pytest.mark.parametrize("spare, margin_bytes, edge", [(99, 100, True), (100, 100, False), (-1, 0, True),
                                                      (None, 5, None)])
def test_at_the_edge_is_spare_room_inside_the_margin(spare, margin_bytes, edge):
    assert at_edge(spare, margin_bytes) is edge


def test_the_jobs_own_peak_above_the_traces_is_unrecorded(tmp_path):
    a = fragmented(tmp_path, outside=0)
    peak = int(a.peak_reserved[0])
    assert margin(a, job_peak_reserved_bytes=peak + 5 * MiB).unrecorded_bytes == 5 * MiB
    assert margin(a, job_peak_reserved_bytes=peak - 5 * MiB).unrecorded_bytes == 0
    assert margin(a).unrecorded_bytes == 0  # no memory_stats in the sidecar


@pytest.mark.parametrize("outside, edge", [(SPARE + 1, True), (SPARE, False)])
def test_a_fix_that_gets_through_inside_the_margin_is_at_the_edge(tmp_path, outside, edge):
    a = fragmented(tmp_path, outside=outside)
    p = Predictor(a)
    assert p.reproduces and p.self_replay.matches_recorded
    pred = p.run({"config": "expandable_segments:True"})
    assert pred["oom"] is None and pred["reach"] == "recorded"
    assert pred["peak_reserved_bytes"] == EXPANDABLE_PEAK and pred["capacity_bytes"] == ROOM
    assert pred["spare_bytes"] == SPARE and pred["margin_bytes"] == outside
    assert pred["margin"] == {"step_variation_bytes": 0, "model_error_bytes": 0, "extension_bytes": 0,
                              "outside_bytes": outside, "unrecorded_bytes": 0}
    assert pred["at_edge"] is edge
    assert pred["outcome"] == "past-recorded-oom"
    said = predict_words.outcome(pred)
    assert ("inside its margin of" in said and "(at the edge: it may still run out)" in said) is edge
    assert ("to spare (margin" in said) is not edge


@pytest.mark.parametrize("outside, kind", [(SPARE + 1, "capacity"), (SPARE, "fragmentation")])
def test_the_verdict_is_fragmentation_only_when_the_fix_gets_through_with_margin(tmp_path, outside, kind):
    a = fragmented(tmp_path, outside=outside)
    v = report_of([a]).verdict
    assert v.kind == kind
    assert v.evidence["fix_at_edge"] is (kind == "capacity")
    if kind == "capacity":  # what the spare room lacks of the margin; fragmentation hit first
        assert v.bytes == 1 and v.evidence["margin_bytes"] == outside
        assert "fragmentation-hit-first" in v.reasons and "at-edge-without-it" in v.reasons


def test_the_jobs_answer_to_what_fits_is_its_tightest_rank():
    from oomdoctor.report.fits import Fits
    from oomdoctor.report.verdict import Verdict, with_tightest_rank

    def v():
        return Verdict("capacity", 1, [1], evidence={"largest_micro_batch": 30})

    stages = {0: Fits(1, "t", largest_micro_batch=26), 1: Fits(1, "t", largest_micro_batch=30), 2: None}
    got = with_tightest_rank(v(), stages)
    assert got.evidence["largest_micro_batch"] == 26 and got.evidence["largest_micro_batch_rank"] == 0
    got = with_tightest_rank(v(), {1: Fits(1, "t", largest_micro_batch=30), 0: Fits(1, "t", largest_micro_batch=31)})
    assert got.evidence == {"largest_micro_batch": 30}  # its own rank is the tightest: unchanged
    healthy = Verdict("healthy", 1, [0])
    assert with_tightest_rank(healthy, stages).evidence == {}  # says nothing of what fits: nothing added


def test_what_fits_keeps_a_sidecars_outside_bytes_free_too(tmp_path):
    from test_fits_main_rules import analysed as built
    from test_fits_main_rules import room, train
    a = built(tmp_path, train(3))
    f = fits(a, room(824), 4)
    g = fits(a, room(824), 4, outside_bytes=64 * MiB, job_peak_reserved_bytes=int(a.peak_reserved[0]) + 32 * MiB)
    assert g.margin["outside_bytes"] == 64 * MiB and g.margin["unrecorded_bytes"] == 32 * MiB
    assert g.margin_bytes == f.margin_bytes + 96 * MiB
    # 528 MiB + 128 MiB x s within 824 MiB less the margins: s < 2.31 (9 of 4) without, s < 1.56 (6 of 4) with
    assert (f.largest_micro_batch, g.largest_micro_batch) == (9, 6)
