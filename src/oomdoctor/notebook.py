"""Results as Python and Jupyter show them: :func:`oomdoctor.diagnose`, :func:`oomdoctor.diff` and
:func:`oomdoctor.replay` return these.

Each wraps what the CLI renders (a :class:`~oomdoctor.report.model.Report` with its
:class:`~oomdoctor.views.visual.Visual`, a :class:`~oomdoctor.report.diff.Diff`, a
:class:`~oomdoctor.simulate.whatif.Simulation`), all computed when the object is made. In a notebook
``_repr_html_`` shows the same page as ``oomdoctor report`` / ``diff --format html`` inside an
``<iframe srcdoc>`` (its scripts and styles stay in the frame); ``str()`` is the terminal text; the
wrapped object's fields read through (``diagnosis.ranks``), and the texts a user reads come back rendered
(``diagnosis.verdict.summary``, ``diagnosis.findings[0].title``), as the CLI prints them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from .detectors.finding import Finding, Fix
from .render.html import embed, render_diff_html, render_html, render_simulation_html
from .render.json import render_diff_json, render_json, render_simulation_json
from .render.text import render_diff_text_plain, render_simulation_text_plain, render_text_plain
from .render.words import findings as finding_words
from .render.words import fits as fits_words
from .render.words import verdict as verdict_words
from .report.diff import Diff
from .report.model import Report
from .simulate.whatif import Simulation
from .views.overlay import DiffVisual
from .views.visual import Visual


class _Result:
    _wrapped: Any

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._wrapped, name)

    def __repr__(self) -> str:
        return str(self)


@dataclass
class SaidVerdict:
    """A verdict (:class:`~oomdoctor.report.verdict.Verdict`) with its ``summary`` and ``actions`` in words, as the
    CLI prints them; the other fields are the verdict's."""

    kind: str
    summary: str
    bytes: int
    ranks: list[int]
    headroom_bytes: int | None
    finding: str | None
    evidence: dict[str, Any]
    actions: list[str]
    reasons: list[str]
    to_do: list[Any]


def _filled_verdict(v):
    if v is None:
        return None
    return SaidVerdict(v.kind, verdict_words.summary(v), v.bytes, v.ranks, v.headroom_bytes, v.finding,
                       verdict_words.said_evidence(v.evidence), verdict_words.actions(v),
                       v.reasons, v.to_do)


def _said_fits(f):
    """A copy of ``f`` (a :class:`~oomdoctor.report.fits.Fits`) with its notes, assumptions and room in words, as the
    JSON has them (:mod:`oomdoctor.render.words.fits`)."""
    if f is None:
        return None
    return replace(f, **fits_words.said_fields(f))


@dataclass
class WordedFix(Fix):
    """A fix with its ``text`` as the CLI prints it (:mod:`oomdoctor.render.words.findings`)."""

    text: str = ""


@dataclass
class WordedFinding(Finding):
    """A finding with its ``title`` and ``summary`` as the CLI prints them, and its fixes worded."""

    title: str = ""
    summary: str = ""


def _filled_finding(f: Finding) -> WordedFinding:
    fixes = [WordedFix(**{k.name: getattr(fx, k.name) for k in fields(fx)}, text=finding_words.fix_text(fx))
             for fx in f.fixes]
    kw: dict[str, Any] = {k.name: getattr(f, k.name) for k in fields(f)} | {"fixes": fixes}
    return WordedFinding(**kw, title=finding_words.title(f), summary=finding_words.summary(f))


class Diagnosis(_Result):
    """A diagnosis: ``report`` (every number, texts as templates over their evidence), ``visual`` (what the
    HTML page draws), ``skipped`` (files of a directory that are not snapshots, with the reason, as the CLI
    names them); ``verdict``, ``findings`` and ``ranks`` (each rank's verdict) with their texts rendered."""

    def __init__(self, report: Report, visual: Visual, skipped: list | None = None) -> None:
        self.report, self.visual = report, visual
        self.skipped = list(skipped or [])
        self._wrapped = report

    @property
    def verdict(self):
        """The job's verdict with its ``summary`` and ``actions`` in words (:class:`SaidVerdict`; ``report.verdict`` holds
        the facts they are said from)."""
        return _filled_verdict(self.report.verdict)

    @property
    def findings(self) -> list:
        """The findings, most severe first, their ``title`` and ``summary`` rendered (copies)."""
        return [_filled_finding(f) for f in self.report.findings]

    @property
    def ranks(self) -> list:
        """Each rank's summary with its verdict and what fits rendered (copies)."""
        return [replace(r, verdict=_filled_verdict(r.verdict), fits=_said_fits(r.fits)) for r in self.report.ranks]

    def __str__(self) -> str:
        return render_text_plain(self.report)

    def to_html(self) -> str:
        """The self-contained page of ``oomdoctor report``."""
        return render_html(self.report, self.visual)

    def to_json(self) -> str:
        """``oomdoctor diagnose --format json``'s document."""
        return render_json(self.report)

    def _repr_html_(self) -> str:
        return embed(self.to_html())


class Comparison(_Result):
    """A before/after comparison: ``diff`` and what its page draws, ``visual`` (both runs on one axis, the bytes
    moved by call stack); ``skipped``: files of the runs' directories that are not snapshots."""

    def __init__(self, diff: Diff, visual: DiffVisual, skipped: list | None = None) -> None:
        self.diff, self.visual = diff, visual
        self.skipped = list(skipped or [])
        self._wrapped = diff

    def __str__(self) -> str:
        return render_diff_text_plain(self.diff)

    def to_html(self) -> str:
        return render_diff_html(self.diff, self.visual)

    def to_json(self) -> str:
        return render_diff_json(self.diff)

    def _repr_html_(self) -> str:
        return embed(self.to_html())


class Replay(_Result):
    """A replay through the allocator model and its what-ifs: ``simulation``."""

    def __init__(self, simulation: Simulation) -> None:
        self.simulation = simulation
        self._wrapped = simulation

    def __str__(self) -> str:
        return render_simulation_text_plain(self.simulation)

    def to_html(self) -> str:
        return render_simulation_html(self.simulation)

    def to_json(self) -> str:
        return render_simulation_json(self.simulation)

    def _repr_html_(self) -> str:
        return embed(self.to_html(), height_px=420)
