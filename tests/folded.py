"""Reading folded stacks as the tools that draw them do, for the tests.

The grammar the readers share (``views/flame.py`` says where each rule comes from): flamegraph.pl's line regex
``^(.*)\\s+?(\\d+(?:\\.\\d*)?)$``, applied again to the stack to find a differential second count; inferno's count
after the last space of the trimmed line; speedscope's ``^(.*) (\\d+)$``; frames split at ``;``.
"""

from __future__ import annotations

import re

PERL_LINE = re.compile(r"^(.*)\s+?(\d+(?:\.\d*)?)$")


def parse_folded(text: str) -> list[tuple[list[str], int]]:
    """``[(frames root first, count)]``, failing on any line one of the readers would read differently (a
    second count, an empty or padded frame, a line it would skip)."""
    out = []
    for line in text.splitlines():
        m = PERL_LINE.match(line)
        assert m, line
        stack, count = m.groups()
        assert not PERL_LINE.match(stack), f"flamegraph.pl would read a differential count: {line!r}"
        assert re.fullmatch(r"(.*) (\d+)", line).group(1) == stack  # speedscope
        assert line.rsplit(" ", 1) == [stack, count] and line == line.strip()  # inferno
        parts = stack.split(";")
        assert all(p and p == p.strip() for p in parts), line
        out.append((parts, int(count)))
    return out
