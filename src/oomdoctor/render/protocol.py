"""The renderer protocol: what every command's output goes through (pyinstrument's ``Renderer``, memray's
``BaseReporter``).

A command builds its result in the core (a :class:`~oomdoctor.report.model.Report`, a
:class:`~oomdoctor.simulate.whatif.Simulation`, a :class:`~oomdoctor.report.loop.FitOutcome`, ...), asks
:func:`renderer` for the renderer of its ``--format``, and hands both to the CLI's one output helper
(:func:`oomdoctor.cli.output.emit`), which writes what the renderer returns to ``-o`` or to standard output alike.
A renderer only reads the result and returns its text or bytes; it never computes.

:data:`RENDERERS` maps ``(command, format)`` to its renderer; :func:`formats` lists a command's formats (its
``--format`` choices, the first the default). Each renderer imports its module when it is first used, so that a
command imports only the renderer it writes with (start-up: docs/benchmarks.md).
"""

from __future__ import annotations

import importlib
import io
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from rich.console import Console


@runtime_checkable
class Renderer(Protocol):
    """What renders one command's result in one format."""

    @property
    def output_file_extension(self) -> str:
        """The extension a file of this output takes (``txt``, ``json``, ``html``, ``pickle``...)."""
        ...

    @property
    def output_is_binary(self) -> bool:
        """True when :meth:`render` returns bytes (a pickle), False when text."""
        ...

    def render(self, result: Any, **options: Any) -> str | bytes:
        """The whole output for ``result``: what a file given to ``-o`` holds, byte for byte what ``-o -`` writes.
        ``options``: how to lay it out (``all_ranks``, ``limit``, ``width``...), never what to compute; a renderer
        ignores the options it has no use for."""
        ...


@runtime_checkable
class ConsoleDrawer(Renderer, Protocol):
    """A renderer that also draws on a terminal (rich: colour, the terminal's width) when no ``-o`` is given."""

    def draw(self, result: Any, console: Console, **options: Any) -> None:
        ...


@dataclass(frozen=True)
class FunctionRenderer:
    """A renderer that is one function ``fn(result, **options) -> str | bytes``. ``terminal_width``: on standard
    output without ``-o``, the text is wrapped at the terminal's width (option ``width``), else at the function's
    default."""

    fn: Callable[..., str | bytes]
    output_file_extension: str
    output_is_binary: bool = False
    terminal_width: bool = False

    def render(self, result: Any, **options: Any) -> str | bytes:
        return self.fn(result, **options)


@dataclass(frozen=True)
class RichRenderer:
    """A renderer that draws with rich, ``fn(result, console, **options)``: on a terminal in colour
    (:meth:`draw`); into a file without colour at ``width`` columns (:meth:`render`)."""

    fn: Callable[..., None]
    width: int = 120
    output_file_extension: str = "txt"
    output_is_binary: bool = False

    def render(self, result: Any, **options: Any) -> str:
        from .console import plain_console

        buf = io.StringIO()
        self.fn(result, plain_console(buf, self.width), **options)
        return buf.getvalue()

    def draw(self, result: Any, console: Console, **options: Any) -> None:
        self.fn(result, console, **options)


# ---------------------------------------------------------------------------------------------- the renderers
# Each imports its module when called: render.json needs no rich, render.text no json, render.html is jinja2's.


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """``oomdoctor.render.<module>.<name>`` called with the result (and, drawn with rich, the console), its module
    imported on the first call; the layout options are not its."""
    def call(result: Any, *console: Any, **_: Any) -> Any:
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)(result, *console)
    return call


def _report_text(report: Any, console: Console, *, all_ranks: bool = False, **_: Any) -> None:
    from .text import render_text

    render_text(report, console, all_ranks=all_ranks)


def _report_html(report: Any, *, visual: Any, **_: Any) -> str:
    from .html import render_html

    return render_html(report, visual)


def _diff_html(diff: Any, *, visual: Any, **_: Any) -> str:
    from .html import render_diff_html

    return render_diff_html(diff, visual)


def _estimate_json(e: Any, **_: Any) -> str:
    from .plan import estimate_dict, render_plan_json

    return render_plan_json(estimate_dict(e))


def _search_text(r: Any, console: Console, *, limit: int = 15, **_: Any) -> None:
    from .plan import render_search_text

    render_search_text(r, console, limit=limit)


