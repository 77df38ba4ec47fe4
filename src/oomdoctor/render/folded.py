"""Folded stacks as text: ``frame;frame;frame BYTES``, one line per stack, root first (the format of
:mod:`oomdoctor.views.flame`, read by ``flamegraph.pl``, inferno and speedscope)."""

from __future__ import annotations

from ..views.flame import Folded


def render_folded(folded: Folded) -> str:
    """The lines of ``folded``, each ending in a newline; empty when nothing was allocated at that moment."""
    return "".join(f"{';'.join(frames)} {count}\n" for frames, count in folded.stacks)
