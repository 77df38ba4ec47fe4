"""``oomdoctor export PATH... --format perfetto -o trace.json``: memory tracks for trace viewers."""

from __future__ import annotations

import click

from ..render.perfetto import render_perfetto
from ..report.tracks import rank_tracks
from .inputs import analyze_inputs, write_output


@click.command("export")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--format", "fmt", type=click.Choice(["perfetto"]), default="perfetto", show_default=True,
              help="perfetto: Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True, path_type=str),
              help="Write to this file instead of standard output.")
def command(paths: tuple[str, ...], fmt: str, output: str | None) -> None:
    """Export per-rank counter tracks (allocated, active, reserved bytes) and instants (OOMs, step starts,
    peaks), timed on the host clock like a PyTorch profiler trace."""
    analyses = analyze_inputs(list(paths))
    write_output(output, render_perfetto([rank_tracks(a) for a in analyses]))
