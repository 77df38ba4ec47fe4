"""The terminal every subcommand draws on: rich's console, except that a closed pipe raises
:class:`BrokenPipeError` (rich's :meth:`rich.console.Console.on_broken_pipe` exits with code 1) for
:func:`oomdoctor.cli.main.main` to end with exit code 0 (:mod:`.pipes`)."""

from __future__ import annotations

from rich.console import Console

from ..render.console import TidyConsole
from .pipes import silence_stdout


class Terminal(TidyConsole):
    """A :class:`rich.console.Console` that reports a closed pipe instead of exiting."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        silence_stdout()
        raise BrokenPipeError


def terminal(width: int | None = None) -> Console:
    """The console for standard output: colour and the terminal's width on a terminal; plain text at
    ``width`` (default: the ``COLUMNS`` variable, else 80) when piped."""
    return Terminal(highlight=False, width=width)
