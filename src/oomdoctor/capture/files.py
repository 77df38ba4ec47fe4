"""Where a recording goes and how it is written: file names, atomic writes, the writable check.

Pure Python (no torch), so the rules are tested on any machine.

Names, per rank ``R`` (``rank_from_name`` in :mod:`oomdoctor.trace.load` reads them back)::

    rank{R}.pickle            the whole run, dumped when recording stops (or the process exits)
    rank{R}_step{S}.pickle    a step window, dumped at the end of its last step S
    rank{R}_oom.pickle        dumped by the out-of-memory observer at the failure (a later OOM with no step
                              after it: dumped over it when recording stops)
    <stem>.meta.json          the sidecar of each of them (rank, versions, GPU, env, memory_stats, steps)
    summary.json              the in-job summary written by rank 0 (diagnose's JSON schema)

A write goes to a hidden temporary file in the same directory, is flushed to disk, then renamed over
the final name (``os.replace`` is atomic on POSIX): a job killed mid-dump leaves either the previous
file or none, never half of one. Temporary names start with ``.`` so readers skip them.

Only a regular file (or a new name) is written that way: :func:`write_target` follows a symbolic link to
its target, and writes a character device, a FIFO or a descriptor (``/dev/null``, ``/dev/stdout``,
``>(gzip > x.gz)``) in place as a stream; a rename there would replace the device or the link with a file.
The recorder, the in-job summary and every ``-o`` of the CLI (:mod:`oomdoctor.cli.output`) write through it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
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
    """Create ``out_dir`` if needed and prove a file can be created in it; return its absolute path. A
    symbolic link is followed (its target directory is created if missing) and stays a link; a file, a
    device or a FIFO is refused.

    Raises:
        CaptureError: naming the directory and the operating system's reason.
    """
    path = os.path.abspath(out_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CaptureError(f"{path}: exists and is not a directory")
    try:
        os.makedirs(os.path.realpath(path), exist_ok=True)  # a link to a directory is followed, even a dangling one
    except OSError as e:
        raise CaptureError(f"{path}: cannot create the output directory ({e.strerror or e})") from None
    try:
        import tempfile  # only here: a healthy diagnosis never writes, and tempfile pulls in bz2 and lzma (start-up)

        fd, probe = tempfile.mkstemp(prefix=".oomdoctor-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CaptureError(f"{path}: the output directory is not writable ({e.strerror or e})") from None
    return path


#: what :func:`write_target` wrote to: a regular file replaced atomically, or a stream written in place
FILE, STREAM = "file", "stream"

_FD_DIR = re.compile(r"^/proc/(\d+)(?:/task/\d+)?/fd$")
_MAX_NAME = 200  # the temporary name adds ~30 characters to the base name; NAME_MAX is 255


class OutputError(OomdoctorError):
    """An output path that cannot be written: a directory, a missing directory, no permission."""

    exit_code = 2


def resolve_target(path: str) -> tuple[str, int | None]:
    """Follow the symbolic links of ``path`` one by one: ``(final path, None)``, or ``(path, fd)`` when the
    chain reaches one of this process's descriptors (``/dev/stdout`` -> ``/proc/self/fd/1``, ``/dev/fd/63``
    of ``>(gzip > x.gz)``): what the descriptor points at is written through it (shared offset, as the
    shell opened it), never looked up by name. A descriptor of another process comes back as ``(path,
    -1)``: opened by that name, as a stream.

    Raises:
        OSError: ``ELOOP`` for a loop of links.
    """
    p = os.path.abspath(path)
    for _ in range(40):  # Linux's MAXSYMLINKS
        parent = os.path.realpath(os.path.dirname(p))
        p = os.path.join(parent, os.path.basename(p))
        m = _FD_DIR.match(parent)
        if m:
            name = os.path.basename(p)
            if m.group(1) == str(os.getpid()) and name.isdigit():
                return p, int(name)
            return p, -1
        if not os.path.islink(p):
            return p, None
        p = os.path.join(parent, os.readlink(p))
    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)


def target_kind(path: str) -> str:
    """:data:`FILE` when ``path`` (its links followed) is a regular file or a new name, else
    :data:`STREAM` (a character device, a FIFO, a socket, a descriptor such as ``/dev/stdout``).

    Raises:
        OutputError: ``path`` is (or points at) a directory, or its directory does not exist.
    """
    return _classify(path)[0]


def _classify(path: str) -> tuple[str, str, int | None]:
    final, fd = resolve_target(path)
    if fd is not None:
        return STREAM, final, fd
    try:
        st = os.stat(final)
    except FileNotFoundError:
        parent = os.path.dirname(final)
        if not os.path.isdir(parent):
            if final != os.path.abspath(path):
                raise OutputError(f"{path}: links to {final}, whose directory does not exist") from None
            raise OutputError(f"{path}: the directory {os.path.dirname(path) or '.'} does not exist; "
                              "create it first") from None
        return FILE, final, None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path}: is a directory; give a file name")
    return (FILE if stat.S_ISREG(st.st_mode) else STREAM), final, None


def write_target(path: str, data: bytes) -> str:
    """Write ``data`` to what ``path`` names, without ever replacing what is not a regular file; return
    :data:`FILE` or :data:`STREAM`.

    - a regular file or a new name: a temporary file in the same directory, flushed to disk, then renamed
      over it (``os.replace``, atomic on POSIX); an existing file keeps its permissions (and its owner,
      where this process may set it); one this process may not write is refused, as ``open`` would;
    - a symbolic link: followed; its target is written by these rules and the link stays a link;
    - a character device, a FIFO or a socket (``/dev/null``, ``mkfifo``), or a descriptor of this
      process (``/dev/stdout``, ``/dev/fd/63``): written in place as a stream, never renamed over.
    - a regular file in a directory this process may not write, but which it may write: written in place.

    Raises:
        OutputError: a directory, a missing directory, no permission to write the file.
        OSError: the write failed (disk full, the reader of a pipe went away: ``BrokenPipeError``); the
            temporary file is removed and a previous file is left untouched.
    """
    kind, final, fd = _classify(path)
    if kind == STREAM:
        if fd is not None and fd >= 0:
            out = os.dup(fd)
        else:  # a device, a FIFO; or a descriptor of another process, truncated as ``>`` would if a file
            out = os.open(final, os.O_WRONLY | (os.O_TRUNC if fd == -1 and os.path.isfile(final) else 0))
        _write_all(out, data)
        return STREAM
    try:
        st: os.stat_result | None = os.stat(final)
    except FileNotFoundError:
        st = None
    if st is not None and not os.access(final, os.W_OK):
        raise OutputError(f"{path}: permission denied (the file is not writable)")
    try:
        _replace(final, data, st)
    except PermissionError:
        if st is None:
            raise OutputError(f"{path}: permission denied (cannot create a file in "
                              f"{os.path.dirname(final)})") from None
        # the directory is closed to new names but the file is open to writes: write it in place
        _write_all(os.open(final, os.O_WRONLY | os.O_TRUNC), data, sync=True)
    return FILE


def _write_all(fd: int, data: bytes, sync: bool = False) -> None:
    with os.fdopen(fd, "wb", buffering=0) as f:
        view = memoryview(data)
        while view:
            view = view[f.write(view):]
        if sync:
            os.fsync(f.fileno())


def _replace(final: str, data: bytes, st: os.stat_result | None) -> None:
    d, base = os.path.split(final)
    # os.open with 0o666 honours the umask like open() does (mkstemp would force 0o600)
    tmp = os.path.join(d, f".{base[:_MAX_NAME]}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            if st is not None:  # an overwritten file keeps its mode and, where allowed, its owner
                os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))
                if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                    try:
                        os.fchown(f.fileno(), st.st_uid, st.st_gid)
                    except OSError:
                        pass
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_bytes(path: str, data: bytes) -> None:
    """:func:`write_target`: ``path`` written through a temporary file and a rename when it is a regular
    file or a new name (links followed), in place when it is a device, a FIFO or a descriptor.

    Raises:
        OutputError, OSError: as :func:`write_target`; a previous ``path`` is left untouched on failure.
    """
    write_target(path, data)


def atomic_write_json(path: str, obj: Any) -> None:
    """:func:`atomic_write_bytes` of ``obj`` as indented JSON (sorted keys are not forced)."""
    atomic_write_bytes(path, json_bytes(obj))


# an indented list of integers: every break is a newline, which no JSON string holds unescaped
_NUMBER_ROW = re.compile(r"\[\n *(-?\d+(?:,\n *-?\d+)*)\n *\]")


def sidecar_json_bytes(obj: Any) -> bytes:
    """:func:`json_bytes`, with every innermost list of integers on one line (a sidecar's ``[data_ptr, nbytes]``
    storages: 2.2 times fewer bytes than one number a line, ``benchmarks/sidecar_size.py``). The same JSON value."""
    text = json_bytes(obj).decode("utf-8")
    return _NUMBER_ROW.sub(lambda m: "[" + re.sub(r",\n *", ", ", m.group(1)) + "]", text).encode("utf-8")


def json_bytes(obj: Any) -> bytes:
    """``obj`` as indented JSON in UTF-8, with a final newline (tuples and sets as lists, numpy scalars as
    numbers, anything else as its ``str``)."""
    return (json.dumps(obj, indent=2, default=_json_default) + "\n").encode("utf-8")


def _json_default(o: Any) -> Any:
    if isinstance(o, (tuple, set, frozenset)):
        return list(o)
    if hasattr(o, "item"):
        return o.item()
    return str(o)
