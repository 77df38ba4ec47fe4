"""What every detector receives: the analyses of all ranks, and the PyTorch version where known.

The snapshot does not record PyTorch's version. The sidecar (``oomdoctor.record``) does; otherwise a
lower bound is read off the fields the snapshot has, from when each was added
(``shared/reference/snapshot_format_and_peers.md`` §1.12): ``user_metadata`` on trace entries 2.10
(PR #165490), ``compile_context`` 2.8 (PR #152707), ``graph_capture_record_stream_reuse`` in
``allocator_settings`` 2.9 (PR #158352), ``external_annotations`` 2.5 (PR #129072),
``allocator_settings`` 2.3 (PR #119404), ``time_us`` 2.2 (PR #112266).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..analysis.device import DeviceAnalysis
from .finding import Finding

Version = tuple[int, int]

_FIELD_VERSIONS: tuple[tuple[str, str, Version], ...] = (
    ("entry", "user_metadata", (2, 10)),
    ("settings", "graph_capture_record_stream_reuse", (2, 9)),
    ("entry", "compile_context", (2, 8)),
    ("snapshot", "external_annotations", (2, 5)),
    ("snapshot", "allocator_settings", (2, 3)),
    ("entry", "time_us", (2, 2)),
)


def parse_version(text: str) -> Version | None:
    """``"2.11.0+cu130"`` -> ``(2, 11)``."""
    m = re.match(r"^\s*(\d+)\.(\d+)", str(text))
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass
class TorchVersion:
    """``exact`` from the sidecar, else ``minimum`` inferred from the snapshot's fields (or None)."""

    exact: Version | None
    minimum: Version | None
    text: str

    def at_least(self, v: Version) -> bool | None:
        """True/False when the version is known (or its lower bound settles it), None otherwise."""
        if self.exact is not None:
            return self.exact >= v
        if self.minimum is not None and self.minimum >= v:
            return True
        return None

    def in_range(self, lo: Version, hi: Version) -> bool | None:
        """Is the version in ``[lo, hi)``?"""
        if self.exact is not None:
            return lo <= self.exact < hi
        if self.minimum is not None and self.minimum >= hi:
            return False
        return None


def applies(versions: str, v: TorchVersion) -> bool | None:
    """Does a fix for PyTorch ``versions`` apply to ``v``? ``versions`` is ``"all"``, ``">=2.8"``,
    ``"2.1-2.7"`` (both ends included), ``"2.4-2.9"`` or ``"<2.8"``; text in parentheses after it is
    ignored. None when the version is unknown or the spelling is not one of these."""
    text = versions.split("(")[0].strip()
    if text == "all":
        return True
    m = re.fullmatch(r">=\s*(\d+)\.(\d+)", text)
    if m:
        return v.at_least((int(m.group(1)), int(m.group(2))))
    m = re.fullmatch(r"<\s*(\d+)\.(\d+)", text)
    if m:
        r = v.at_least((int(m.group(1)), int(m.group(2))))
        return None if r is None else not r
    m = re.fullmatch(r"(\d+)\.(\d+)\s*-\s*(\d+)\.(\d+)", text)
    if m:
        lo = (int(m.group(1)), int(m.group(2)))
        hi = (int(m.group(3)), int(m.group(4)) + 1)
        return v.in_range(lo, hi)
    return None


def version_from_text(text: str) -> TorchVersion:
    """The :class:`TorchVersion` whose ``text`` this is (a report's ``torch_version``, read back):
    ``"2.11.0+cu130"`` exact, ``">= 2.10 (snapshot has '...')"`` a lower bound, anything else unknown."""
    m = re.match(r"^>=\s*(\d+)\.(\d+)", text)
    if m:
        return TorchVersion(None, (int(m.group(1)), int(m.group(2))), text)
    v = parse_version(text)
    return TorchVersion(v, None, text) if v is not None else TorchVersion(None, None, text)


def torch_version(a: DeviceAnalysis) -> TorchVersion:
    meta = a.trace.meta
    versions: dict[str, Any] = meta.get("versions") or {}
    raw = meta.get("torch_version") or versions.get("torch")
    if raw and parse_version(raw):
        return TorchVersion(parse_version(raw), None, str(raw))
    entry_keys = set(meta.get("trace_entry_keys", []))
    snap_keys = set(meta.get("snapshot_keys", []))
    settings = set(a.trace.allocator_settings)
    for where, key, v in _FIELD_VERSIONS:
        present = {"entry": entry_keys, "snapshot": snap_keys, "settings": settings}[where]
        if key in present:
            return TorchVersion(None, v, f">= {v[0]}.{v[1]} (snapshot has '{key}')")
    return TorchVersion(None, None, "unknown")


@dataclass
class Context:
    """All ranks' analyses, sorted by rank, and each rank's PyTorch version (read once, when the context is made)."""

    analyses: list[DeviceAnalysis]
    versions: dict[int, TorchVersion] = field(init=False)
    """rank -> its :func:`torch_version`"""

    def __post_init__(self) -> None:
        self.versions = {a.rank: torch_version(a) for a in self.analyses}


def fill_applies(findings: list[Finding], ctx: Context) -> None:
    """Fill ``Fix.applies`` where the detector left it open (None), from :func:`applies` on the fix's versions and the
    PyTorch version (``ctx.versions``) of the first of the finding's ranks that ``ctx`` holds. Mutates ``findings``."""
    for f in findings:
        v = next((ctx.versions[r] for r in f.ranks if r in ctx.versions), None)
        if v is None:
            continue
        for fx in f.fixes:
            if fx.applies is None:
                fx.applies = applies(fx.versions, v)
