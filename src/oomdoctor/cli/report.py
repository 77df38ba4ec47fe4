"""``oomdoctor report PATH... -o report.html``: the self-contained HTML report."""

from __future__ import annotations

import os

import click

from ..render.html import render_html
from ..report.build import report_of
from ..report.visual import build_visual
from ..report.gate import LEVELS
from .diagnose import DEMO_SNAPSHOT, fail_on_exit, inputs_or_demo
from .inputs import analyze_inputs, write_text

DEFAULT_OUTPUT = "oomdoctor-report.html"


@click.command("report")
@click.argument("paths", nargs=-1, type=click.Path(path_type=str))
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True, path_type=str),
              default=DEFAULT_OUTPUT, show_default=True, help="The HTML file to write.")
@click.option("--demo", is_flag=True, help=f"Report on the snapshot shipped with oomdoctor ({DEMO_SNAPSHOT}).")
@click.option("--fail-on", type=click.Choice(LEVELS), default=None,
              help="Exit 1 when a finding at or above this severity is found, or (unhealthy) when the verdict "
                   "is anything but healthy: a CI gate. The report is written first.")
def command(paths: tuple[str, ...], output: str, demo: bool, fail_on: str | None) -> int:
    """Write one HTML page that opens offline: timelines, fragmentation, segment maps, sites, findings,
    and the ranks side by side."""
    analyses = analyze_inputs(inputs_or_demo(paths, demo, "report"))
    report = report_of(analyses)
    page = render_html(report, build_visual(analyses))
    write_text(output, page)
    click.echo(f"wrote {output} ({os.path.getsize(output) / 2**20:.1f} MiB)", err=True)
    return fail_on_exit(report, fail_on)
