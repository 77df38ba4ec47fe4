"""The console every text rendering draws on: rich's, without trailing spaces."""

from __future__ import annotations

import re
from typing import IO

import rich._wrap
from rich.console import Console
from rich.table import Table
from rich.text import Text

_TRAILING = re.compile(r"[ ]+((?:\x1b\[[0-9;]*m)*)(?=\n|$)")


_WORD = re.compile(r"\s*(?:[^\s\d]*\d[\d.,]* (?:[KMGT]iB|B|µs|ms)(?![\w.]\w)\S*|\S+)\s*")
"""A word for rich's wrapping: a size or a duration and its unit (``34.36 GiB``) are one word, so that a wrap never
puts the number and its unit on two lines (issue 37: numbers are never cut)."""

# rich 13-15 wrap every Text with rich._wrap.words, which reads this pattern; the renderers' one setting of it
rich._wrap.re_word = _WORD


class TidyConsole(Console):
    """A :class:`rich.console.Console` whose lines end without trailing spaces: rich pads wrapped words and
    table cells to the column's width, and a piped output or a file should not carry them (issue 37)."""

    def _render_buffer(self, buffer) -> str:  # rich 13-15: the one place where segments become text
        return _TRAILING.sub(r"\1", super()._render_buffer(buffer))


def plain_console(file: IO[str], width: int) -> TidyConsole:
    """A console writing plain text (no colour, no highlighting) at ``width`` columns into ``file``."""
    return TidyConsole(file=file, width=width, no_color=True, highlight=False)


def hang(text: Text | str, indent: int = 2, lead: Text | str = "", style: str = "") -> Table:
    """``text`` after ``indent`` spaces and ``lead`` (a list number, a label), wrapped so that every line keeps
    the indent: rich wraps a Text back to column 0, which reads as a new paragraph (issue 37)."""
    body = text if isinstance(text, Text) else Text(text, style=style)
    grid = Table.grid(padding=0)
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    head = Text(" " * indent, style=style) + (lead if isinstance(lead, Text) else Text(lead, style=style))
    grid.add_row(head, body)
    return grid
