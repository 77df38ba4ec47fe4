"""``oomdoctor diagnose PATH...``: what is wrong, in numbers, and how to fix it."""

from __future__ import annotations

import click

from ..detectors.materiality import DEFAULT_FRACTION, Materiality
from ..errors import UsageError
from ..render.gate import gate_line
from ..render.protocol import formats
from ..render.text import GROUPED_RANKS
from ..report.gate import LEVELS, gate
from ..report.job import Want, job_report
from ..units import parse_bytes
from .inputs import parallel_options, read_job
from .output import OUTPUT, emit

DEMO_SNAPSHOT = "tp-allreduce-legacy-rank0.pickle"


def demo_path() -> str:
    """The real snapshot shipped in the package: rank 0 of a two-rank tensor-parallel job on H200 GPUs whose
    all-reduce inputs were ``record_stream``-ed, as PyTorch did before 2.8 (frees deferred)."""
    from importlib import resources  # only for --demo (start-up: docs/benchmarks.md)

    return str(resources.files("oomdoctor").joinpath("data", DEMO_SNAPSHOT))


def inputs_or_demo(paths: tuple[str, ...], demo: bool, command: str) -> list[str]:
    inputs = list(paths)
    if demo:
        inputs.append(demo_path())
    if not inputs:
        raise UsageError(f"no snapshot given: oomdoctor {command} PATH... (files or directories), or --demo")
    return inputs


FAIL_ON_HELP = ("A CI gate: exit 1 when a finding at or above this severity is found, or (unhealthy) when the "
                "verdict is anything but healthy (a HIGH finding under a healthy verdict passes it: add --fail-on "
                "high, the option repeats). A rank file that could not be read fails every level. The report is "
                "written first.")


@click.command("diagnose")
@click.argument("paths", nargs=-1, type=click.Path(path_type=str))
@click.option("--format", "fmt", type=click.Choice(formats("diagnose")), default="text", show_default=True,
              help="Output format (html: the self-contained page of `oomdoctor report`).")
@click.option("-o", "--output", type=OUTPUT,
              help="Write the report to this file instead of standard output.")
@click.option("--demo", is_flag=True, help=f"Diagnose a real snapshot shipped with oomdoctor ({DEMO_SNAPSHOT}).")
@click.option("--micro-batch", type=click.IntRange(min=1), default=None,
              help="The per-device micro-batch of the recorded run: say the largest that fits (replayed).")
@click.option("--gpu-memory", default=None,
              help="The GPU's total memory (bytes, or with a unit: 80GiB), for a snapshot that does not say it "
                   "(recorded without oomdoctor run, and no OOM): what fits is then replayed in it.")
@click.option("--material-fraction", type=click.FloatRange(min=0, max=1), default=DEFAULT_FRACTION, show_default=True,
              help="Findings under this fraction of peak reserved (and under --material-bytes) are shown as LOW.")
@click.option("--material-bytes", default="64MiB", show_default=True,
              help="Floor of the materiality threshold (bytes, or with a unit: 64MiB, 1GiB).")
@click.option("--fail-on", type=click.Choice(LEVELS), multiple=True, help=FAIL_ON_HELP)
@click.option("--all-ranks", is_flag=True,
              help="Text: every rank's section and every finding in full, however many ranks (above "
                   f"{GROUPED_RANKS} ranks, alike ranks are grouped by default).")
@parallel_options
def command(paths: tuple[str, ...], fmt: str, output: str | None, demo: bool, micro_batch: int | None,
            gpu_memory: str | None, material_fraction: float, material_bytes: str, fail_on: tuple[str, ...], all_ranks: bool, jobs: int | None,
            executor: str, scheduler: str | None) -> int:
    """Diagnose snapshot files or directories (one file per rank) of a failing or bloated run."""
    rule = Materiality(material_fraction, parse_bytes(material_bytes))
    gpu_bytes = parse_bytes(gpu_memory) if gpu_memory is not None else None
    inputs = inputs_or_demo(paths, demo, "diagnose")
    from .main import keep_decoded_when_exiting

    keep_decoded_when_exiting()
    visual = None
    if fmt == "html":  # the page's views too (jinja2 and the views: only for --format html)
        from .page import job_page

        report, visual = job_page(inputs, micro_batch=micro_batch, rule=rule, jobs=jobs, executor=executor,
                                  scheduler=scheduler, gpu_memory_bytes=gpu_bytes)
    else:
        skipped: list = []
        results = read_job(inputs, lambda n: Want(micro_batch, rule, gpu_memory_bytes=gpu_bytes), jobs=jobs,
                           executor=executor, scheduler=scheduler, skipped=skipped)
        report = job_report(results, skipped)
    emit(output, "diagnose", fmt, report, visual=visual, all_ranks=all_ranks)
    return fail_on_exit(report, fail_on)


def fail_on_exit(report, levels: tuple[str, ...]) -> int:
    """0, or 1 with one line on standard error when ``report`` fails the ``--fail-on`` gate at ``levels``; where
    ``unhealthy`` passes a HIGH finding, one line says so and names the level that fails on it."""
    if not levels:
        return 0
    g = gate(report, levels)
    asked = " ".join(f"--fail-on {lvl}" for lvl in levels)
    line = gate_line(asked, g)
    if line:
        click.echo(line, err=True)
    return 1 if g.failed else 0
