"""Where a recording goes and how it is written: file names, atomic writes, the writable check.

Pure Python (no torch), so the rules are tested on any machine.

Names, per rank ``R`` (``rank_from_name`` in :mod:`oomdoctor.trace.load` reads them back)::

    rank{R}.pickle            the whole run, dumped when recording stops (or the process exits)
    rank{R}_step{S}.pickle    a step window, dumped at the end of its last step S
    rank{R}_oom.pickle        dumped by the out-of-memory observer at the failure
    <stem>.meta.json          the sidecar of each of them (rank, versions, GPU, env, memory_stats, steps)
    summary.json              the in-job summary written by rank 0 (diagnose's JSON schema)

A write goes to a hidden temporary file in the same directory, is flushed to disk, then renamed over
the final name (``os.replace`` is atomic on POSIX): a job killed mid-dump leaves either the previous
file or none, never half of one. Temporary names start with ``.`` so readers skip them.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from typing import Any

from ..errors import OomdoctorError


class CaptureError(OomdoctorError):
    """The recording cannot start (output directory missing and not creatable, or not writable)."""

    exit_code = 2


def snapshot_name(rank: int, *, step: int | None = None, oom: bool = False) -> str:
    """``rank3.pickle``, ``rank3_step20.pickle`` or ``rank3_oom.pickle``."""
    if oom:
        return f"rank{rank}_oom.pickle"
    if step is not None:
        return f"rank{rank}_step{step}.pickle"
    return f"rank{rank}.pickle"


def sidecar_name(snapshot: str) -> str:
    """``rank3_oom.pickle`` -> ``rank3_oom.meta.json`` (what ``trace.load.sidecar_path`` looks for)."""
    base = os.path.basename(snapshot)
    stem = base[: -len(".pickle")] if base.endswith(".pickle") else base
    return stem + ".meta.json"


def sidecar_for(snapshot_path: str) -> str:
    """The sidecar path beside ``snapshot_path``: ``out/rank3_oom.pickle`` -> ``out/rank3_oom.meta.json``."""
    return os.path.join(os.path.dirname(snapshot_path), sidecar_name(snapshot_path))


def ensure_writable(out_dir: str) -> str:
    """Create ``out_dir`` if needed and prove a file can be created in it; return its absolute path.

    Raises:
        CaptureError: naming the directory and the operating system's reason.
    """
    path = os.path.abspath(out_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CaptureError(f"{path}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CaptureError(f"{path}: cannot create the output directory ({e.strerror or e})") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".oomdoctor-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CaptureError(f"{path}: the output directory is not writable ({e.strerror or e})") from None
    return path


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename.

    Raises:
        OSError: the write failed (disk full, permissions); the temporary file is removed and any
            previous ``path`` is left untouched.
    """
    d = os.path.dirname(os.path.abspath(path))
    # os.open with 0o666 honours the umask like open() does (mkstemp would force 0o600)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_json(path: str, obj: Any) -> None:
    """:func:`atomic_write_bytes` of ``obj`` as indented JSON (sorted keys are not forced)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, default=_json_default) + "\n").encode("utf-8"))


def _json_default(o: Any) -> Any:
    if isinstance(o, (tuple, set, frozenset)):
        return list(o)
    if hasattr(o, "item"):
        return o.item()
    return str(o)
