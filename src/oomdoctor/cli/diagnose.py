"""``oomdoctor diagnose PATH...``: what is wrong, in numbers, and how to fix it."""

from __future__ import annotations

import io
import os
import sys
from importlib import resources

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn

from ..errors import UsageError
from ..render import render_json, render_text
from ..report import build_report
from ..trace import load_ranks

DEMO_SNAPSHOT = "tp-allreduce-legacy-rank0.pickle"
_PROGRESS_MIN_BYTES = 1 << 20


def demo_path() -> str:
    """The real snapshot shipped in the package: seed 000's tensor-parallel all-reduce toy with
    PyTorch's pre-2.8 record_stream behaviour, rank 0 (``shared/snapshots/tp-allreduce/legacy-rank0``)."""
    return str(resources.files("oomdoctor").joinpath("data", DEMO_SNAPSHOT))


@click.command("diagnose")
@click.argument("paths", nargs=-1, type=click.Path(path_type=str))
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="Output format.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True, path_type=str),
              help="Write the report to this file instead of standard output.")
@click.option("--demo", is_flag=True, help=f"Diagnose a real snapshot shipped with oomdoctor ({DEMO_SNAPSHOT}).")
def command(paths: tuple[str, ...], fmt: str, output: str | None, demo: bool) -> None:
    """Diagnose snapshot files or directories (one file per rank) of a failing or bloated run."""
    inputs = list(paths)
    if demo:
        inputs.append(demo_path())
    if not inputs:
        raise UsageError("no snapshot given: oomdoctor diagnose PATH... (files or directories), or --demo")
    traces = _load(inputs)
    report = build_report(traces)
    if fmt == "json":
        text = render_json(report)
    elif output:
        buf = io.StringIO()
        render_text(report, Console(file=buf, width=120, no_color=True, highlight=False))
        text = buf.getvalue()
    else:
        render_text(report, Console(highlight=False))
        return
    if output:
        _write(output, text)
    else:
        click.echo(text, nl=False)


def _load(inputs: list[str]):
    """Load with a progress display on a terminal when the input is large: bytes read, then a spinner
    while the file is decoded and turned into columns."""
    total = sum(os.path.getsize(p) for p in inputs if os.path.isfile(p))
    if total < _PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        return load_ranks(inputs)
    console = Console(stderr=True)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("loading", total=None)

        def progress(done: int, file_total: int) -> None:
            what = "reading" if done < file_total else "decoding and indexing"
            bar.update(task, description=f"{what} snapshot", completed=done, total=file_total)

        return load_ranks(inputs, progress=progress)


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"{path}: cannot write the report ({e.strerror or e})") from None
