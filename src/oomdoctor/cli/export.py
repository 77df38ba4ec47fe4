"""``oomdoctor export PATH... --format perfetto|folded -o FILE``: memory for trace viewers and flame graph tools."""

from __future__ import annotations

import click

from ..errors import UsageError
from ..render.protocol import formats
from ..report.job import Want
from ..views.flame import folded_at
from ..views.moments import moment_at
from .inputs import analyze_inputs, parallel_options, read_job
from .output import OUTPUT, emit


@click.command("export")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--format", "fmt", type=click.Choice(formats("export")), default="perfetto", show_default=True,
              help="perfetto: Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing). folded: the bytes "
                   "allocated at one moment by call stack, 'frame;frame;frame BYTES' root first (flamegraph.pl, "
                   "inferno, speedscope).")
@click.option("--at", "at", metavar="peak|oom|EVENT|TIME",
              help="folded: the moment: peak (of allocated bytes, the default), oom (the last OOM), an event index, "
                   "or a time since the first event (350us, 20ms, 1.5s).")
@click.option("-o", "--output", type=OUTPUT,
              help="Write to this file instead of standard output.")
@parallel_options
def command(paths: tuple[str, ...], fmt: str, at: str | None, output: str | None, jobs: int | None, executor: str,
            scheduler: str | None) -> None:
    """Export per-rank counter tracks (allocated, active, reserved bytes) and instants (OOMs, step starts,
    peaks), timed on the host clock like a PyTorch profiler trace; or one rank's live memory at a moment as
    folded stacks, whose bytes add up to the allocated bytes then."""
    if fmt == "perfetto" and at is not None:
        raise UsageError("--at applies to --format folded only")
    if fmt == "perfetto":
        results = read_job(list(paths), lambda n: Want(tracks=True), jobs=jobs, executor=executor,
                           scheduler=scheduler)
        emit(output, "export", fmt, [r.tracks for r in results])
        return
    analyses = analyze_inputs(list(paths))
    if len(analyses) != 1:
        raise UsageError(f"--format folded writes one rank's stacks, and {', '.join(paths)} hold {len(analyses)} "
                         "ranks: give one snapshot file")
    a = analyses[0]
    folded = folded_at(a, moment_at(a, at or "peak"))
    emit(output, "export", fmt, folded)
    m = folded.moment
    click.echo(f"{a.trace.path}: {len(folded.stacks)} stacks, {folded.allocated_bytes:,} bytes allocated after event "
               f"{m.event} ({m.name})", err=True)
