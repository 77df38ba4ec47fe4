"""Opening a report page in Chromium and reading back what happened."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

# Pixels drawn on every chart, segment-map and flame-graph canvas (non-transparent), read from the canvases.
_DRAWN = """() => Array.from(document.querySelectorAll('canvas')).map(c => {
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
  const kind = c.closest('.uplot') ? 'chart' : c.closest('.flame') ? 'flame' : 'segmap';
  return {kind: kind, drawn: n, total: c.width * c.height};
})"""
# What each flame graph of a report shows: the moment, the event after which it is taken, its root's bytes.
FLAMES = """() => Array.from(document.querySelectorAll('canvas[data-flame]')).map(c => ({
  key: c.dataset.flame, moment: c.dataset.moment, event: +c.dataset.event, root: +c.dataset.rootBytes,
  zoom: +c.dataset.zoom}))"""


@dataclass
class PageLoad:
    console_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    ready_ms: float = 0.0
    wall_s: float = 0.0
    canvases: list[dict] = field(default_factory=list)
    flames: list[dict] = field(default_factory=list)


def live_page(browser, path: Path):
    """Load ``path`` (file://) and wait until the page's script says it has drawn; returns the open page and
    the :class:`PageLoad` its console errors and requests (other than the page itself) keep arriving in."""
    out = PageLoad()
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    url = path.resolve().as_uri()
    page.on("console", lambda m: out.console_errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: out.console_errors.append(str(e)))
    page.on("request", lambda r: out.requests.append(r.url) if r.url != url else None)
    t0 = time.perf_counter()
    page.goto(url)
    page.wait_for_function("window.oomdoctorReady !== undefined", timeout=30_000)
    out.wall_s = time.perf_counter() - t0
    return page, out


def open_page(browser, path: Path, screenshot: Path | None = None) -> PageLoad:
    """Load ``path`` (:func:`live_page`) and collect console errors, every request other than the page
    itself, the time to interactive, the canvases and what the flame graphs show."""
    page, out = live_page(browser, path)
    out.ready_ms = page.evaluate("window.oomdoctorReady")
    out.canvases = page.evaluate(_DRAWN)
    out.flames = page.evaluate(FLAMES)
    if screenshot is not None:
        page.screenshot(path=str(screenshot), full_page=True)
    page.close()
    return out


def screenshot_between(page, first: str, last: str, path: Path) -> None:
    """A full-width screenshot of the page from the top of the element ``first`` to the bottom of ``last``
    (CSS selectors; their first match)."""
    box = page.evaluate("""([a, b]) => {
      const top = document.querySelector(a).getBoundingClientRect().top + window.scrollY;
      const bottom = document.querySelector(b).getBoundingClientRect().bottom + window.scrollY;
      return {x: 0, y: Math.max(top - 8, 0), width: document.documentElement.clientWidth, height: bottom - top + 16};
    }""", [first, last])
    page.screenshot(path=str(path), full_page=True, clip=box)
