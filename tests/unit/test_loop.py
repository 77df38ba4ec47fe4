"""The closed loop's rules (``report/loop.py``): the fit search, settings, claims and their judgement."""

from __future__ import annotations

import pytest

from oomdoctor.report.loop import (
    Claim,
    FitSearch,
    SettingError,
    apply_setting,
    is_oom_output,
    judge,
    parse_setting,
)
from tests.standin_job import OOM


def search(limit: int | None, first: int, guided: bool, low: int = 1, high: int = 1024,
           before: tuple[int, ...] = ()) -> FitSearch:
    """Run the search against a job whose largest micro-batch that runs is ``limit`` (None: none runs)."""
    s = FitSearch(low, high, first, guided)

    def runs(mb: int) -> bool:
        return limit is not None and mb <= limit

    for mb in before:
        s.record(mb, runs(mb), anchor=False)
    while (mb := s.propose()) is not None:
        assert mb not in s.tried, "a micro-batch is never tried twice"
        s.record(mb, runs(mb))
    return s


@pytest.mark.parametrize("limit", [1, 2, 3, 37, 92, 137, 500, 1023, 1024])
@pytest.mark.parametrize("first,guided", [(1, False), (64, False), (92, True), (300, True)])
def test_the_search_finds_the_largest_that_runs_and_never_answers_above_it(limit, first, guided):
    s = search(limit, first, guided)
    assert s.largest_ran == limit
    assert s.smallest_oom == (None if limit == 1024 else limit + 1)


def test_nothing_runs():
    s = search(None, 5, False, low=3)
    assert s.largest_ran is None and s.smallest_oom == 3 and s.tried == [5, 3]


def test_a_right_guess_takes_two_trials_a_close_one_a_few():
    assert search(92, 92, True).tried == [92, 93]
    # one above: down by 1, 2, then bisect
    assert search(92, 94, True, before=(88,)).tried == [88, 94, 93, 91, 92]
    assert len(search(92, 95, True).tried) <= 5


def test_unguided_search_doubles_up_then_bisects():
    assert search(37, 1, False, high=200).tried == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    # down from an OOM it halves, as auto_find_batch_size does
    assert search(10, 64, False).tried[:4] == [64, 32, 16, 8]


def test_a_guess_outside_what_is_known_starts_next_to_it():
    # the recorded run at 88 ran: a guess of 80 starts at 89
    assert search(92, 80, True, before=(88,)).tried[:2] == [88, 89]


def test_the_range_is_checked():
    with pytest.raises(ValueError):
        FitSearch(5, 4, 5, False)


def test_settings_parse_as_environment_changes_and_replays():
    s = parse_setting("expandable_segments:True")
    assert (s.env, s.value, s.what_if) == ("PYTORCH_ALLOC_CONF", "expandable_segments:True",
                                           {"config": "expandable_segments:True"})
    s = parse_setting("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512")
    assert (s.env, s.value, s.what_if) == ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512",
                                           {"config": "max_split_size_mb:512"})
    s = parse_setting("TORCH_NCCL_AVOID_RECORD_STREAMS=1")
    assert s.what_if == {"deferred_frees": "immediate"}
    assert parse_setting("NCCL_DEBUG=INFO").what_if is None
    for bad in ("max_split_size_mb:2", "no_such_option:1", ""):
        with pytest.raises(SettingError):
            parse_setting(bad)


def test_an_allocator_option_joins_the_options_the_job_has():
    s = parse_setting("expandable_segments:True")
    assert apply_setting({}, s) == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    env = apply_setting({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}, s)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256,expandable_segments:True"}
    assert apply_setting({"X": "1"}, parse_setting("TORCH_NCCL_AVOID_RECORD_STREAMS=1")) == {
        "X": "1", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}


def test_oom_messages_are_pytorchs():
    assert is_oom_output("noise\n" + OOM.format(req=2.0) + "\n")
    assert is_oom_output("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    assert not is_oom_output("RuntimeError: shape mismatch\nout of memory of patience")


def claim(peak: int, oom: bool = False, margin: int = 100, lower: bool = False) -> Claim:
    return Claim(rank=0, peak_reserved_bytes=peak, oom=oom, margin_bytes=margin, margin_source="job-spread",
                 lower_bound=lower, reach="complete", self_replay_exact=True)


def test_judge():
    assert judge(claim(1000), 1000, oom=False, failed=False) == (True, "agrees")
    assert judge(claim(1000), 1100, oom=False, failed=False) == (True, "agrees")
    assert judge(claim(1000), 1101, oom=False, failed=False) == (False, "peak-above-margin")
    assert judge(claim(1000), 899, oom=False, failed=False) == (False, "peak-below-margin")
    assert judge(claim(1000, lower=True), 5000, oom=False, failed=False) == (True, "agrees")
    assert judge(claim(1000), None, oom=True, failed=False) == (False, "oom-not-predicted")
    assert judge(claim(1000, oom=True), 700, oom=False, failed=False) == (False, "ran-but-oom-predicted")
    assert judge(claim(1000, oom=True), 10, oom=True, failed=False) == (True, "agrees")
    assert judge(None, 10, oom=False, failed=False) == (None, "no-prediction")
    assert judge(claim(1000), None, oom=False, failed=True) == (None, "failed")


def test_from_a_lower_bound_the_search_doubles():
    # the replay said "at least 64" (its search stopped at 4x of a recorded 16): 128, 256 (OOM at 200), bisect
    s = FitSearch(1, 1024, 64, guided=False)
    s.record(16, True, anchor=False)
    while (mb := s.propose()) is not None:
        s.record(mb, mb <= 200)
    assert s.tried[:4] == [16, 64, 128, 256] and s.largest_ran == 200 and len(s.tried) <= 12
