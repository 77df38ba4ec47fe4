"""Short real runs of a command for ``oomdoctor fit`` and ``oomdoctor verify``: each with ``oomdoctor run``'s
injection (:func:`oomdoctor.cli.run.child_env`), stopped by the job itself after K optimizer steps
(:func:`oomdoctor.capture.autorecord.install_stop`), its output in a log file. Its outcome
(:func:`oomdoctor.report.loop.trial_outcome`) is read from what PyTorch says first: the exit records each process
wrote (:mod:`oomdoctor.capture.exits`: the stop fired, ``memory_stats()["num_ooms"]``) and the recorder's OOM
dump; then from the exit code and PyTorch's out-of-memory message (:func:`oomdoctor.report.loop.is_oom_output`).

Both commands refuse to start without a visible CUDA device (:func:`require_gpu`): their trials would never run
out of GPU memory."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import click

from ..capture.exits import clear_exit_records, read_exit_records
from ..capture.files import ensure_writable
from ..capture.recorder import DEFAULT_MAX_ENTRIES
from ..errors import UsageError
from ..report.loop import Trial, is_oom_output, trial_outcome
from .run import CommandNotRunnable, child_env

_COUNT = "import torch; print(torch.cuda.device_count())"


def visible_cuda_devices(env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """How many CUDA devices a job started with ``env`` (default ``os.environ``) would see, and how that was read:
    ``torch.cuda.device_count()`` in a fresh interpreter (it honours ``CUDA_VISIBLE_DEVICES``; this process keeps
    no CUDA state and no torch), else ``nvidia-smi -L`` (its GPU lines), else (None, why)."""
    env = dict(os.environ if env is None else env)
    try:
        p = subprocess.run([sys.executable, "-c", _COUNT], env=env, capture_output=True, text=True, timeout=300)
        if p.returncode == 0 and p.stdout.strip():
            return int(p.stdout.split()[-1]), "torch.cuda.device_count()"
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    if shutil.which("nvidia-smi", path=env.get("PATH")):
        try:
            p = subprocess.run(["nvidia-smi", "-L"], env=env, capture_output=True, text=True, timeout=60)
            if p.returncode == 0:
                n = sum(1 for line in p.stdout.splitlines() if line.startswith("GPU "))
                if env.get("CUDA_VISIBLE_DEVICES") is not None:
                    n = min(n, len([d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip() not in ("", "-1")]))
                return n, "nvidia-smi -L"
        except (OSError, subprocess.SubprocessError):
            pass
    return None, "neither torch nor nvidia-smi answered"


def require_gpu(command: str, allow_no_gpu: bool) -> None:
    """Refuse ``command`` (``fit``, ``verify``) at once when no CUDA device is visible, unless ``allow_no_gpu``.

    Raises:
        UsageError: one line (exit code 2), naming how the devices were counted and the way out.
    """
    if allow_no_gpu:
        return
    n, how = visible_cuda_devices()
    if n:
        return
    seen = f"{how} is 0" if n == 0 else how
    raise UsageError(f"{command}: no CUDA device is visible ({seen}): its trials could never run out of GPU memory, "
                     f"so their outcome would say nothing of the GPU; run it where the job's GPUs are, or pass "
                     f"--allow-no-gpu to run the trials anyway")


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


def measured_peak(out_dir: str, exits_dir: str | None = None, since: float | None = None) -> int | None:
    """The most reserved on any rank of a run (bytes): per rank, the highest ``memory_stats``
    ``reserved_bytes.all.peak`` of the recorder's sidecars in ``out_dir`` (every dump of a rank: the peak only
    grows) and of the exit records in ``exits_dir``; then the highest over ranks, the tightest rank, as the claim
    it is compared with (:func:`oomdoctor.report.loop.predict`). ``since``: sidecars written before this time
    (``time.time()``; a directory used before) are left out. None without any."""
    per_rank: dict[int, int] = {}

    def note(rank: object, stats: object) -> None:
        v = stats.get("reserved_bytes.all.peak") if isinstance(stats, dict) else None
        if isinstance(v, int) and not isinstance(v, bool):
            r = rank if isinstance(rank, int) else -1
            per_rank[r] = max(per_rank.get(r, v), v)

    for p in glob.glob(os.path.join(out_dir, "*.meta.json")):
        if since is not None and _mtime(p) < since:
            continue
        try:
            with open(p, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict):
            note(meta.get("rank", _rank_of(p)), meta.get("memory_stats"))
    for rec in read_exit_records(exits_dir) if exits_dir else []:
        note(rec.get("rank"), rec.get("memory_stats"))
    return max(per_rank.values()) if per_rank else None


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return float("-inf")


def _rank_of(path: str) -> int | None:
    """``rank3_oom.meta.json`` -> 3 (a sidecar that does not say its rank)."""
    name = os.path.basename(path)
    digits = name[4:].split("_")[0].split(".")[0] if name.startswith("rank") else ""
    return int(digits) if digits.isdigit() else None


def run_trial(argv: list[str], out_dir: str, *, steps: int, record: bool, env: dict[str, str] | None = None,
              micro_batch: int | None = None, timeout_s: float | None = None, max_entries: int = DEFAULT_MAX_ENTRIES,
              label: str = "") -> Trial:
    """Run ``argv`` once (``env``: its environment before the injection, default ``os.environ``), the snapshots
    (when ``record``) in ``out_dir``, the exit records in ``out_dir + ".exits"``, its output in ``out_dir +
    ".log"``; one progress line on stderr. Records and dumps a previous run left there are not read."""
    out_dir = ensure_writable(out_dir)
    exits = ensure_writable(out_dir + ".exits")
    clear_exit_records(exits)
    log = out_dir + ".log"
    child = child_env(out_dir, None, max_entries, "python", False, 0.0, base=env, stop_after_steps=steps, record=record,
                      exits=exits)
    started = time.time() - 1.0  # file times can be a little behind the clock (coarse timestamps)
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
    records = read_exit_records(exits)
    dump = any(_mtime(p) >= started for p in glob.glob(os.path.join(out_dir, "*_oom.pickle")))
    outcome, evidence = trial_outcome(records, code, oom_dump=dump, oom_message=is_oom_output(text))
    trial = Trial(micro_batch=micro_batch, outcome=outcome, evidence=evidence, seconds=round(seconds, 2),
                  exit_code=code, recorded=record, stopped=any(r.get("stopped") is True for r in records),
                  timed_out=timed_out, measured_peak_reserved_bytes=measured_peak(out_dir, exits, since=started),
                  log=log)
    what = f"micro-batch {micro_batch}" if micro_batch is not None else label
    why = " (timed out)" if timed_out else f" (exit code {code}; output in {log})" if outcome == "failed" else \
        f" (exit code 0 before {steps} optimizer steps; output in {log})" if outcome == "ended-early" else ""
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
