"""The ``oomdoctor`` command. ``main(argv) -> int`` is the only place errors become exit codes."""

from __future__ import annotations

import sys

import click

from ..errors import OomdoctorError
from . import diagnose, diff, export, plan, report, run, simulate
from . import slice as slice_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="oomdoctor", prog_name="oomdoctor")
def cli() -> None:
    """Find, explain and fix GPU memory problems from PyTorch CUDA memory snapshots."""


cli.add_command(diagnose.command)
cli.add_command(simulate.command)
cli.add_command(run.command)
cli.add_command(report.command)
cli.add_command(diff.command)
cli.add_command(slice_cmd.command)
cli.add_command(export.command)
cli.add_command(plan.command)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the exit code (0 ok, 1 internal/usage problems, 2 bad input)."""
    try:
        rv = cli.main(args=argv, prog_name="oomdoctor", standalone_mode=False)
    except OomdoctorError as e:
        click.echo(f"oomdoctor: error: {e}", err=True)
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return 2 if isinstance(e, click.UsageError) else e.exit_code
    except click.exceptions.Abort:
        click.echo("oomdoctor: aborted", err=True)
        return 130
    except BrokenPipeError:
        return 0
    return rv if isinstance(rv, int) else 0


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
