"""Byte and time units, and rank spans, defined once. Only renderers format sizes for people."""

from __future__ import annotations

import re

from .errors import UsageError

KiB: int = 1 << 10
MiB: int = 1 << 20
GiB: int = 1 << 30

#: Microseconds per second (trace timestamps ``time_us`` are microseconds since the Unix epoch).
US_PER_S: int = 1_000_000

_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(us|µs|ms|s)?\s*")
_DURATION_SCALE = {None: 1, "us": 1, "µs": 1, "ms": 1_000, "s": US_PER_S}

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"41519093862"``, ``"38.67GiB"``, ``"40 GB"`` -> bytes (binary units for ``KiB/MiB/GiB`` and
    single letters, decimal for ``KB/MB/GB``).

    Raises:
        UsageError: anything else, or a size that is not positive.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise UsageError(f"cannot read {text!r} as a size: give bytes or a number with B, KiB, MiB, GiB, GB ...")
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise UsageError(f"a size must be positive, got {text!r}")
    return int(value)


def parse_duration_us(text: str, *, unit_required: bool = False) -> float | None:
    """``"350us"``, ``"20ms"``, ``"1.5s"`` -> microseconds; a bare number is µs unless ``unit_required``.
    None when ``text`` is none of these."""
    m = _DURATION.fullmatch(text)
    if not m or (unit_required and m.group(2) is None):
        return None
    return float(m.group(1)) * _DURATION_SCALE[m.group(2)]


def format_duration_us(us: int | float) -> str:
    """Microseconds as ``"850 µs"``, ``"4.2 ms"`` or ``"1.3 s"`` (the renderers' ``render.format.format_us``; here
    for the messages of the layers below ``render`` too)."""
    us = float(us)
    if us < 1000:
        return f"{us:.0f} µs"
    if us < 1_000_000:
        return f"{us / 1000:.1f} ms"
    return f"{us / 1_000_000:.1f} s"


def span(ranks: list[int]) -> str:
    """Ranks as spans: ``[0, 1, 2, 5, 7, 8]`` -> ``"0–2, 5, 7–8"``."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}–{r}")
            start = None
    return ", ".join(out)
