"""``oomdoctor run [options] -- COMMAND...``: record every CUDA process of a command, then diagnose.

The command runs unchanged, with ``PYTHONPATH`` led by the directory of our ``sitecustomize``
(``cli/inject/``, which sets up :mod:`oomdoctor.capture.autorecord`), so every Python process it starts (``torchrun``'s workers,
scripts a shell script calls) records once it initialises CUDA. Processes started with ``python -I``
or ``-S`` ignore ``PYTHONPATH``/``site`` and are not recorded. The exit code is the command's; a
command killed by a signal makes ``oomdoctor`` die of the same signal (after the report).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from importlib import resources

import click

from ..capture.files import ensure_writable
from ..capture.recorder import (
    DEFAULT_MAX_ENTRIES,
    DEFAULT_STACK_STEPS,
    STACKS,
    parse_stack_steps,
    parse_steps,
)
from ..errors import OomdoctorError, UsageError
from ..jobsummary import SUMMARY_JSON, SUMMARY_TEXT
from ..report import build_report
from ..trace.load import discover
from .inputs import load_with_progress
from .output import emit


class CommandNotRunnable(OomdoctorError):
    """The command cannot be started (exit codes as in a POSIX shell)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def inject_dir() -> str:
    return str(resources.files("oomdoctor.cli").joinpath("inject"))


