"""``oomdoctor slice SNAPSHOT --start X --end Y -o OUT``: a smaller snapshot of one window."""

from __future__ import annotations

import os

import click

from ..analysis.device import analyze
from ..analysis.slicing import WINDOW_UNITS, event_window, slice_metadata, slice_snapshot
from ..capture.files import json_bytes, sidecar_for, sidecar_name
from ..errors import UsageError
from ..trace import load
from ..units import parse_duration_us
from .output import FILE, OUTPUT, emit, write_bytes


def parse_bound(text: str | None, unit: str) -> float | None:
    """A window bound: an integer for ``event``/``step``; for ``time`` a number of µs or one with a
    unit (``350us``, ``20ms``, ``1.5s``), counted from the trace's first event."""
    if text is None:
        return None
    if unit == "time":
        us = parse_duration_us(text)
        if us is None:
            raise UsageError(f"bad time {text!r}: a number of µs, or with a unit: 350us, 20ms, 1.5s")
        return us
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"bad {unit} {text!r}: an integer") from None


@click.command("slice")
@click.argument("snapshot", type=click.Path(dir_okay=False, path_type=str))
@click.option("--by", "unit", type=click.Choice(WINDOW_UNITS), default="event", show_default=True,
              help="What --start and --end count: event indices, time since the first event, or steps.")
@click.option("--start", help="First event / time / step of the window (default: the trace's start).")
@click.option("--end", help="End of the window, exclusive (default: the trace's end).")
@click.option("-o", "--output", required=True, type=OUTPUT,
              help="The snapshot pickle to write, or - (a sidecar <stem>.meta.json goes beside a regular file).")
def command(snapshot: str, unit: str, start: str | None, end: str | None, output: str) -> None:
    """Cut a window out of a snapshot: a valid smaller snapshot that pytorch.org/memory_viz and oomdoctor
    open, whose segments hold every block alive in the window. OUTPUT may be a file, a link (its target
    is written), a FIFO or device, or - (standard output); the sidecar is written only beside a file."""
    if output != "-" and os.path.exists(output) and os.path.exists(snapshot) and os.path.samefile(output, snapshot):
        raise UsageError(f"{output}: would overwrite the input snapshot; choose another -o")
    trace = load(snapshot)
    a = analyze(trace)
    window = event_window(trace, a.device, parse_bound(start, unit), parse_bound(end, unit), unit)
    snap = slice_snapshot(trace, a.device, a.lifetimes, window)
    kind = emit(output, "slice", "pickle", snap).kind
    name = "standard output" if output == "-" else output
    if kind == FILE:
        write_bytes(sidecar_for(output), json_bytes(slice_metadata(trace, a.device, window)))
    else:
        side = "" if output == "-" else f" ({sidecar_name(output)})"
        click.echo(f"oomdoctor: {name} is not a regular file: no sidecar{side} was written, so the window's "
                   "steps and phases are not kept", err=True)
    click.echo(f"wrote {name}: {window.how}, {window.num_events:,} of {a.num_events:,} events, "
               f"{len(snap['segments'])} segments at the window's end", err=True)
