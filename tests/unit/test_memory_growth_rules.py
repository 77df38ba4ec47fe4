"""``memory-growth``'s thresholds at their boundaries, on training loops built in code.

The rule (``detectors/memory_growth.py``): the steps counted are 2 .. N-3 of N optimizer steps; a finding when at
least 2 of them each leave blocks alive at the start of the last step, for at least 64 MiB and 2% of the peak
allocated in all; blocks under ``torch/distributed/pipelining/`` belong to ``pipeline-output-cache``.
"""

from __future__ import annotations

import json

import pytest
from builder import SnapBuilder, frames

from oomdoctor import load
from oomdoctor.analysis import analyze
from oomdoctor.detectors import memory_growth
from oomdoctor.detectors.context import Context

MiB = 1 << 20
GiB = 1 << 30
LEAK = frames(("/w/train.py", 61, "main"))
PIPE = frames(("/venv/lib/python3.12/site-packages/torch/distributed/pipelining/stage.py", 700, "forward_one_chunk"),
              ("/w/train.py", 62, "main"))


def run(tmp_path, leaks: list[int], *, activations: int = 64 * MiB, fr: list[dict] = LEAK) -> list:
    """One rank of ``len(leaks)`` optimizer steps (``Optimizer.step#AdamW.step`` annotations): each step
    allocates and frees ``activations`` bytes, then leaves ``leaks[i]`` bytes allocated to the end."""
    b = SnapBuilder()
    s = b.segment(64 * GiB)
    off = activations
    for leak in leaks:
        b.annotate("Optimizer.step#AdamW.step", "START")
        act = b.alloc(s, 0, activations, fr=frames(("/w/model.py", 50, "forward")))
        b.free(act)
        if leak:
            b.alloc(s, off, leak, fr=fr)
            off += leak
        b.annotate("Optimizer.step#AdamW.step", "END")
    return memory_growth.detect(Context([analyze(load(b.write(tmp_path / "rank0.pickle")))]))


def test_six_steps_are_the_fewest_that_can_show_growth(tmp_path):
    # steps 2 and 3 are the counted ones of six; each leaves 64 MiB
    (f,) = run(tmp_path, [0, 0, 64 * MiB, 64 * MiB, 0, 0])
    assert f.bytes == 128 * MiB and f.evidence.steps == 6
    assert f.evidence.steps_leaving_memory == 2 and f.evidence.leaking_steps == [2, 3]
    assert (f.evidence.first_counted_step, f.evidence.last_counted_step) == (2, 3)
    assert f.evidence.retained_bytes_per_step == [64 * MiB, 64 * MiB]
    assert f.per_rank_bytes == {0: 128 * MiB}
    assert (f.evidence.step_source, f.evidence.retained_bytes, f.variant) == ("annotations", 128 * MiB, "")
    # five steps count only step 2: never two growing steps, whatever it leaves
    assert run(tmp_path, [0, 0, 4 * GiB, 0, 0]) == []


def test_warm_up_and_the_last_two_steps_are_not_counted(tmp_path):
    # leaks in steps 0, 1 (warm-up: optimizer state, buckets) and 6, 7 (the last two) are never growth
    assert run(tmp_path, [GiB, GiB, 0, 0, 0, 0, GiB, GiB]) == []
    (f,) = run(tmp_path, [GiB, GiB, 32 * MiB, 64 * MiB, 0, 64 * MiB, GiB, GiB])
    assert f.evidence.leaking_steps == [2, 3, 5] and f.bytes == 160 * MiB
    assert (f.evidence.first_counted_step, f.evidence.last_counted_step) == (2, 5)
    assert f.evidence.retained_bytes_per_step == [32 * MiB, 64 * MiB, 0, 64 * MiB]
    # allocated at the start of step 2 (the first counted): the warm-up's 2 GiB; at the start of the last step:
    # that plus what steps 2, 3, 5 and 6 left
    assert f.evidence.allocated_at_first_step_bytes == 2 * GiB
    assert f.evidence.allocated_at_last_step_bytes == 3 * GiB + 160 * MiB


def test_one_growing_step_is_not_growth_however_large(tmp_path):
    assert run(tmp_path, [0, 0, 8 * GiB, 0, 0, 0, 0]) == []
    assert len(run(tmp_path, [0, 0, 8 * GiB, 512, 0, 0, 0])) == 1  # a second step leaving one 512-byte block


@pytest.mark.parametrize("per_step, found", [(32 * MiB, True), (32 * MiB - 512, False)])
def test_at_least_64_mib_in_all(tmp_path, per_step, found):
    # two counted steps; the peak (64 MiB of activations + what is kept) is small, so 64 MiB is the bar
    assert len(run(tmp_path, [0, 0, per_step, per_step, 0, 0])) == int(found)


def test_at_least_two_percent_of_the_peak_in_all(tmp_path):
    # a 10 GiB activation peak in every step, the largest in the last, with both leaks alive: 2% of it is above
    # the 64 MiB floor. Leaving 2 x 104 MiB: 208 MiB < 2% of (10 GiB + 208 MiB) = 208.96 MiB; 2 x 106 MiB: 212 MiB
    # >= 2% of (10 GiB + 212 MiB) = 209.04 MiB
    big = 10 * GiB
    assert run(tmp_path, [0, 0, 104 * MiB, 104 * MiB, 0, 0], activations=big) == []
    (f,) = run(tmp_path, [0, 0, 106 * MiB, 106 * MiB, 0, 0], activations=big)
    assert f.evidence.peak_allocated_bytes == big + 212 * MiB
    assert f.bytes == 212 * MiB


def test_what_a_pipeline_schedule_keeps_is_left_to_its_own_detector(tmp_path):
    assert run(tmp_path, [0, 0, 64 * MiB, 64 * MiB, 0, 0], fr=PIPE) == []


def test_steps_are_numbered_as_the_job_counts_them(tmp_path):
    """Issue 52: a trace of steps 10 to 17 (step markers of a recording window) names the steps the job's way, as the
    breakdown's "step N" and output-accumulation's steps do: steps 12, 13 and 15, counted from 12 to 15."""
    b = SnapBuilder()
    s = b.segment(64 * GiB)
    off, markers = 64 * MiB, []
    for i, leak in enumerate([0, 0, 32 * MiB, 64 * MiB, 0, 64 * MiB, 0, 0]):
        act = b.alloc(s, 0, 64 * MiB, fr=frames(("/w/model.py", 50, "forward")))
        markers.append({"step": 10 + i, "time_us": b.events[-1]["time_us"]})
        b.free(act)
        if leak:
            b.alloc(s, off, leak, fr=LEAK)
            off += leak
    path = b.write(tmp_path / "rank0.pickle")
    (tmp_path / "rank0.meta.json").write_text(json.dumps({"format": 1, "rank": 0, "step_markers": markers}))
    (f,) = memory_growth.detect(Context([analyze(load(path))]))
    assert f.evidence.step_source == "markers"
    assert f.evidence.leaking_steps == [12, 13, 15]
    assert (f.evidence.first_counted_step, f.evidence.last_counted_step) == (12, 15)
