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
FIX_KINDS = ("env", "config", "code", "upgrade")
"""What a :class:`Fix` changes: an environment setting, a configuration, the code, or the PyTorch version."""


@dataclass
class Fix:
    """One remedy. ``applies`` is True/False for the user's PyTorch version when it is known or can be
    bounded from the snapshot, None when it cannot be told.

    ``what_if`` says how the allocator simulator can replay the fix: ``{"config": "<alloc conf>"}``
    (options applied on top of the recorded ones) and/or ``{"deferred_frees": "immediate"}``.
    ``prediction`` is what that replay gave (filled by the report, see ``report/predict.py``): this recording
    replayed. ``measured``: numbers the fix's words cite from other runs, measured on a GPU.

    ``id`` is stable (e.g. ``expandable-segments``, ``avoid-record-streams``): the key of its words
    (:data:`oomdoctor.render.words.findings.FIXES`). ``framework``: the id of the framework
    (:data:`oomdoctor.frameworks.FRAMEWORKS`) whose knob the fix names, for the fixes said in a framework's words.

    The docstring under each field is its description in the JSON schema (``oomdoctor schema diagnose``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    id: str
    """the fix's stable id (the JSON has its words, ``text``, instead)"""
    versions: str
    """the PyTorch versions the fix applies to ('all', '>=2.8', '2.1-2.7', '<2.8')"""
    source: str
    """where the rule comes from: a PyTorch pull request, issue or document"""
    kind: str = "code"
    """env, config, code or upgrade"""
    setting: str | None = None
    """the environment setting to apply, when the fix is one"""
    applies: bool | None = None
    """does it apply to the recorded PyTorch version (null: unknown)"""
    what_if: dict[str, str] | None = None
    """the experiment the simulator replays for it (config, deferred_frees)"""
    prediction: dict[str, Any] | None = None
    """the simulator's replay of the fix"""
    framework: str | None = None
    """the id of the framework whose knob the fix names (the JSON has it in the fix's words, ``text``)"""
    measured: dict[str, list[int]] | None = None
    """what runs measured on a GPU, which the fix's words cite: per setting, the smallest and largest peak reserved
    over those runs' ranks (bytes); other runs than the one diagnosed (its own replay is the prediction)"""


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
    stack: list[str] = field(default_factory=list[str])
    """the allocation stack, innermost first, shortened"""
    user_frame: str | None = None
    """the frame of user code, if any"""


@dataclass
class Finding:
    """A diagnosed problem. ``id`` is stable (the detector's name); ``bytes`` is what is at stake; ``variant``
    names the wording of its title and summary (e.g. ``cache-flush``: ``empty-cache``, ``retries``; ``""`` for a
    detector with one wording): the key, with ``id``, of its words (:mod:`oomdoctor.render.words.findings`).

    The docstring under each field is its description in the JSON schema (``oomdoctor schema diagnose``)."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    id: str
    """the detector's stable id (deferred-free, fragmentation, output-accumulation, memory-growth,
    pipeline-output-cache, allgather-list, rank-imbalance, small-long-lived, cache-flush)"""
    severity: str
    """after the materiality rule"""
    ranks: list[int]
    """the ranks it was found on"""
    bytes: int
    """at stake: what the fix gives back at the peak or the OOM, never more than the ranks' peak reserved (bytes)"""
    evidence: dict[str, Any] = field(default_factory=dict[str, Any])
    """the numbers behind it, per detector (bytes in keys ending _bytes, event indices in keys ending _event or
    _index)"""
    sites: list[SiteRef] = field(default_factory=list[SiteRef])
    """the allocation sites behind it"""
    fixes: list[Fix] = field(default_factory=list[Fix])
    """what to do, first the one to try first"""
    prediction: dict[str, Any] | None = None
    """the first fix's prediction"""
    per_rank_bytes: dict[int, int] = field(default_factory=dict[int, int])
    """bytes at stake per rank (keys: rank numbers)"""
    variant: str = ""
    """which wording of its title and summary applies (the JSON has the words, ``title`` and ``summary``)"""
    related: list[str] = field(default_factory=list[str])
    """ids of the other findings on its ranks with one of its allocation sites: the same tensors seen by another
    detector (schema 2.2)"""

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
