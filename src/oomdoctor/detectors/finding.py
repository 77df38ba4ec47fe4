"""What a detector reports: a :class:`Finding` with its evidence and fixes.

Text fields may hold ``{name}`` / ``{name:bytes}`` / ``{name:us}`` placeholders naming keys of
``evidence``; renderers fill them (only renderers format sizes for people).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SEVERITIES = ("critical", "high", "medium", "low", "info")


@dataclass
class Fix:
    """One remedy. ``applies`` is True/False for the user's PyTorch version when it is known or can be
    bounded from the snapshot, None when it cannot be told.

    ``what_if`` says how the allocator simulator can replay the fix: ``{"config": "<alloc conf>"}``
    (options applied on top of the recorded ones) and/or ``{"deferred_frees": "immediate"}``.
    ``prediction`` is what that replay gave (filled by the report, see ``report/predict.py``)."""

    text: str
    versions: str
    source: str
    kind: str = "code"  # env | config | code | upgrade
    setting: str | None = None
    applies: bool | None = None
    what_if: dict[str, str] | None = None
    prediction: dict[str, Any] | None = None


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
    """A diagnosed problem. ``id`` is stable (the detector's name); ``bytes`` is what is at stake."""

    id: str
    severity: str
    title: str
    ranks: list[int]
    bytes: int
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    sites: list[SiteRef] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)
    prediction: dict[str, Any] | None = None
    per_rank_bytes: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")
