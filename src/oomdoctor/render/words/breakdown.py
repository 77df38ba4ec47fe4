"""The words of what holds a rank's memory (:class:`oomdoctor.analysis.accounting.Breakdown`, as the report carries
it): its categories, how its phase was told, the moment it was taken at, and why some of it is unknown.

These ids are the accounting's own strings, not yet :mod:`oomdoctor.ids` Literal types, so the tables are plain
dicts that :func:`oomdoctor.render.words.table.table` does not check against a tuple of ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..format import format_bytes

if TYPE_CHECKING:  # annotations only
    from ...analysis.accounting import Breakdown

CATEGORY_LABEL = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
                  "activations": "activations", "temporaries": "temporaries", "communication": "communication",
                  "outputs": "outputs kept", "kv_cache": "KV cache", "workspaces": "workspaces",
                  "weight_copy": "weight copies (frozen, EMA)", "buffers": "module buffers",
                  "unknown": "unknown", "rounding": "allocator rounding"}
"""A category of the breakdown (``Breakdown.categories``, a holder's ``category``), as a noun."""

PHASE_SOURCE = {"markers": "marked by the framework", "annotations": "from PyTorch's annotations",
                "autograd engine thread": "from the autograd engine's thread", "frames": "from the call stacks",
                "inferred": "guessed from the blocks' lifetimes"}
"""How the phase was told (``Breakdown.phase_source``), in words."""

AT_LABEL = {"oom": "at the OOM", "peak_allocated": "at the peak of allocated memory",
            "peak_reserved": "at the peak of reserved memory", "optimizer_start": "before the optimizer step",
            "backward_end": "at the end of a backward"}
"""The event the breakdown was taken at (``Breakdown.at``), as a place in the run; an event not here is said as its
id (:func:`at`)."""

UNKNOWN_WHY = {"before_trace_no_stack": "born before the trace, no stack of their allocation left (the ring buffer "
                                       "dropped it, or recording began after it): nothing says what they are",
               "before_trace": "born before the trace; their stack places nothing",
               "frozen_or_buffer": "module state of a size no trained parameter has: frozen weights or registered "
                                   "buffers (record with oomdoctor run to tell them apart)",
               "copy_or_buffer": "module state of a trained parameter's size beyond its gradients that copies no "
                                 "whole model: buffers (BatchNorm's statistics) or part of a model kept frozen"}
"""Why bytes of the ``unknown`` category are not placed (``Breakdown.unknown_why``'s keys); a reason not here is not
said."""

SMALL_CATEGORY_BYTES = 1 << 20
"""Categories under this (1 MiB) are said in one term after the others, summed and named (``12.80 KiB in allocator
rounding and outputs kept``), so that a 4-byte loss scalar kept across steps does not read as a category of the
breakdown (issue 52); the terms still add up to the allocated bytes."""


def at(bd: Breakdown) -> str:
    """The event the breakdown ``bd`` was taken at, in words (:data:`AT_LABEL`), its id where it has none."""
    return AT_LABEL.get(bd.at, bd.at)


def _by_size(bd: Breakdown) -> list[tuple[str, int]]:
    """A breakdown's non-empty categories, largest first."""
    return sorted(((c, b) for c, b in bd.categories.items() if b), key=lambda x: -x[1])


def terms(bd: Breakdown) -> list[str]:
    """A breakdown's categories as terms, largest first (``activations 7.49 GiB``), those under
    :data:`SMALL_CATEGORY_BYTES` in one last term."""
    parts = _by_size(bd)
    big = [(c, b) for c, b in parts if b >= SMALL_CATEGORY_BYTES]
    small = [(c, b) for c, b in parts if b < SMALL_CATEGORY_BYTES]
    out = [f"{CATEGORY_LABEL[c]} {format_bytes(b)}" for c, b in big]
    if len(small) == 1 and not big:
        out.append(f"{CATEGORY_LABEL[small[0][0]]} {format_bytes(small[0][1])}")
    elif small:
        names = [CATEGORY_LABEL[c] for c, _ in small]
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
    """Why the unknown bytes are not placed (:data:`UNKNOWN_WHY`); None where no reason is said."""
    named: list[str]
    """The weight copies and the module buffers the trace names, a line each (four of each at most)."""


def said(bd: Breakdown) -> Said:
    """The breakdown ``bd`` in words: the lines the terminal prints for it, above its largest holders."""
    step = f"step {bd.step}, " if bd.step is not None else ""
    total = (f"{at(bd)} ({step}{bd.phase} phase, {PHASE_SOURCE.get(bd.phase_source, bd.phase_source)}): "
             f"{format_bytes(bd.allocated_bytes)} allocated = " + (" + ".join(terms(bd)) or "nothing"))
    recorded = sorted(c for c, src in bd.sources.items() if src == "recorded")
    source = (", ".join(CATEGORY_LABEL[c] for c in recorded) + " as oomdoctor run recorded them; the other "
              "categories from the allocation trace" if recorded else
              "every category from the allocation trace (its stacks, annotations and lifetimes)")
    why = {k: v for k, v in bd.unknown_why.items() if k in UNKNOWN_WHY}
    unknown = ("unknown: " + "; ".join(f"{format_bytes(v)} {UNKNOWN_WHY[k]}" for k, v in why.items())
               if why else None)
    named = []
    for line, by in (("weight copies", bd.weight_copy_by), ("module buffers", bd.buffers_by)):
        kept = {k: v for k, v in by.items() if k != "unnamed"}
        if kept:
            named.append(f"{line}: " + "; ".join(f"{format_bytes(v)} {k}" for k, v in list(kept.items())[:4]))
    return Said(total=total, source=source, unknown=unknown, named=named)
