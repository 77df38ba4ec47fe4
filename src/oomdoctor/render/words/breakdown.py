"""The words of what holds a rank's memory (:class:`oomdoctor.analysis.accounting.Breakdown`, as the report carries
it): its lines (the categories and the allocator's rounding, :data:`oomdoctor.ids.BREAKDOWN_LINES`), how its phase
was told (:data:`oomdoctor.ids.PHASE_SOURCES`), the event it was taken at (:data:`oomdoctor.ids.BREAKDOWN_POINTS`)
and why some of it is unknown (:data:`oomdoctor.ids.UNKNOWN_WHYS`): one table per kind of id, each checked against
the core's ids when this module is imported (:func:`oomdoctor.render.words.table.table`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...ids import (
    BREAKDOWN_LINES,
    BREAKDOWN_POINTS,
    PHASE_SOURCES,
    UNKNOWN_WHYS,
    BreakdownCategory,
    BreakdownLine,
    UnknownWhy,
)
from ..format import format_bytes
from .table import Words, table, text

if TYPE_CHECKING:  # annotations only
    from ...analysis.accounting import Breakdown

LINES = table("breakdown line", BREAKDOWN_LINES, {
    "parameters": Words(text="parameters"),
    "gradients": Words(text="gradients"),
    "optimizer_state": Words(text="optimizer state"),
    "activations": Words(text="activations"),
    "temporaries": Words(text="temporaries"),
    "communication": Words(text="communication"),
    "outputs": Words(text="outputs kept"),
    "kv_cache": Words(text="KV cache"),
    "workspaces": Words(text="workspaces"),
    "weight_copy": Words(text="weight copies (frozen, EMA)"),
    "buffers": Words(text="module buffers"),
    "unknown": Words(text="unknown"),
    "rounding": Words(text="allocator rounding"),
})
"""A line of the breakdown (``Breakdown.categories``' keys, a holder's ``category``), as a noun."""

PHASE_SOURCES_SAID = table("phase source", PHASE_SOURCES, {
    "markers": Words(text="marked by the framework"),
    "annotations": Words(text="from PyTorch's annotations"),
    "autograd engine thread": Words(text="from the autograd engine's thread"),
    "frames": Words(text="from the call stacks"),
    "inferred": Words(text="guessed from the blocks' lifetimes"),
})
"""How the phase was told (``Breakdown.phase_source``), in words."""

POINTS = table("breakdown point", BREAKDOWN_POINTS, {
    "oom": Words(text="at the OOM"),
    "peak_allocated": Words(text="at the peak of allocated memory"),
    "peak_reserved": Words(text="at the peak of reserved memory"),
    "optimizer_start": Words(text="before the optimizer step"),
    "backward_end": Words(text="at the end of a backward"),
})
"""The event the breakdown was taken at (``Breakdown.at``), as a place in the run."""

UNKNOWN = table("unknown reason", UNKNOWN_WHYS, {
    "before_trace_no_stack": Words(text="born before the trace, no stack of their allocation left (the ring buffer "
                                        "dropped it, or recording began after it): nothing says what they are"),
    "before_trace": Words(text="born before the trace; their stack places nothing"),
    "in_trace": Words(description=("born in the trace, and no lifetime, gradient or frame says what they are: not "
                                   "said, the unknown bytes say it")),
    "frozen_or_buffer": Words(text="module state of a size no trained parameter has: frozen weights or registered "
                                   "buffers (record with oomdoctor run to tell them apart)"),
    "copy_or_buffer": Words(text="module state of a trained parameter's size beyond its gradients that copies no "
                                 "whole model: buffers (BatchNorm's statistics) or part of a model kept frozen"),
})
"""Why bytes of the ``unknown`` category are not placed (``Breakdown.unknown_why``'s keys); a reason without words
(``in_trace``) is not said."""


def line(id_: BreakdownLine) -> str:
    """A line of the breakdown (a category, or the rounding) as a noun (:data:`LINES`). Raises KeyError for an id
    that is not a line."""
    return text(LINES, id_)


def at(bd: Breakdown) -> str:
    """The event the breakdown ``bd`` was taken at, as a place in the run (:data:`POINTS`); its id where it is none
    of them (a report read back from a JSON another version wrote)."""
    return text(POINTS, bd.at) if bd.at in POINTS else bd.at


def phase_source(bd: Breakdown) -> str:
    """How the phase of ``bd`` was told, in words (:data:`PHASE_SOURCES_SAID`); its id where it is none of them."""
    return text(PHASE_SOURCES_SAID, bd.phase_source) if bd.phase_source in PHASE_SOURCES_SAID else bd.phase_source


def unknown_why(id_: UnknownWhy) -> str | None:
    """Why unknown bytes are not placed, in words; None for a reason not said (:data:`UNKNOWN`), or one that is none
    of them."""
    w = UNKNOWN.get(id_)
    return w.text if w is not None else None


SMALL_CATEGORY_BYTES = 1 << 20
"""Categories under this (1 MiB) are said in one term after the others, summed and named (``12.80 KiB in allocator
rounding and outputs kept``), so that a 4-byte loss scalar kept across steps does not read as a category of the
breakdown (issue 52); the terms still add up to the allocated bytes."""


def _by_size(bd: Breakdown) -> list[tuple[BreakdownLine, int]]:
    """A breakdown's non-empty categories, largest first."""
    return sorted(((c, b) for c, b in bd.categories.items() if b), key=lambda x: -x[1])


def terms(bd: Breakdown) -> list[str]:
    """A breakdown's categories as terms, largest first (``activations 7.49 GiB``), those under
    :data:`SMALL_CATEGORY_BYTES` in one last term."""
    parts = _by_size(bd)
    big: list[tuple[BreakdownLine, int]] = [(c, b) for c, b in parts if b >= SMALL_CATEGORY_BYTES]
    small: list[tuple[BreakdownLine, int]] = [(c, b) for c, b in parts if b < SMALL_CATEGORY_BYTES]
    out = [f"{line(c)} {format_bytes(b)}" for c, b in big]
    if len(small) == 1 and not big:
        out.append(f"{line(small[0][0])} {format_bytes(small[0][1])}")
    elif small:
        names = [line(c) for c, _ in small]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        out.append(f"{format_bytes(sum(b for _, b in small))} in {listed}")
    return out


@dataclass(frozen=True)
class Said:
    """A breakdown in the words the terminal says it with, one attribute a line (each its own style there)."""

    total: str
    """Where it was taken, how its phase was told, the bytes allocated then and its categories, largest first
    (:func:`terms`): ``at the OOM (step 3, forward phase, marked by the framework): 9.50 GiB allocated = activations
    7.49 GiB + parameters 1.20 GiB + ...``."""
    source: str
    """Where the categories come from: what ``oomdoctor run`` recorded, or the allocation trace."""
    unknown: str | None
    """Why the unknown bytes are not placed (:data:`UNKNOWN`); None where no reason is said."""
    named: list[str]
    """The weight copies and the module buffers the trace names, a line each (four of each at most)."""


def said(bd: Breakdown) -> Said:
    """The breakdown ``bd`` in words: the lines the terminal prints for it, above its largest holders."""
    step = f"step {bd.step}, " if bd.step is not None else ""
    total = (f"{at(bd)} ({step}{bd.phase} phase, {phase_source(bd)}): "
             f"{format_bytes(bd.allocated_bytes)} allocated = " + (" + ".join(terms(bd)) or "nothing"))
    recorded: list[BreakdownCategory] = sorted(c for c, src in bd.sources.items() if src == "recorded")
    source = (", ".join(line(c) for c in recorded) + " as oomdoctor run recorded them; the other "
              "categories from the allocation trace" if recorded else
              "every category from the allocation trace (its stacks, annotations and lifetimes)")
    why = [(v, unknown_why(k)) for k, v in bd.unknown_why.items()]
    unknown = ("unknown: " + "; ".join(f"{format_bytes(v)} {w}" for v, w in why if w)
               if any(w for _, w in why) else None)
    named = []
    for noun, by in (("weight copies", bd.weight_copy_by), ("module buffers", bd.buffers_by)):
        kept = {k: v for k, v in by.items() if k != "unnamed"}
        if kept:
            named.append(f"{noun}: " + "; ".join(f"{format_bytes(v)} {k}" for k, v in list(kept.items())[:4]))
    return Said(total=total, source=source, unknown=unknown, named=named)
