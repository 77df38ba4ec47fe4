"""What a detector reports: a :class:`Finding` with its evidence and fixes, as data (issue 37).

A finding is its ``id``, ``severity``, a ``variant`` naming which of its wordings applies, the bytes at stake and
the numbers of its ``evidence``; a fix is a stable ``id`` with its versions, source, kind and setting. No sentence
is written here: the words of every finding id + variant and every fix id are in
:mod:`oomdoctor.render.words.findings`, and only the renderers (text, JSON, HTML) use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

SEVERITIES = ("critical", "high", "medium", "low", "info")


@dataclass
class Fix:
    """One remedy. ``applies`` is True/False for the user's PyTorch version when it is known or can be
    bounded from the snapshot, None when it cannot be told.

    ``what_if`` says how the allocator simulator can replay the fix: ``{"config": "<alloc conf>"}``
    (options applied on top of the recorded ones) and/or ``{"deferred_frees": "immediate"}``.
    ``prediction`` is what that replay gave (filled by the report, see ``report/predict.py``).

    ``id`` is stable (e.g. ``expandable-segments``, ``avoid-record-streams``): the key of its words
    (:data:`oomdoctor.render.words.findings.FIXES`). ``framework``: the id of the framework
    (:data:`oomdoctor.frameworks.FRAMEWORKS`) whose knob the fix names, for the fixes said in a framework's words."""

    id: str
    versions: str
    source: str
    kind: str = "code"  # env | config | code | upgrade
    setting: str | None = None
    applies: bool | None = None
    what_if: dict[str, str] | None = None
    prediction: dict[str, Any] | None = None
    framework: str | None = None


@dataclass
class SiteRef:
    """An allocation site behind a finding: ``label`` (``file:line in function``), bytes, block count,
    and the full stack (innermost first) of its largest block.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema diagnose``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    label: str
    """file:line function of the allocation site (the frame of user code nearest the top)"""
    bytes: int
    """held by the site's live blocks (bytes)"""
    count: int
    """live blocks"""
    stack: list[str] = field(default_factory=list)
    """the allocation stack, innermost first, shortened"""
    user_frame: str | None = None
    """the frame of user code, if any"""


@dataclass
class Finding:
    """A diagnosed problem. ``id`` is stable (the detector's name); ``bytes`` is what is at stake; ``variant``
    names the wording of its title and summary (e.g. ``cache-flush``: ``empty-cache``, ``retries``; ``""`` for a
    detector with one wording): the key, with ``id``, of its words (:mod:`oomdoctor.render.words.findings`)."""

    id: str
    severity: str
    ranks: list[int]
    bytes: int
    evidence: dict[str, Any] = field(default_factory=dict)
    sites: list[SiteRef] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)
    prediction: dict[str, Any] | None = None
    per_rank_bytes: dict[int, int] = field(default_factory=dict)
    variant: str = ""

    def title_ref(self) -> FindingTitle:
        """A reference to this finding's title, for a verdict that names it (filled by the renderers)."""
        return FindingTitle(self.id, self.variant, self.evidence)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")


class FindingTitle(NamedTuple):
    """A finding's title as data: what a verdict's evidence holds where it names the finding that decides it
    (``report/verdict.py`` ``with_findings``); the renderers fill it from
    :func:`oomdoctor.render.words.findings.resolve_title`."""

    id: str
    variant: str
    evidence: dict[str, Any]
