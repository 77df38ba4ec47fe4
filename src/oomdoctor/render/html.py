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

from .._version import __version__
from ..report.diff import Diff
from ..report.model import Report
from ..simulate.whatif import Simulation
from ..views.flame import DIFF_COLORS, FlameView, category_colors
from ..views.overlay import DiffVisual, PairView
from ..views.visual import RankView, Visual
from .format import format_bytes, format_signed_bytes, format_us, span
from .json import diff_dict, report_dict, simulation_dict
from .words import fits as fits_words
from .words import gate as gate_words
from .words.findings import resolve_title


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
    env.filters["span"] = span
    env.filters["signed_bytes"] = format_signed_bytes
    env.filters["evidence"] = _evidence_value
    env.filters["finding_title"] = resolve_title
    env.filters["fit_notes"] = fits_words.notes  # a Fits's note ids in words (render/words/fits.py)
    env.globals["asset"] = _asset
    env.policies["json.dumps_kwargs"] = {"sort_keys": True, "separators": (",", ":")}  # the page's data, compact
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


ANATOMY_FIELDS = ("requested_bytes", "rounding_waste_bytes", "pending_free_bytes", "free_in_used_segments_bytes",
                  "free_segments_bytes", "reserved_bytes", "largest_free_block_bytes", "segments")
"""The anatomy's numbers the page's panel shows (``macros.html.j2`` ``anatomy_bar``)."""


def _flame_data(f: FlameView | None) -> dict[str, Any] | None:
    """A rank's flame graphs as the script draws them: per moment its tree's preorder arrays (``d`` depth, ``f``
    frame, ``v`` bytes, ``c`` category, ``mix`` the split of mixed nodes) and its anatomy."""
    if f is None:
        return None
    moments = []
    for m in f.moments:
        t = m.tree
        moments.append({"name": m.moment.name, "kind": m.moment.kind, "event": m.moment.event,
                        "time_us": m.moment.time_us, "bytes": m.allocated_bytes,
                        "anatomy": {k: getattr(m.anatomy, k) for k in ANATOMY_FIELDS},
                        "d": t.depth, "f": t.frame, "v": t.bytes, "c": t.category, "mix": t.mixed,
                        "left_out": t.left_out})
    return {"frames": f.frames, "shown": f.shown, "moments": moments}


def _view_data(v: RankView) -> dict[str, Any]:
    """The part of a rank's view the page's script draws (timeline, markers, segment maps, flame graphs)."""
    return {"rank": v.rank, "timeline": None if v.timeline is None else asdict(v.timeline),
            "markers": [asdict(m) for m in v.markers],
            "moments": [{"name": m.name, "event": m.event, "segments": [asdict(s) for s in m.segments]}
                        for m in v.moments],
            "flame": _flame_data(v.flame)}


def _pair_data(p: PairView) -> dict[str, Any]:
    """A pair of ranks of the diff: its two x axes and its difference tree (``b``/``a`` bytes before/after, ``w``
    bytes moved, the width, ``g`` the colour grade)."""
    t = p.flame
    return {"event": None if p.event is None else asdict(p.event), "time": None if p.time is None else asdict(p.time),
            "flame": {"frames": p.frames, "d": t.depth, "f": t.frame, "b": t.before, "a": t.after, "w": t.moved,
                      "g": t.grade, "left_out": t.left_out}}


def render_html(report: Report, visual: Visual) -> str:
    """The report as one HTML page (str). ``visual`` must come from the same analyses as ``report``."""
    by_rank = {v.rank: v for v in visual.ranks}
    ranks = [(r, by_rank[r.rank]) for r in report.ranks if r.rank in by_rank]
    views = {f"r{i}": _view_data(v) for i, (_r, v) in enumerate(ranks)}
    plain = report_dict(report)
    categories = category_colors()
    heat = asdict(visual.heatmap) if visual.heatmap is not None else None
    return _environment().get_template("report.html.j2").render(
        title="oomdoctor report", report=report, findings=plain["findings"], verdict=plain["verdict"],
        ranks=ranks, groups=plain.get("groups") if heat else None, heat=heat,
        data={"views": views, "categories": categories, "heat": heat},
        category_color={c["name"]: c["color"] for c in categories}, points=visual.timeline_points,
        ranks_read=gate_words.headline_ranks(report),
        unread=gate_words.unread_line(report.unread) if report.unread else None, version=__version__)


def render_diff_html(diff: Diff, visual: DiffVisual) -> str:
    """A before/after comparison as one HTML page: per rank pair, both timelines on one axis aligned at step
    starts, and the bytes moved by call stack. ``visual`` must come from the same analyses as ``diff``."""
    pairs = {f"p{i}": _pair_data(p) for i, p in enumerate(visual.pairs)}
    return _environment().get_template("diff.html.j2").render(
        title="oomdoctor diff", diff=diff, d=diff_dict(diff), pairs=visual.pairs,
        data={"pairs": pairs, "diff_colors": list(DIFF_COLORS)}, diff_colors=DIFF_COLORS, version=__version__)


def render_simulation_html(sim: Simulation) -> str:
    """``oomdoctor simulate``'s result as one HTML page (the JSON contract's numbers in a table)."""
    from .words import simulate as sim_words

    return _environment().get_template("simulation.html.j2").render(
        title="oomdoctor simulate", sim=simulation_dict(sim), data={"views": {}}, version=__version__,
        no_oom=sim_words.NO_OOM[sim.reach], reach=sim_words.REACH[sim.reach].format(event=sim.recorded_oom_event))


def embed(page: str, height_px: int = 720) -> str:
    """A page as an ``<iframe srcdoc>`` for a notebook cell: its styles, scripts and
    Content-Security-Policy stay inside the frame (the page is attribute-escaped, never parsed here)."""
    return (f'<iframe srcdoc="{escape(page, quote=True)}" style="width:100%;height:{int(height_px)}px;border:0" '
            'title="oomdoctor"></iframe>')
