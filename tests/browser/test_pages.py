"""Every shared snapshot's HTML report, and the tp-allreduce diff, in headless Chromium: no console
error, no request leaving the page, charts, segment maps and flame graphs drawn, each flame graph's root
the allocated bytes of its moment; screenshots kept in build/test-artifacts/."""

from pathlib import Path

import pytest
from pages import open_page

from oomdoctor import load as load_snapshot
from oomdoctor.analysis import analyze
from oomdoctor.cli.main import main

MiB = 1 << 20


def _all_snapshots(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.name.endswith((".pickle", ".pickle.xz")))


def _check(load, charts: int, flames: int | None = None):
    assert load.console_errors == []
    assert load.requests == []
    drawn = [c for c in load.canvases if c["kind"] == "chart"]
    assert len(drawn) == charts
    assert sum(1 for c in load.canvases if c["kind"] == "flame") == (charts if flames is None else flames)
    for c in load.canvases:  # every chart, segment map and flame graph has ink on it
        assert c["drawn"] > 0.01 * c["total"], c


def _roots_are_the_allocated_bytes(load, paths: list[Path]):
    """Each rank's flame graph opens at the OOM (else the peak of allocated bytes) with the allocated bytes
    then as its root, from the timeline counted afresh."""
    assert len(load.flames) == len(paths)
    for f, p in zip(load.flames, paths):
        a = analyze(load_snapshot(p))
        want = int(a.oom_events[-1]) if a.oom_events.size else a.peak_allocated[1]
        assert f["event"] == want and f["moment"].split(" · ")[0] in ("OOM", "peak allocated"), f
        assert f["root"] == a.allocated_at(want) and f["zoom"] == 0, (p, f)


def test_reports_of_every_shared_snapshot(browser, snapshots, tmp_path, artifacts):
    files = _all_snapshots(snapshots)
    assert len(files) >= 21
    for f in files:
        name = f"{f.parent.name}-{f.name.split('.')[0]}"
        out = tmp_path / f"{name}.html"
        assert main(["report", str(f), "-o", str(out)]) == 0
        load = open_page(browser, out, artifacts / f"report-{name}.png")
        _check(load, charts=1)
        assert sum(1 for c in load.canvases if c["kind"] == "segmap") >= 1, name
        _roots_are_the_allocated_bytes(load, [f])


def test_multi_rank_report_and_diff(browser, snapshots, tmp_path, artifacts):
    tp = snapshots / "tp-allreduce"
    out = tmp_path / "ranks.html"
    ranks = [tp / "legacy-rank0.pickle", tp / "legacy-rank1.pickle"]
    assert main(["report", *map(str, ranks), "-o", str(out)]) == 0
    load = open_page(browser, out, artifacts / "report-tp-legacy-2ranks.png")
    _check(load, charts=2)
    _roots_are_the_allocated_bytes(load, ranks)
    out = tmp_path / "diff.html"
    assert main(["diff", str(tp / "legacy-rank0.pickle"), str(tp / "modern-rank0.pickle"), "--format", "html",
                 "-o", str(out)]) == 0
    load = open_page(browser, out, artifacts / "diff-tp-allreduce-legacy-vs-modern.png")
    _check(load, charts=1, flames=1)  # both runs on one axis; the bytes moved by stack
    text = out.read_text()
    assert "resolved" in text and "deferred-free" in text


@pytest.mark.slow
def test_large_report_size_and_load(browser, snapshots, tmp_path, artifacts):
    out = tmp_path / "large.html"
    assert main(["report", str(snapshots / "large"), "-o", str(out)]) == 0
    size = out.stat().st_size
    assert size <= 5 * 1000 * 1000, size
    load = open_page(browser, out, artifacts / "report-large.png")
    _check(load, charts=1)
    _roots_are_the_allocated_bytes(load, [snapshots / "large" / "fsdp2-gpt2-60steps-rank0.pickle.xz"])
    assert "271,109 events" in out.read_text()


def test_notebook_frame_draws_the_report(browser, snapshots, tmp_path, artifacts):
    """What a notebook cell shows for ``oomdoctor.diagnose(path)``: the ``_repr_html_`` markup put in a
    page as Jupyter puts it, loaded in Chromium: the report draws inside the frame, with no error and
    no request."""
    import oomdoctor

    d = oomdoctor.diagnose(snapshots / "tp-allreduce" / "legacy-rank0.pickle")
    cell = tmp_path / "cell.html"
    cell.write_text(f"<!DOCTYPE html><html><body><div class='output'>{d._repr_html_()}</div></body></html>")
    errors, requests = [], []
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url) if r.url.startswith(("http", "ws")) else None)
    page.goto(cell.resolve().as_uri())
    frame = page.frame_locator("iframe[title=oomdoctor]")
    frame.locator("body").wait_for()
    inner = next(f for f in page.frames if f is not page.main_frame)
    inner.wait_for_function("window.oomdoctorReady !== undefined", timeout=30_000)
    text = inner.inner_text("body")
    assert "DEFERRED-FREE" in text.upper() and d.verdict.kind == "deferred-free"
    drawn = inner.evaluate("() => document.querySelectorAll('canvas').length")
    page.screenshot(path=str(artifacts / "notebook-cell.png"), full_page=False)
    page.close()
    assert drawn >= 2 and errors == [] and requests == []
