"""``oomdoctor diff BEFORE AFTER``: what a change did to memory."""

from __future__ import annotations

import click

from ..render.html import render_diff_html
from ..render.json import render_diff_json
from ..render.text import render_diff_text, render_diff_text_plain
from ..report.build import report_of
from ..report.diff import diff_runs
from ..report.overlay import build_diff_visual
from .console import terminal
from .inputs import analyze_inputs, write_output


@click.command("diff")
@click.argument("before", type=click.Path(path_type=str))
@click.argument("after", type=click.Path(path_type=str))
@click.option("--format", "fmt", type=click.Choice(["text", "json", "html"]), default="text", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True, path_type=str),
              help="Write to this file instead of standard output.")
def command(before: str, after: str, fmt: str, output: str | None) -> None:
    """Compare two runs (snapshot files, or directories with one file per rank): peaks, fragmentation,
    findings resolved / new / changed, and the allocation sites that grew or shrank."""
    b, a = analyze_inputs([before]), analyze_inputs([after])
    diff = diff_runs(b, a, report_of(b), report_of(a))
    if fmt == "json":
        text = render_diff_json(diff)
    elif fmt == "html":
        text = render_diff_html(diff, build_diff_visual(diff, b, a))
    elif output:
        text = render_diff_text_plain(diff)
    else:
        render_diff_text(diff, terminal())
        return
    write_output(output, text)
