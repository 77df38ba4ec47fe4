"""The flame graphs in Chromium: a click on the timeline redraws the flame graph and the anatomy of the moment
it picks, zooming works, the diff page draws both runs on one axis and the bytes moved by stack, and speedscope
reads the folded export as oomdoctor wrote it."""

import base64
import json
from pathlib import Path

from folded import parse_folded
from pages import FLAMES, live_page, screenshot_between

from oomdoctor import load
from oomdoctor.analysis import analyze
from oomdoctor.cli.main import main
from oomdoctor.render.format import format_bytes


def test_a_click_on_the_timeline_redraws_the_flame_graph_and_the_anatomy(browser, snapshots, tmp_path, artifacts):
    src = snapshots / "fragmentation-oom" / "default-oom.pickle"
    out = tmp_path / "frag.html"
    assert main(["report", str(src), "-o", str(out)]) == 0
    a = analyze(load(src))
    n = a.num_events
    page, seen = live_page(browser, out)
    card = page.locator("[data-flame-card]").first
    first = page.evaluate(FLAMES)[0]
    assert (first["moment"], first["event"]) == ("OOM", n - 1) and first["root"] == int(a.timeline.allocated[-1])
    over = page.locator(".u-over").first
    box = over.bounding_box()
    over.click(position={"x": box["width"] * 0.3, "y": box["height"] / 2})
    now = page.evaluate(FLAMES)[0]
    # the nearest of ~128 moments to the event under the click (the x axis runs over the events)
    assert abs(now["event"] - 0.3 * n) < n / 50, now
    assert now["root"] == int(a.timeline.allocated[now["event"]]) != first["root"]
    an = a.anatomy_at(now["event"])
    assert card.locator("th[data-an=reserved_bytes]").inner_text() == format_bytes(an.reserved_bytes)
    assert card.locator("td[data-an=free_in_used_segments_bytes]").inner_text() == \
        format_bytes(an.free_in_used_segments_bytes)
    assert card.locator("[data-flame-event]").inner_text() == f"{now['event']:,}"
    screenshot_between(page, ".card:has([data-timeline])", "[data-flame-card]",
                       artifacts / "report-flame-fragmentation-oom.png")
    card.locator("button", has_text="peak reserved").click()
    peak = page.evaluate(FLAMES)[0]
    assert peak["event"] == a.peak_reserved[1] and peak["root"] == int(a.timeline.allocated[a.peak_reserved[1]])
    canvas = card.locator("canvas[data-flame]")
    canvas.click(position={"x": 40, "y": 17 + 8})   # the first frame under the root: zoom in
    assert page.evaluate(FLAMES)[0]["zoom"] > 0
    canvas.click(position={"x": 40, "y": 8})        # the root: zoom out
    assert page.evaluate(FLAMES)[0]["zoom"] == 0
    page.close()
    assert seen.console_errors == [] and seen.requests == []


def test_diff_page_draws_both_runs_on_one_axis_and_the_bytes_moved(browser, snapshots, tmp_path, artifacts):
    before, after = snapshots / "ddp-imbalance" / "rank0.pickle", snapshots / "ddp-clean" / "rank0.pickle"
    out = tmp_path / "diff.html"
    assert main(["diff", str(before), str(after), "--format", "html", "-o", str(out)]) == 0
    page, seen = live_page(browser, out)
    b, a = analyze(load(before)), analyze(load(after))
    flame = page.locator("canvas[data-diff-flame]")
    assert int(flame.get_attribute("data-before-bytes")) == int(b.timeline.active[b.peak_reserved[1]])
    assert int(flame.get_attribute("data-after-bytes")) == int(a.timeline.active[a.peak_reserved[1]])
    assert page.locator(".u-legend").first.inner_text().count("before") == 2
    assert "12 step starts aligned" in page.inner_text("body")
    page.locator("input[value=time]").check()
    assert page.locator(".uplot").count() == 1
    page.locator("input[value=event]").check()
    screenshot_between(page, ".card:has([data-overlay])", ".card:has(canvas[data-diff-flame])",
                       artifacts / "diff-flame-ddp-imbalance-vs-clean.png")
    page.close()
    assert seen.console_errors == [] and seen.requests == []


def _speedscope_stacks(doc: dict) -> dict[tuple[str, ...], int]:
    """Bytes per stack of speedscope's own export of an evented profile (open/close events at byte offsets)."""
    names = [f["name"] for f in doc["shared"]["frames"]]
    prof = doc["profiles"][0]
    out: dict[tuple[str, ...], int] = {}
    stack, at = [], prof["startValue"]
    for ev in prof["events"]:
        if stack and ev["at"] > at:
            key = tuple(names[f] for f in stack)
            out[key] = out.get(key, 0) + ev["at"] - at
        at = ev["at"]
        if ev["type"] == "O":
            stack.append(ev["frame"])
        else:
            assert stack.pop() == ev["frame"]
    return out


def test_speedscope_reads_the_folded_export(browser, speedscope, snapshots, tmp_path):
    for name in ("fsdp2-gpt2/rank0.pickle", "tp-allreduce/legacy-cppstacks-rank0.pickle",
                 "fragmentation-oom/default-oom.pickle"):
        folded = tmp_path / "memory.folded"
        assert main(["export", str(snapshots / name), "--format", "folded", "-o", str(folded)]) == 0
        ours = {tuple(p): n for p, n in parse_folded(folded.read_text())}
        script = tmp_path / "profile.js"  # what speedscope's own CLI hands its page
        b64 = base64.b64encode(folded.read_bytes()).decode()
        script.write_text(f"speedscope.loadFileFromBase64({json.dumps(folded.name)}, {json.dumps(b64)})")
        page = browser.new_page(accept_downloads=True)
        logs = []
        page.on("console", lambda m: logs.append(m.text))
        page.goto(f"{speedscope.as_uri()}#localProfilePath={script}")
        page.wait_for_function("document.body.innerText.includes('Export')", timeout=30_000)
        with page.expect_download() as dl:
            page.get_by_text("Export").click()
        doc = json.loads(Path(dl.value.path()).read_text())
        page.close()
        assert "Importing as collapsed stack format" in logs, logs
        assert doc["profiles"][0]["endValue"] == sum(ours.values()) == analyze(load(snapshots / name)).peak_allocated[0]
        assert _speedscope_stacks(doc) == ours, name
