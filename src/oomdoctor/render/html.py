"""The self-contained HTML report (Jinja2 templates, uPlot charts).

One file that opens offline: every script and style is inlined, a Content-Security-Policy forbids
any request, and the data travels as one JSON literal (``tojson``, HTML-safe). Text from snapshots
(stack frames, file names) is only ever put in the page by Jinja's autoescaping or the DOM's
``textContent``, never as markup. Vendored: uPlot 1.6.32 (MIT), see ``assets/VENDORED.md``.
"""

from __future__ import annotations

from dataclasses import asdict
from functools import lru_cache
from html import escape
from importlib import resources
from typing import Any

import jinja2

from .. import __version__
from ..report.diff import Diff
from ..report.model import Report
from ..report.visual import RankView, Visual
from ..simulate.whatif import Simulation
from .format import format_bytes, format_signed_bytes, format_us
from .json import diff_dict, report_dict, simulation_dict


@lru_cache(maxsize=None)
def _asset(name: str) -> str:
    return resources.files("oomdoctor.render").joinpath("assets", name).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("oomdoctor.render", "templates"),
                             autoescape=jinja2.select_autoescape(default=True), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["bytes"] = format_bytes
    env.filters["us"] = format_us
    env.filters["signed_bytes"] = format_signed_bytes
    env.filters["evidence"] = _evidence_value
    env.globals["asset"] = _asset
    return env


def _evidence_value(key: str, value: Any) -> str:
    """Evidence values as people read them: ``*_bytes`` as sizes, ``*_us`` as durations."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int) and key.endswith("bytes"):
        return format_bytes(value)
    if isinstance(value, int) and key.endswith("_us"):
        return format_us(value)
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _view_data(v: RankView) -> dict[str, Any]:
    """The part of a rank's view the page's script draws (timeline, markers, segment maps)."""
    return {"rank": v.rank, "timeline": None if v.timeline is None else asdict(v.timeline),
            "markers": [asdict(m) for m in v.markers],
            "moments": [{"name": m.name, "event": m.event, "segments": [asdict(s) for s in m.segments]}
                        for m in v.moments]}


def render_html(report: Report, visual: Visual) -> str:
    """The report as one HTML page (str). ``visual`` must come from the same analyses as ``report``."""
    views = {f"r{i}": _view_data(v) for i, v in enumerate(visual.ranks)}
    plain = report_dict(report)
    return _environment().get_template("report.html.j2").render(
        title="oomdoctor report", report=report, findings=plain["findings"], verdict=plain["verdict"],
        ranks=list(zip(report.ranks, visual.ranks)), data={"views": views},
        points=visual.timeline_points, version=__version__)


def render_diff_html(diff: Diff, before: Visual, after: Visual) -> str:
    """A before/after comparison as one HTML page: per rank pair, the two timelines on one y-scale."""
    b_by = {v.path: v for v in before.ranks}
    a_by = {v.path: v for v in after.ranks}
    views: dict[str, Any] = {}
    for i, r in enumerate(diff.ranks):
        views[f"b{i}"] = _view_data(b_by[r.before_path])
        views[f"a{i}"] = _view_data(a_by[r.after_path])
    return _environment().get_template("diff.html.j2").render(
        title="oomdoctor diff", diff=diff, d=diff_dict(diff), before=before, after=after,
        data={"views": views}, points=before.timeline_points, version=__version__)


def render_simulation_html(sim: Simulation) -> str:
    """``oomdoctor simulate``'s result as one HTML page (the JSON contract's numbers in a table)."""
    return _environment().get_template("simulation.html.j2").render(
        title="oomdoctor simulate", sim=simulation_dict(sim), data={"views": {}}, version=__version__)


def embed(page: str, height_px: int = 720) -> str:
    """A page as an ``<iframe srcdoc>`` for a notebook cell: its styles, scripts and
    Content-Security-Policy stay inside the frame (the page is attribute-escaped, never parsed here)."""
    return (f'<iframe srcdoc="{escape(page, quote=True)}" style="width:100%;height:{int(height_px)}px;border:0" '
            'title="oomdoctor"></iframe>')
