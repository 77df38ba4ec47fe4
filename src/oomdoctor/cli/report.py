"""``oomdoctor report PATH... -o report.html``: the self-contained HTML report."""

from __future__ import annotations

import click

from ..report.gate import LEVELS
from .diagnose import DEMO_SNAPSHOT, FAIL_ON_HELP, fail_on_exit, inputs_or_demo
from .inputs import parallel_options
from .output import OUTPUT, emit
from .page import job_page

DEFAULT_OUTPUT = "oomdoctor-report.html"


@click.command("report")
@click.argument("paths", nargs=-1, type=click.Path(path_type=str))
@click.option("-o", "--output", type=OUTPUT,
              default=DEFAULT_OUTPUT, show_default=True, help="The HTML file to write (- for standard output).")
@click.option("--demo", is_flag=True, help=f"Report on the snapshot shipped with oomdoctor ({DEMO_SNAPSHOT}).")
@click.option("--fail-on", type=click.Choice(LEVELS), multiple=True, help=FAIL_ON_HELP)
@parallel_options
def command(paths: tuple[str, ...], output: str, demo: bool, fail_on: tuple[str, ...], jobs: int | None, executor: str,
            scheduler: str | None) -> int:
    """Write one HTML page that opens offline: timelines, fragmentation, segment maps, sites, findings,
    and the ranks side by side (above 8 ranks: the odd ranks and one of each group, and a ranks x time heatmap
    of allocated memory)."""
    report, visual = job_page(inputs_or_demo(paths, demo, "report"), jobs=jobs, executor=executor,
                              scheduler=scheduler)
    size = emit(output, "report", "html", report, visual=visual).size
    click.echo(f"wrote {'standard output' if output == '-' else output} ({size / 2**20:.1f} MiB)", err=True)
    return fail_on_exit(report, fail_on)
