"""Formatting numbers for people, and filling finding templates. The only place sizes are formatted."""

from __future__ import annotations

import os
import re
import string
import textwrap
from typing import Any, Mapping

from ..units import GiB, KiB, MiB
from ..units import format_duration_us as format_us  # "850 µs", "4.2 ms", "1.3 s"; messages below render too
from ..units import span as span  # defined below the report layer, which writes it in notes too


def format_bytes(n: int | float) -> str:
    """``3_053_453_312`` -> ``"2.84 GiB"`` (binary units, GiB = 2**30)."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


def plural(noun: str) -> str:
    """``trial`` -> ``trials``, ``micro-batch`` -> ``micro-batches``, ``pass`` -> ``passes``."""
    return noun + ("es" if noun.endswith(("ch", "sh", "s", "x", "z")) else "s")


def count(n: int, noun: str) -> str:
    """``1 trial``, ``2 trials``, ``0 micro-batches``: a count with its noun, never ``trial(s)`` or ``1 trials``."""
    return f"{n} {noun if n == 1 else plural(noun)}"


_SINCE = re.compile(r"^>= (\d+\.\d+) \(snapshot has '[^']*'\)$")


def torch_version_words(text: str) -> str:
    """A PyTorch version as :func:`oomdoctor.detectors.context.torch_version` writes it, for people: ``2.11.0+cu130``
    as it is; a lower bound read off the snapshot's fields (``>= 2.10 (snapshot has 'user_metadata')``) as
    ``2.10 or later (read off the snapshot)``."""
    m = _SINCE.match(text)
    return f"{m.group(1)} or later (read off the snapshot)" if m else text


_SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[int], top: int) -> str:
    """One character per value, scaled to ``top``; values outside ``[0, top]`` are clamped (a trace whose
    start could not be rebuilt can undercount allocated bytes below zero)."""
    if not values or top <= 0:
        return ""
    last = len(_SPARK) - 1
    return "".join(_SPARK[max(0, min(last, int(v / top * last + 0.5)))] for v in values)


def format_signed_bytes(n: int) -> str:
    """A change in bytes: ``"+64.00 MiB"``, ``"-1.66 GiB"``, ``"0 B"``."""
    return ("+" if n > 0 else "") + format_bytes(n) if n else "0 B"


def format_list(items: Any) -> str:
    """``[0, 3, 6, 9]`` -> ``"0, 3, 6 and 9"``; one item alone; ``""`` for none; more than eight as the first three
    and the last two (``"0, 3, 6, …, 27 and 30"``)."""
    words = [str(x) for x in items]
    if len(words) > 8:
        words = words[:3] + ["…"] + words[-2:]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1] if words else ""


class _EvidenceFormatter(string.Formatter):
    """``{key:bytes}``, ``{key:us}`` and ``{key:list}`` formats; a key the evidence lacks is kept visible as ``{key}`` (or raises
    :class:`KeyError` when ``strict``)."""

    def __init__(self, strict: bool) -> None:
        super().__init__()
        self.strict = strict

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> Any:
        try:
            return super().get_field(field_name, args, kwargs)
        except (KeyError, IndexError, AttributeError, TypeError):
            if self.strict:
                raise KeyError(f"template field {{{field_name}}} is not in the evidence") from None
            return _Missing(field_name), field_name

    def format_field(self, value: Any, format_spec: str) -> str:
        if isinstance(value, _Missing):
            return "{" + value.name + "}"
        if format_spec == "bytes":
            return format_bytes(value)
        if format_spec == "us":
            return format_us(value)
        if format_spec == "list":
            return format_list(value)
        return super().format_field(value, format_spec)


class _Missing:
    def __init__(self, name: str) -> None:
        self.name = name


STRICT_ENV = "OOMDOCTOR_STRICT_TEMPLATES"
"""Set to 1 (the test suite does) and :func:`fill` raises on a template field the evidence lacks."""


def fill(template: str, evidence: Mapping[str, Any]) -> str:
    """Fill ``{key}``, ``{key:bytes}``, ``{key:us}``, ``{key:list}``, ``{key[sub]}`` from ``evidence``. A key the evidence lacks
    stays visible as ``{key}`` and the rest is filled; with ``OOMDOCTOR_STRICT_TEMPLATES=1`` it raises.

    Raises:
        KeyError: a field is missing and :data:`STRICT_ENV` is set.
        ValueError: the template is malformed and :data:`STRICT_ENV` is set (else it is returned as it is).
    """
    strict = os.environ.get(STRICT_ENV) == "1"
    try:
        return _EvidenceFormatter(strict).vformat(template, (), evidence)
    except ValueError:
        if strict:
            raise
        return template


_SITE = re.compile(r"^(?P<path>[^\s]*?):(?P<line>\d+)(?P<rest>\s.*)?$")


def fit_site(label: str, width: int) -> str:
    """An allocation site (``path/file.py:LINE in function``) in lines of at most ``width`` columns, never
    breaking ``file.py:LINE``: the path first loses leading directories (``.../``), then `` in function`` goes
    to a second line. A label of another shape (``<autograd backward: ...>``) is wrapped at its spaces."""
    if len(label) <= width:
        return label
    m = _SITE.match(label)
    if m is None:
        return textwrap.fill(label, width, break_long_words=False, break_on_hyphens=False)
    parts, line = m.group("path").split("/"), m.group("line")
    where = f"{m.group('path')}:{line}"
    while len(where) > width and len(parts) > 1:
        parts = parts[1:]
        where = ".../" + "/".join(parts) + f":{line}"
    rest = (m.group("rest") or "").strip()
    if not rest:
        return where
    return f"{where} {rest}" if len(where) + 1 + len(rest) <= width else f"{where}\n{rest}"


_UNIT_GAP = re.compile(r"(\d) (?=(?:[KMGT]iB|B|GB|MB|µs|ms|s)\b)")


def wrap_lines(text: str, width: int = 80) -> str:
    """Each line of ``text`` wrapped at ``width`` columns: a wrapped line keeps the line's indent plus two (a list
    item's continuation), a number stays on the line of its unit, and no word is cut (a path longer than the width
    stays whole on its own line)."""
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        indent = len(line) - len(line.lstrip(" "))
        glued = _UNIT_GAP.sub("\\1\u00a0", line)  # a no-break space: textwrap breaks at ASCII whitespace only
        out += [x.replace("\u00a0", " ") for x in textwrap.wrap(
            glued.lstrip(" "), width, initial_indent=" " * indent, subsequent_indent=" " * (indent + 2), break_long_words=False,
            break_on_hyphens=False)]
    return "\n".join(out)
