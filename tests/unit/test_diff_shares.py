"""``diff`` credits each finding with the part of its ranks' saving its own bytes account for, never the whole
saving to each of several findings (report/diff.py ``_shares``)."""

from __future__ import annotations

from oomdoctor.report.diff import _shares
from oomdoctor.units import GiB


def test_two_findings_on_one_rank_share_its_saving_by_their_own_drop():
    got = _shares({"a": {0: 3 * GiB}, "b": {0: 1 * GiB}}, {0: 2 * GiB})
    assert got == {"a": int(1.5 * GiB), "b": int(0.5 * GiB)}
    assert sum(got.values()) == 2 * GiB


def test_no_finding_gets_more_than_its_own_drop():
    got = _shares({"a": {0: 3 * GiB}, "b": {0: 1 * GiB}}, {0: 5 * GiB})
    assert got == {"a": 3 * GiB, "b": 1 * GiB}  # the other 1 GiB is no finding's


def test_a_rank_that_grew_credits_only_findings_that_grew():
    got = _shares({"a": {0: 1 * GiB}, "b": {0: -2 * GiB}}, {0: -1 * GiB})
    assert got == {"a": 0, "b": -1 * GiB}


def test_ranks_add_up_separately():
    got = _shares({"a": {0: 2 * GiB, 1: 2 * GiB}}, {0: 1 * GiB, 1: 3 * GiB})
    assert got == {"a": 1 * GiB + 2 * GiB}


def test_a_real_pair_never_credits_more_than_the_rank_saved(snapshots):
    from oomdoctor.analysis.device import analyze
    from oomdoctor.report.diff import diff_runs
    from oomdoctor.report.pipeline import report_of
    from oomdoctor.trace import load_ranks

    b = [analyze(t) for t in load_ranks([str(snapshots / "ddp-imbalance")], skipped=[])]
    a = [analyze(t) for t in load_ranks([str(snapshots / "ddp-clean")], skipped=[])]
    d = diff_runs(b, a, report_of(b), report_of(a))
    saved = {r.rank: r.peak_reserved_saved_bytes for r in d.ranks}
    resolved = [f for f in d.findings if f.status == "resolved"]
    assert {f.id for f in resolved} == {"rank-imbalance", "output-accumulation", "memory-growth"}
    assert saved[0] > 0 and saved[1] == 0
    total = sum(f.peak_reserved_saved_bytes for f in resolved)
    assert saved[0] - len(resolved) <= total <= saved[0]  # shared out, up to int rounding
    assert all(0 < f.peak_reserved_saved_bytes <= f.before_bytes for f in resolved)
