"""The standard-error lines of a command's inputs and of its CI gate, as the CLI prints them: each line is the words
of :mod:`oomdoctor.render.words.gate` after ``oomdoctor:``. The CLI decides when to print; the sentences are here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .words import gate as words

if TYPE_CHECKING:
    from ..report.gate import Gate
    from ..report.model import Unread
    from ..trace.load import Skipped


def gate_line(asked: str, g: Gate) -> str | None:
    """The one line of a ``--fail-on`` gate (``asked``: the options as given, ``--fail-on high``): why it failed,
    or, where it passed, the note of a HIGH finding it let through; None where a passing gate has nothing to say."""
    if g.failed:
        return f"oomdoctor: {asked}: {words.why_failed(g)}"
    note = words.passed_note(g)
    return f"oomdoctor: {asked} {note}" if note else None


def skipped_files_line(skipped: list[Skipped]) -> str:
    """The one line naming the files that are not snapshots (:func:`oomdoctor.render.words.gate.skipped_line`)."""
    return f"oomdoctor: {words.skipped_line(skipped)}"


def unread_ranks_line(unread: list[Unread]) -> str:
    """The one line naming the rank files that could not be read (:func:`oomdoctor.render.words.gate.unread_line`)."""
    return f"oomdoctor: {words.unread_line(unread)}"


def preflight_oom_line(a: Any) -> str:
    """The one line of ``preflight --fail-on-oom`` when the prediction runs out of memory
    (:func:`oomdoctor.render.words.gate.preflight_oom`)."""
    return f"oomdoctor: --fail-on-oom: {words.preflight_oom(a)}"
