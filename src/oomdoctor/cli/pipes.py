"""What happens when the reader of a pipe goes away, without importing rich (``oomdoctor --help`` stays light).

``oomdoctor diagnose FILE | head -1``: ``head`` exits after one line and the next write fails with EPIPE.
rich's console exits with code 1 then (:mod:`.console` makes it raise instead), and click's ``main`` turns an
EPIPE into exit code 1 too. :class:`WatchedStdout` notes any EPIPE on standard output, so
:func:`oomdoctor.cli.main.main` exits 0 as a Unix filter does (Python's note on SIGPIPE:
https://docs.python.org/3/library/signal.html#note-on-sigpipe).
"""

from __future__ import annotations

import os
import sys


def silence_stdout() -> None:
    """Point standard output at ``/dev/null``, so that the interpreter's last flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


class WatchedStdout:
    """Standard output that remembers a broken pipe (``broken``) and raises it on (every attribute but
    ``write`` and ``flush`` is the wrapped stream's)."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self.broken = True
            raise

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self.broken = True
            raise

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