def child_env(out: str, steps: str | None, max_entries: int, stacks: str, summarize: bool,
              timeout_s: float, base: dict[str, str] | None = None, free_stacks: bool = False,
              stop_after_steps: int | None = None, record: bool = True,
              stack_steps: str = DEFAULT_STACK_STEPS, exits: str | None = None) -> dict[str, str]:
    """The command's environment: ``base`` (default ``os.environ``) plus the injection. ``stop_after_steps``:
    each process ends itself with exit code 0 after that many optimizer steps
    (:func:`oomdoctor.capture.autorecord.install_stop`), and writes how it ended in ``exits``
    (:mod:`oomdoctor.capture.exits`); ``record=False``: nothing is recorded."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (inject_dir(), env.get("PYTHONPATH", "")) if p)
    env["OOMDOCTOR_PACKAGE_ROOT"] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["OOMDOCTOR_RUN_CONFIG"] = json.dumps({"out": out, "steps": steps, "max_entries": max_entries,
                                              "stacks": stacks, "stack_steps": stack_steps, "free_stacks": free_stacks,
                                              "summarize": summarize,
                                              "summary_timeout_s": timeout_s, "print_summary": False,
                                              **({"stop_after_steps": stop_after_steps} if stop_after_steps else {}),
                                              **({"exits": exits} if exits and stop_after_steps else {}),
                                              **({} if record else {"record": False})})
    return env


@click.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--out", "out", type=click.Path(path_type=str, readable=False), default=None,
              help="Directory for the snapshots, created if missing (a link to a directory is followed) "
                   "[default: ./oomdoctor-run-<time>].")
@click.option("--steps", default=None, help="Record only steps A..B (from 0, both included), e.g. 2:4.")
@click.option("--max-entries", type=click.IntRange(min=1), default=DEFAULT_MAX_ENTRIES, show_default=True,
              help="Events kept in the allocator's history ring buffer, per process.")
@click.option("--stacks", type=click.Choice(STACKS), default="python", show_default=True,
              help="Stack frames to record at each allocation: Python only, with C++ frames (slower), or none "
              "(every event, no stacks: the lowest overhead, but allocation sites cannot be named).")
@click.option("--stack-steps", default=DEFAULT_STACK_STEPS, show_default=True,
              help="Steps that gather stacks: 'all', or 'K/N': the first K steps (the set-up is in step 0), then "
              "every N-th step; the others record every event without a stack (cheaper), and the report names "
              "their sites by matching them against a stacked step.")
@click.option("--free-stacks", is_flag=True, help="Also record a stack at every free (context='all'). Off by "
              "default: on torch 2.11 it crashes non-reentrant activation checkpointing in backward (SystemError: ... returned NULL without setting an exception).")
@click.option("--summarize", is_flag=True, help="Analyse in the job: each rank its own snapshot, rank 0 writes "
              "summary.json; the report printed is that summary.")
@click.option("--summary-timeout", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="Seconds rank 0 waits for the other ranks' summaries.")
@click.option("--no-diagnose", is_flag=True, help="Only record; print no report.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def command(out: str | None, steps: str | None, max_entries: int, stacks: str, stack_steps: str, free_stacks: bool,
            summarize: bool, summary_timeout: float, no_diagnose: bool, fmt: str, command: tuple[str, ...]) -> None:
    """Run COMMAND with CUDA memory recording in every process that uses CUDA, then diagnose.

    Example: oomdoctor run --out mem -- torchrun --nproc_per_node=8 train.py
    """
    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UsageError("no command given: oomdoctor run [OPTIONS] -- COMMAND...")
    parse_steps(steps)
    parse_stack_steps(stack_steps)
    if shutil.which(argv[0]) is None:
        raise CommandNotRunnable(f"{argv[0]}: command not found", 127)
    if out == "-":
        raise UsageError("--out -: run writes a directory of snapshots, which standard output cannot hold; "
                         "give a directory")
    out = out or f"oomdoctor-run-{time.strftime('%Y%m%d-%H%M%S')}"
    made = not os.path.lexists(out)  # created for this run: removed again if nothing is written in it
    out = ensure_writable(out)
    env = child_env(out, steps, max_entries, stacks, summarize, summary_timeout, free_stacks=free_stacks,
                    stack_steps=stack_steps)
    code = _run(argv, env)
    try:
        files = discover([out])
    except OomdoctorError:
        files = []
    where = f"snapshots in {out}" if files else \
        f"no snapshot was written (no process of the command used CUDA){remove_if_empty(out, made)}"
    click.echo(f"oomdoctor: command exited with {_describe(code)}; {where}", err=True)
    if not no_diagnose and files:
        _report(out, files, summarize, fmt)
    if code < 0:  # killed by a signal: die of it too
        sys.stdout.flush()
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    raise click.exceptions.Exit(code if code >= 0 else 128 - code)


def remove_if_empty(path: str, made: bool) -> str:
    """Remove the directory ``path`` when this run ``made`` it and it is empty (a directory the user had stays);
    the words to add after "no snapshot was written": where, or that nothing was left behind."""
    if made:
        try:
            os.rmdir(path)  # only an empty directory: never what a process of the command wrote there
            return f"; {path}, made for the run, is removed"
        except OSError:
            pass
    return f" in {path}"


def _run(argv: list[str], env: dict[str, str]) -> int:
    try:
        proc = subprocess.Popen(argv, env=env)
    except FileNotFoundError:
        raise CommandNotRunnable(f"{argv[0]}: command not found", 127) from None
    except PermissionError:
        raise CommandNotRunnable(f"{argv[0]}: permission denied", 126) from None
    previous = {}

    def forward(signum: int, frame: object) -> None:
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    for s in _FORWARDED:
        previous[s] = signal.signal(s, forward)
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # pragma: no cover - SIGINT is forwarded, keep waiting
                continue
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _report(out: str, files: list[str], summarize: bool, fmt: str) -> None:
    if summarize:
        path = os.path.join(out, SUMMARY_JSON if fmt == "json" else SUMMARY_TEXT)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                click.echo(f.read(), nl=False)
            return
        click.echo(f"oomdoctor: no in-job summary in {out} (rank 0 did not finish it): diagnosing the snapshots",
                   err=True)
    try:
        report = build_report(load_with_progress(files))
    except OomdoctorError as e:
        click.echo(f"oomdoctor: error: {e}", err=True)
        return
    emit("-", "diagnose", fmt, report)  # the bytes diagnose -o writes (plain text at 120 columns, or JSON)
