"""Byte and time units, defined once. Only renderers format sizes for people."""

from __future__ import annotations

KiB: int = 1 << 10
MiB: int = 1 << 20
GiB: int = 1 << 30

#: Microseconds per second (trace timestamps ``time_us`` are microseconds since the Unix epoch).
US_PER_S: int = 1_000_000
