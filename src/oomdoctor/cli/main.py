"""The ``oomdoctor`` command. ``main(argv) -> int`` is the only place errors become exit codes."""

from __future__ import annotations

import importlib
import os
import sys

import click

from ..errors import OomdoctorError
from .pipes import WatchedStdout, silence_stdout

#: name -> (module, one-line help). The module is imported only when its command runs (or its own
#: ``--help`` is asked for), so ``oomdoctor --help`` and every command import only what they use.
COMMANDS = {
    "diagnose": ("diagnose", "Diagnose snapshot files or directories (one file per rank) of a failing or bloated "
                             "run."),
    "simulate": ("simulate", "Replay SNAPSHOT under its recorded allocator settings (checked against the "
                             "recording) and under the settings given."),
    "run": ("run", "Run COMMAND with CUDA memory recording in every process that uses CUDA, then diagnose."),
    "report": ("report", "Write one HTML page that opens offline: timelines, fragmentation, segment maps, sites, "
                         "findings."),
    "diff": ("diff", "Compare two runs (snapshot files, or directories with one file per rank)."),
    "slice": ("slice", "Cut a window out of a snapshot: a valid smaller snapshot."),
    "export": ("export", "Export per-rank counter tracks for Perfetto, or one rank's live memory at a moment as "
                         "folded stacks."),
    "plan": ("plan", "Predict per-rank peak memory of a training configuration, and search the parallel plans "
                     "that fit."),
    "fit": ("fit", "Find the largest micro-batch that runs, with short real runs guided by the replay of a recorded "
                   "one."),
    "verify": ("verify", "Rerun COMMAND with each proposed setting and confirm or refute the prediction for it."),
    "preflight": ("preflight", "Trace a training step on the CPU under fake tensors and predict its GPU memory: "
                               "peaks, OOM, the largest micro-batch."),
    "tune": ("tune", "Find the fastest configuration that fits: preflight's traces on the CPU, a cost model, and "
                     "short real runs of the best on a GPU."),
    "schema": ("schema", "Print the JSON Schema of a command's --format json output."),
}


class LazyGroup(click.Group):
    """A group whose subcommands live in :data:`COMMANDS` and are imported on first use (the pattern of
    click's documentation, "Lazily Loading Subcommands"); the group's help lists them from there."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module = importlib.import_module(f"{__package__}.{COMMANDS[cmd_name][0]}")
        return module.command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_) for name, (_module, help_) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="oomdoctor", prog_name="oomdoctor")
def cli() -> None:
    """Find, explain and fix GPU memory problems from PyTorch CUDA memory snapshots."""


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the exit code (0 ok, 1 internal/usage problems, 2 bad input)."""
    watched = WatchedStdout(sys.stdout)
    sys.stdout = watched
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
    except BrokenPipeError:  # the reader of the pipe went away (| head): done, as a Unix filter is
        silence_stdout()
        return 0
    except SystemExit:  # click ends with exit code 1 on EPIPE (while printing help, say)
        if watched.broken:
            silence_stdout()
            return 0
        raise
    finally:
        sys.stdout = watched._stream
    return rv if isinstance(rv, int) else 0


#: Commands that read files and run no user code and no torch: they multiply no matrices, so NumPy's BLAS gets one
#: thread. OpenBLAS starts a pool of threads at ``import numpy``, one per CPU, and each polls for work before it
#: sleeps: 58 ms of CPU and 64 ms of wall on `import numpy` alone on a 2-CPU machine (median of 10), and on a
#: 16-CPU machine the CPU seconds of ``diagnose`` were 2.5x its wall time (docs/benchmarks.md). ``run``, ``verify``,
#: ``fit`` and ``preflight`` start the user's job or torch, which must see the user's environment as it is.
ONE_BLAS_THREAD = frozenset({"diagnose", "simulate", "report", "diff", "slice", "export", "schema"})
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def one_blas_thread(argv: list[str], environ: dict | os._Environ = os.environ) -> None:
    """Set each of :data:`BLAS_THREADS` the user has not set to 1 in ``environ`` when ``argv``'s command is one of
    :data:`ONE_BLAS_THREAD`; before NumPy is imported (OpenBLAS reads them when it loads)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in ONE_BLAS_THREAD:
        for name in BLAS_THREADS:
            environ.setdefault(name, "1")


def exits_at_once(argv: list[str]) -> bool:
    """Whether ``argv``'s command is one that :func:`exit_now` ends at once (:data:`ONE_BLAS_THREAD`)."""
    return next((a for a in argv if not a.startswith("-")), None) in ONE_BLAS_THREAD


#: Set by :func:`entry` when its command ends with :func:`exit_now`: a command may then leave what it built to
#: the process's end (:func:`oomdoctor.trace.load.keep_decoded`). False when :func:`main` is called otherwise.
EXITS_AT_ONCE = False


def keep_decoded_when_exiting() -> None:
    """When this process ends with :func:`exit_now` (:data:`EXITS_AT_ONCE`), have :func:`oomdoctor.trace.load.load`
    keep the decoded snapshot instead of freeing it (:func:`~oomdoctor.trace.load.keep_decoded`): the process never
    pays for freeing it. Does nothing when :func:`main` is called otherwise (as a library)."""
    if EXITS_AT_ONCE:
        from ..trace.load import keep_decoded

        keep_decoded()


def exit_now(argv: list[str], code: int) -> None:
    """End the process at once (``os._exit``) after a command of :data:`ONE_BLAS_THREAD` when nothing is left to do:
    the ``atexit`` handlers run, standard output and error are flushed, and no other thread runs. The
    interpreter's own exit would then only free what the command built (a trace of ``large``: millions of objects,
    about 0.03-0.1 s of a diagnosis, docs/benchmarks.md) and write nothing more: every output file is written
    and closed before the command returns (:func:`oomdoctor.cli.output.write_bytes`). Returns, leaving the
    ordinary exit to ``sys.exit``, where a flush fails (a closed pipe: the interpreter's exit handles it as before)
    or another thread is alive."""
    import atexit
    import threading

    if not exits_at_once(argv) or threading.active_count() != 1:
        return
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(code)


def entry() -> None:
    """Console-script entry point."""
    global EXITS_AT_ONCE
    one_blas_thread(sys.argv[1:])
    EXITS_AT_ONCE = exits_at_once(sys.argv[1:])
    code = main()
    exit_now(sys.argv[1:], code)
    sys.exit(code)
