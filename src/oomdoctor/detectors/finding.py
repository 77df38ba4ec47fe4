"""What a detector reports: a :class:`Finding` with its evidence and fixes, as data (issue 37).

A finding is its ``id``, ``severity``, a ``variant`` naming which of its wordings applies, the bytes at stake and
the numbers of its ``evidence``; a fix is a stable ``id`` with its versions, source, kind and setting. No sentence
is written here: the words of every finding id + variant and every fix id are in
:mod:`oomdoctor.render.words.findings`, and only the renderers (text, JSON, HTML) use them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

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


def absent() -> Any:
    """The default of an :class:`Evidence` field that a finding has only sometimes: None, and then left out of
    :meth:`Evidence.as_dict` (and of the JSON); its schema does not require it."""
    return field(default=None, metadata={"absent_when_none": True})


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """The numbers behind a finding: one subclass per finding kind, beside its detector (its fields, each with its
    unit in the docstring under it, are that kind's ``evidence`` in the JSON). ``FINDING`` is the detector's id and
    ``VARIANTS`` the variants (:attr:`Finding.variant`) whose evidence the subclass is. The fields here are the
    materiality rule's (:mod:`oomdoctor.detectors.materiality`), set on any kind, after its own fields in the JSON.

    :meth:`as_dict` is the evidence as the renderers read it, field name -> value, in the JSON's order; a field
    declared with :func:`absent` is left out while None."""

    __pydantic_config__ = {"use_attribute_docstrings": True}  # a plain dict: pydantic reads it, nothing imports it

    FINDING: ClassVar[str] = ""
    VARIANTS: ClassVar[tuple[str, ...]] = ("",)

    claimed_bytes: int | None = absent()
    """what the detector claimed at stake, where the materiality rule lowered it (bytes; absent where it did not)"""
    simulated_saving_bytes: int | None = absent()
    """what the finding's own simulated fix saves of peak reserved, where that is less than the claim (bytes; absent
    otherwise)"""
    materiality_threshold_bytes: int | None = absent()
    """the threshold under which the materiality rule made the finding LOW (bytes; absent where it did not)"""
    severity_before_materiality: str | None = absent()
    """the severity the detector gave, before the materiality rule made it LOW (absent where it did not)"""

    def as_dict(self) -> dict[str, Any]:
        """Field name -> value (nested dataclasses as dicts, as :func:`dataclasses.asdict`): the kind's own fields in
        their order, then the materiality rule's; fields declared :func:`absent` left out while None."""
        d = asdict(self)
        base = {f.name for f in fields(Evidence)}
        order = [f for f in fields(self) if f.name not in base] + [f for f in fields(self) if f.name in base]
        return {f.name: d[f.name] for f in order if not (d[f.name] is None and f.metadata.get("absent_when_none"))}


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
    evidence: Evidence = field(default_factory=Evidence)
    """the numbers behind it, one object per finding kind (bytes in keys ending _bytes, event indices in keys ending
    _event or _index)"""
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
        return FindingTitle(self.id, self.variant, self.evidence.as_dict())

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")


class FindingTitle(NamedTuple):
    """A finding's title as data: what a verdict's evidence holds where it names the finding that decides it
    (``report/verdict.py`` ``with_findings``); the renderers fill it from
    :func:`oomdoctor.render.words.findings.resolve_title`. ``evidence`` is the finding's :meth:`Evidence.as_dict`
    (a verdict's evidence is plain data, which a report's JSON round trip keeps as it is)."""

    id: str
    variant: str
    evidence: dict[str, Any]
