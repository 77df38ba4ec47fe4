"""Results in a notebook: ``oomdoctor.diagnose`` / ``diff`` / ``replay`` return objects whose
``_repr_html_`` is the HTML page of the same computed objects, formatted by IPython as Jupyter does.
The frame drawn in Chromium: tests/browser/test_pages.py."""

from __future__ import annotations

import html
import re

import pytest

import oomdoctor
from oomdoctor.analysis.device import analyze
from oomdoctor.render.html import render_html
from oomdoctor.render.json import render_json
from oomdoctor.render.text import render_text_plain
from oomdoctor.report.pipeline import report_of
from oomdoctor.trace import load_ranks
from oomdoctor.views.visual import build_visual


def frame_page(markup: str) -> str:
    m = re.fullmatch(r'<iframe srcdoc="([^"]*)" style="[^"]*" title="oomdoctor"></iframe>', markup)
    assert m, markup[:200]
    return html.unescape(m.group(1))


def mime(obj) -> dict:
    IPython = pytest.importorskip("IPython")
    data, _meta = IPython.core.formatters.DisplayFormatter().format(obj)
    return data


def test_diagnose_renders_the_report_page_in_a_notebook(snapshots):
    path = snapshots / "tp-allreduce" / "legacy-rank0.pickle"
    d = oomdoctor.diagnose(path)  # one path, not a list
    analyses = [analyze(t) for t in load_ranks([path])]
    report = report_of(analyses)
    assert d.verdict.kind == report.verdict.kind == "deferred-free"  # fields read through
    assert len(d.findings) == len(report.findings)
    assert frame_page(d._repr_html_()) == render_html(report, build_visual(analyses)) == d.to_html()
    assert d.to_json() == render_json(report)
    assert str(d) == render_text_plain(report)
    bundle = mime(d)
    assert bundle["text/html"] == d._repr_html_()
    assert bundle["text/plain"].startswith("oomdoctor 0.1.0: deferred-free on rank 0")


def test_diff_and_replay_render_in_a_notebook(snapshots):
    before = snapshots / "tp-allreduce" / "legacy-rank0.pickle"
    after = snapshots / "tp-allreduce" / "modern-rank0.pickle"
    c = oomdoctor.diff(before, after)
    assert c.ranks[0].peak_reserved_saved_bytes > 0
    page = frame_page(mime(c)["text/html"])
    assert "<h1>oomdoctor diff</h1>" in page and "Content-Security-Policy" in page
    r = oomdoctor.replay(before, configs=["expandable_segments:True"])
    assert r.self_replay.matches_recorded is True
    page = frame_page(mime(r)["text/html"])
    assert "expandable_segments:True" in page and "as recorded" in page
    assert page.count("<tr>") == 1 + len(r.results)
    assert "self-replay" in str(r)


def test_api_errors_name_the_file(tmp_path):
    bad = tmp_path / "x.pickle"
    bad.write_bytes(b"not a pickle")
    with pytest.raises(oomdoctor.SnapshotError, match="x.pickle"):
        oomdoctor.diagnose(bad)
    with pytest.raises(oomdoctor.OomdoctorError, match="cannot read 'big' as a size"):
        oomdoctor.replay(oomdoctor.__path__[0] + "/data/tp-allreduce-legacy-rank0.pickle", cap="big")
