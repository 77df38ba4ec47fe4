"""``diff`` credits each finding with the part of its ranks' saving its own bytes account for, never the whole
saving to each of several findings (report/diff.py ``_shares``)."""

from __future__ import annotations

from oomdoctor.render.format import format_bytes
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
    # issue 52: the three describe the same blocks (rank 0's logits kept at modeling_gpt2.py:697): the saving is
    # attributed once, to the first of them in the report's order, up to its own drop (1.53 GiB of 1.54 GiB saved)
    by_id = {f.id: f for f in resolved}
    lead = by_id["rank-imbalance"]
    assert lead.same_bytes_as is None
    assert lead.peak_reserved_saved_bytes == min(saved[0], lead.before_bytes) > 0
    for fid in ("output-accumulation", "memory-growth"):
        assert (by_id[fid].same_bytes_as, by_id[fid].peak_reserved_saved_bytes) == ("rank-imbalance", 0)
    assert sum(f.peak_reserved_saved_bytes for f in resolved) <= saved[0]


def _finding(fid: str, sites: list[str], nbytes: int, ranks=(0,)):
    from oomdoctor.detectors.finding import Evidence, Finding, SiteRef

    return Finding(fid, "high", list(ranks), nbytes, Evidence(), [SiteRef(s, nbytes, 1) for s in sites],
                   per_rank_bytes={r: nbytes for r in ranks})


def _report(*findings):
    from types import SimpleNamespace

    return SimpleNamespace(findings=list(findings))


def test_findings_on_the_same_sites_share_one_saving_others_their_own():
    """Findings resolved together that point at the same allocation site on a rank describe the same blocks: the
    first in the report's order takes the saving (up to the largest own drop among them), the others name it. A
    finding elsewhere keeps its own share."""
    from oomdoctor.report.diff import _finding_changes

    before = _report(_finding("a", ["m.py:1 in f"], 2 * GiB), _finding("b", ["m.py:1 in f", "m.py:2 in g"], 3 * GiB),
                     _finding("c", ["m.py:2 in g"], GiB), _finding("d", ["x.py:9 in h"], GiB),
                     _finding("e", ["m.py:1 in f"], GiB, ranks=(1,)))
    got = {f.id: f for f in _finding_changes(before, _report(), {0: 10 * GiB, 1: GiB // 2})}
    assert {k: (f.same_bytes_as, f.peak_reserved_saved_bytes) for k, f in got.items()} == {
        "a": (None, 3 * GiB), "b": ("a", 0), "c": ("a", 0), "d": (None, GiB), "e": (None, GiB // 2)}


def test_the_diff_says_saved_one_way_and_each_saving_once(snapshots):
    """Issue 52: ``diff ddp-imbalance ddp-clean`` said "saved +1.54 GiB" per rank and "change -1.15 GiB" per site,
    and three resolved findings each "its share" of the one saving. One convention (saved = before - after, in the
    text, the HTML and the JSON's saved_bytes), and the saving once."""
    from oomdoctor.analysis.device import analyze
    from oomdoctor.render.json import diff_dict
    from oomdoctor.render.text import render_diff_text_plain
    from oomdoctor.report.diff import diff_runs
    from oomdoctor.report.pipeline import report_of
    from oomdoctor.trace import load_ranks

    b = [analyze(t) for t in load_ranks([str(snapshots / "ddp-imbalance")], skipped=[])]
    a = [analyze(t) for t in load_ranks([str(snapshots / "ddp-clean")], skipped=[])]
    d = diff_runs(b, a, report_of(b), report_of(a))
    text = render_diff_text_plain(d, width=200)
    assert "change" not in text and "share" not in text
    (site,) = [s for s in d.ranks[0].sites if s.label.endswith("modeling_gpt2.py:697 in forward")]
    assert site.saved_bytes == site.before_bytes - site.after_bytes > 0
    assert f"+{format_bytes(site.saved_bytes)}" in text  # saved, positive where it shrank: as the ranks' column
    assert text.count("+1.53 GiB") == 2  # rank 0's peak allocated saved, and rank-imbalance's saving
    assert text.count("the same blocks as rank-imbalance") == 2
    js = diff_dict(d)
    assert js["ranks"][0]["sites"][0]["saved_bytes"] == -js["ranks"][0]["sites"][0]["delta_bytes"]
    assert [f.get("same_bytes_as") for f in js["findings"] if f["status"] == "resolved"] == [
        None, "rank-imbalance", "rank-imbalance"]
