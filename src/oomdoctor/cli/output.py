"""Where ``-o``/``--output`` writes: the one way every command writes the file it is given.

What the name is decides how it is written (:func:`oomdoctor.capture.files.write_target`):

- a regular file or a new name: a temporary file in the same directory, then a rename (atomic; an
  overwritten file keeps its permissions);
- a symbolic link: followed; the target is written, and the link stays a link;
- a character device, a FIFO, a pipe (``/dev/null``, ``/dev/stdout``, ``>(gzip > x.gz)``): written in
  place as a stream, never renamed over;
- ``-``: standard output, the same bytes a file would get;
- a directory, or a name whose directory is missing: one line naming it, exit code 2.

When the reader of a pipe or FIFO goes away (``-o /dev/stdout | head -3``) the command ends quietly with
exit code 0, as the text outputs do (:mod:`.pipes`).
"""

from __future__ import annotations

import io
import sys
from typing import Callable

import click
from rich.console import Console

from ..capture.files import FILE, STREAM, OutputError, resolve_target, target_kind, write_target
from ..errors import UsageError
from ..render.console import plain_console
from .console import terminal as stdout_console
from .pipes import silence_stdout

__all__ = ["FILE", "OUTPUT", "STREAM", "OutputError", "check_output", "write_bytes", "write_output", "write_rendered", "write_text"]

#: The click type of every ``-o``: a path or ``-``. No check is made while parsing (click's would refuse a
#: device or a FIFO, and print usage with its error); :func:`write_bytes` checks when it writes.
OUTPUT = click.Path(path_type=str, allow_dash=True, readable=False)


def check_output(path: str | None) -> None:
    """Refuse, before a long run, an ``-o`` that :func:`write_bytes` would refuse at its end: a directory, or a name
    whose directory is missing (the same one line, exit code 2). Nothing is written.

    Raises:
        OutputError: as :func:`oomdoctor.capture.files.target_kind`.
    """
    if path and path != "-":
        target_kind(path)


def write_bytes(path: str, data: bytes) -> str:
    """Write ``data`` to ``path`` (``-``: standard output); return :data:`FILE` (a regular file, replaced
    atomically) or :data:`STREAM` (standard output, a device, a FIFO, a pipe).

    Raises:
        OutputError: ``path`` is a directory, its directory is missing, or it may not be written (exit 2).
        UsageError: the write failed (disk full, ...), naming ``path`` and the system's reason (exit 2).
        click.exceptions.Exit: 0, after the reader of a pipe went away.
    """
    if path == "-":
        _to_stdout(data)
        return STREAM
    for s in (sys.stdout, sys.stderr):  # what was printed before comes first on a shared descriptor
        try:
            s.flush()
        except (OSError, ValueError):
            pass
    try:
        return write_target(path, data)
    except BrokenPipeError:
        _reader_gone(resolve_target(path)[1] == 1)
    except OutputError:
        raise
    except OSError as e:
        raise UsageError(f"{path}: cannot write ({e.strerror or e})") from None
    raise AssertionError("unreachable")  # pragma: no cover


def write_text(path: str, text: str) -> str:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    return write_bytes(path, text.encode("utf-8"))


def write_output(path: str | None, text: str) -> None:
    """Write to ``path`` (``-`` too), or to standard output through click when None."""
    if path:
        write_text(path, text)
    else:
        click.echo(text, nl=False)


def write_rendered(output: str | None, draw: Callable[[Console], None], *, width: int = 120,
                   terminal: Console | None = None) -> None:
    """Draw a rich rendering on the terminal (``terminal``, or a plain one), or into ``output`` (``-`` too)
    at ``width`` columns without colour."""
    if not output:
        draw(terminal or stdout_console())
        return
    buf = io.StringIO()
    draw(plain_console(buf, width))
    write_text(output, buf.getvalue())


def _to_stdout(data: bytes) -> None:
    out = sys.stdout
    try:
        out.flush()
        buf = getattr(out, "buffer", None)
        if buf is None:  # a text-only stream (a test's capture): what is text goes through
            out.write(data.decode("utf-8"))
            out.flush()
        else:
            buf.write(data)
            buf.flush()
    except BrokenPipeError:
        _reader_gone(True)


def _reader_gone(stdout: bool) -> None:
    """The reader of the pipe went away (``| head``): done, as a Unix filter is (exit 0, nothing on stderr)."""
    if stdout:
        silence_stdout()
    raise click.exceptions.Exit(0)