def _search_json(r: Any, **_: Any) -> str:  # every candidate, whatever the text's --top
    from .plan import render_plan_json, search_dict

    return render_plan_json(search_dict(r))


def _validation_json(v: Any, **_: Any) -> str:
    from .plan import render_plan_json, validation_dict

    return render_plan_json(validation_dict(v))


def _pickle(snapshot: Any, **_: Any) -> bytes:
    """A snapshot dict as PyTorch's ``_dump_snapshot`` writes it (pickle protocol 4)."""
    return pickle.dumps(snapshot, protocol=4)


def _schema_json(command: str, **_: Any) -> str:
    import json

    from .schema import schema

    return json.dumps(schema(command), indent=2) + "\n"


def _preflight_text(a: Any, *, width: int = 80, **_: Any) -> str:
    from .preflight import render_preflight_text

    return render_preflight_text(a, width)


_TEXT_REPORT = RichRenderer(_report_text)
_HTML_REPORT = FunctionRenderer(_report_html, "html")

RENDERERS: dict[tuple[str, str], Renderer] = {
    ("diagnose", "text"): _TEXT_REPORT,
    ("diagnose", "json"): FunctionRenderer(_lazy("json", "render_json"), "json"),
    ("diagnose", "html"): _HTML_REPORT,
    ("report", "html"): _HTML_REPORT,
    ("export", "perfetto"): FunctionRenderer(_lazy("perfetto", "render_perfetto"), "json"),
    ("export", "folded"): FunctionRenderer(_lazy("folded", "render_folded"), "folded"),
    ("simulate", "text"): RichRenderer(_lazy("text", "render_simulation_text")),
    ("simulate", "json"): FunctionRenderer(_lazy("json", "render_simulation_json"), "json"),
    ("plan estimate", "text"): RichRenderer(_lazy("plan", "render_estimate_text"), width=130),
    ("plan estimate", "json"): FunctionRenderer(_estimate_json, "json"),
    ("plan search", "text"): RichRenderer(_search_text, width=130),
    ("plan search", "json"): FunctionRenderer(_search_json, "json"),
    ("plan validate", "text"): FunctionRenderer(_lazy("plan", "render_validation_text"), "txt"),
    ("plan validate", "json"): FunctionRenderer(_validation_json, "json"),
    ("slice", "pickle"): FunctionRenderer(_pickle, "pickle", output_is_binary=True),
    ("diff", "text"): RichRenderer(_lazy("text", "render_diff_text")),
    ("diff", "json"): FunctionRenderer(_lazy("json", "render_diff_json"), "json"),
    ("diff", "html"): FunctionRenderer(_diff_html, "html"),
    ("schema", "json"): FunctionRenderer(_schema_json, "json"),
    ("fit", "text"): FunctionRenderer(_lazy("loop", "fit_text"), "txt"),
    ("fit", "json"): FunctionRenderer(_lazy("loop", "fit_json"), "json"),
    ("verify", "text"): FunctionRenderer(_lazy("loop", "verify_text"), "txt"),
    ("verify", "json"): FunctionRenderer(_lazy("loop", "verify_json"), "json"),
    ("tune", "text"): FunctionRenderer(_lazy("tune", "render_tune_text"), "txt"),
    ("tune", "json"): FunctionRenderer(_lazy("tune", "render_tune_json"), "json"),
    ("preflight", "text"): FunctionRenderer(_preflight_text, "txt", terminal_width=True),
    ("preflight", "json"): FunctionRenderer(_lazy("preflight", "render_preflight_json"), "json"),
    ("preflight snapshot", "pickle"): FunctionRenderer(_pickle, "pickle", output_is_binary=True),
}
"""(command, format) -> its renderer; a command's formats in the order of its ``--format`` choices, the first the
default."""


def formats(command: str) -> list[str]:
    """The formats ``command`` writes (its ``--format`` choices), the default first."""
    got = [f for (c, f) in RENDERERS if c == command]
    if not got:
        raise KeyError(command)
    return got


def renderer(command: str, fmt: str) -> Renderer:
    """The renderer of ``command``'s output in ``fmt``.

    Raises:
        KeyError: ``command`` has no such format (see :func:`formats`).
    """
    return RENDERERS[(command, fmt)]


__all__ = ["RENDERERS", "ConsoleDrawer", "FunctionRenderer", "Renderer", "RichRenderer", "formats", "renderer"]
