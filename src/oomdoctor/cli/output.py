"""Where ``-o``/``--output`` writes: the one way every command writes the file it is given.

What the name is decides how it is written (:func:`oomdoctor.capture.files.write_target`):

- a regular file or a new name: a temporary file in the same directory, then a rename (atomic; an
  overwritten file keeps its permissions);
- a symbolic link: followed; the target is written, and the link stays a link;
- a character device, a FIFO, a pipe (``/dev/null``, ``/dev/stdout``, ``>(gzip > x.gz)``): written in
  place as a stream, never renamed over;
- ``-``: standard output, the same bytes a file would get;
- a directory, or a name whose directory is missing: one line naming it, exit code 2.

Every command writes its report with :func:`emit`: the result the core built, rendered by the renderer of its
``--format`` (:mod:`oomdoctor.render.protocol`), to ``-o`` or to standard output alike; without ``-o`` a rich
rendering is drawn on the terminal (colour, its width), and with ``-o -`` standard output gets the bytes a file would.

When the reader of a pipe or FIFO goes away (``-o /dev/stdout | head -3``) the command ends quietly with
exit code 0, as the text outputs do (:mod:`.pipes`).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import click
from rich.console import Console

from ..capture.files import FILE, STREAM, OutputError, resolve_target, target_kind, write_target
from ..errors import UsageError
from ..render.protocol import ConsoleDrawer, FunctionRenderer, renderer
from .console import terminal as stdout_console
from .pipes import silence_stdout

__all__ = ["FILE", "OUTPUT", "STREAM", "OutputError", "Written", "check_output", "emit", "write_bytes"]

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


class Written(NamedTuple):
    """What :func:`emit` wrote: ``kind`` (:data:`FILE`, :data:`STREAM`, or None when drawn on the terminal) and
    ``size`` in bytes (0 when drawn)."""

    kind: str | None
    size: int


def emit(output: str | None, command: str, fmt: str, result: Any, *, terminal: Console | None = None,
         **options: Any) -> Written:
    """Render ``result`` with ``command``'s renderer for ``fmt`` (:func:`oomdoctor.render.protocol.renderer`) and
    write it to ``output`` (``-`` too) as :func:`write_bytes` does; without ``output``, to standard output: a rich
    rendering is drawn on ``terminal`` (default: :func:`oomdoctor.cli.console.terminal`), a text wrapped at its
    width where the renderer says so, anything else as it would be written to a file. ``options`` go to the
    renderer (how to lay out, never what to compute)."""
    r = renderer(command, fmt)
    if not output:
        if isinstance(r, ConsoleDrawer):
            r.draw(result, terminal or stdout_console(), **options)
            return Written(None, 0)
        if isinstance(r, FunctionRenderer) and r.terminal_width:
            options.setdefault("width", (terminal or stdout_console()).width)
    data = r.render(result, **options)
    raw = data if isinstance(data, bytes) else data.encode("utf-8")
    if output:
        return Written(write_bytes(output, raw), len(raw))
    if isinstance(data, bytes):
        _to_stdout(data)
    else:
        click.echo(data, nl=False)
    return Written(STREAM, len(raw))


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
