"""Short real runs of a command for ``oomdoctor fit`` and ``oomdoctor verify``: each with ``oomdoctor run``'s
injection (:func:`oomdoctor.cli.run.child_env`), stopped by the job itself after K optimizer steps
(:func:`oomdoctor.capture.autorecord.install_stop`), its output in a log file, its outcome read from the exit
code and PyTorch's out-of-memory message (:func:`oomdoctor.report.loop.is_oom_output`)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import time

import click

from ..capture.autorecord import STOP_LINE
from ..capture.files import ensure_writable
from ..capture.recorder import DEFAULT_MAX_ENTRIES
from ..errors import UsageError
from ..report.loop import Trial, is_oom_output
from .run import CommandNotRunnable, child_env

_STOP_MARK = STOP_LINE.split("{steps}")[0]


def command_argv(command: tuple[str, ...]) -> list[str]:
    """The command after ``--``; a usage error when it is missing or cannot be found."""
    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UsageError("no command given: put it after --")
    if shutil.which(argv[0]) is None:
        raise CommandNotRunnable(f"{argv[0]}: command not found", 127)
    return argv


def measured_peak(out_dir: str) -> int | None:
    """The most reserved on any rank of a run: ``memory_stats`` ``reserved_bytes.all.peak`` over the sidecars the
    recorder wrote in ``out_dir`` (every dump of a rank: the peak only grows). None without one."""
    best = None
    for p in glob.glob(os.path.join(out_dir, "*.meta.json")):
        try:
            with open(p, encoding="utf-8") as f:
                stats = json.load(f).get("memory_stats") or {}
        except (OSError, ValueError, AttributeError):
            continue
        v = stats.get("reserved_bytes.all.peak")
        if isinstance(v, int) and (best is None or v > best):
            best = v
    return best


def run_trial(argv: list[str], out_dir: str, *, steps: int, record: bool, env: dict[str, str] | None = None,
              micro_batch: int | None = None, timeout_s: float | None = None, max_entries: int = DEFAULT_MAX_ENTRIES,
              label: str = "") -> Trial:
    """Run ``argv`` once (``env``: its environment before the injection, default ``os.environ``), the snapshots
    (when ``record``) in ``out_dir``, its output in ``out_dir + ".log"``; one progress line on stderr."""
    out_dir = ensure_writable(out_dir)
    log = out_dir + ".log"
    child = child_env(out_dir, None, max_entries, "python", False, 0.0, base=env, stop_after_steps=steps, record=record)
    t0 = time.monotonic()
    timed_out = False
    with open(log, "wb") as f:
        try:
            proc = subprocess.Popen(argv, env=child, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        except FileNotFoundError:
            raise CommandNotRunnable(f"{argv[0]}: command not found", 127) from None
        except PermissionError:
            raise CommandNotRunnable(f"{argv[0]}: permission denied", 126) from None
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            code = _kill_group(proc)
        except KeyboardInterrupt:
            _kill_group(proc)
            raise
    seconds = time.monotonic() - t0
    with open(log, encoding="utf-8", errors="replace") as f:
        text = f.read()
    oom = code != 0 and (is_oom_output(text) or bool(glob.glob(os.path.join(out_dir, "*_oom.pickle"))))
    outcome = "oom" if oom else "ran" if code == 0 else "failed"
    trial = Trial(micro_batch=micro_batch, outcome=outcome, seconds=round(seconds, 2), exit_code=code,
                  recorded=record, stopped=_STOP_MARK in text, timed_out=timed_out,
                  measured_peak_reserved_bytes=measured_peak(out_dir), log=log)
    what = f"micro-batch {micro_batch}" if micro_batch is not None else label
    why = " (timed out)" if timed_out else f" (exit code {code}; output in {log})" if outcome == "failed" else ""
    click.echo(f"oomdoctor: {what}: {outcome}{why} in {seconds:.1f} s", err=True)
    return trial


def _kill_group(proc: subprocess.Popen) -> int:
    """SIGTERM the trial's process group (``torchrun`` and its workers), SIGKILL after 10 s; the exit code."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()
