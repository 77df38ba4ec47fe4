"""``oomdoctor schema COMMAND``: the JSON Schema of a command's ``--format json`` output."""

from __future__ import annotations

import click

from ..render.schema import COMMANDS
from .output import OUTPUT, emit


@click.command("schema")
@click.argument("command", nargs=-1, required=True)
@click.option("-o", "--output", type=OUTPUT,
              help="Write to this file instead of standard output.")
def command(command: tuple[str, ...], output: str | None) -> None:
    """Print the JSON Schema (draft 2020-12) of COMMAND's --format json output: diagnose (also run and the
    in-job summary.json), diff, simulate, plan estimate, plan search, plan validate, fit, verify, preflight, tune."""
    name = " ".join(command)
    if name == "run":  # run --format json prints diagnose's report of the snapshots (or the in-job summary.json)
        name = "diagnose"
    if name not in COMMANDS:
        raise click.BadParameter(f"{name!r} has no JSON output; one of: {', '.join(COMMANDS)}, run",
                                 param_hint="COMMAND")
    emit(output, "schema", "json", name)
