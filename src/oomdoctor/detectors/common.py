"""Helpers the detectors share: stack predicates and site references."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from ..analysis.device import DeviceAnalysis
from ..analysis.sites import frame_text, site_index, site_label, stack_text
from ..trace.model import Trace
from .finding import SiteRef

MAX_SITES = 5


class SiteLike(Protocol):
    """What :func:`site_refs` reads of a site: a :class:`~oomdoctor.analysis.sites.Site`, or a holder
    (:class:`~oomdoctor.analysis.holders.Holder`), which has a site's fields."""

    @property
    def frame(self) -> int: ...

    @property
    def bytes(self) -> int: ...

    @property
    def count(self) -> int: ...

    @property
    def stack(self) -> int: ...


def site_refs(a: DeviceAnalysis, sites: Sequence[SiteLike], limit: int = MAX_SITES) -> list[SiteRef]:
    idx = site_index(a.trace)
    out: list[SiteRef] = []
    for s in sites[:limit]:
        uf = idx.user_frame(s.stack)
        out.append(SiteRef(label=site_label(a.trace, s.frame), bytes=s.bytes, count=s.count,
                           stack=stack_text(a.trace, s.stack),
                           user_frame=frame_text(a.trace, uf) if uf >= 0 else None))
    return out


def stacks_matching(trace: Trace, path_part: str, names: tuple[str, ...] | None = None,
                    innermost_python: bool = False) -> np.ndarray:
    """Boolean mask over stack ids: stacks with a frame whose filename contains ``path_part`` (and whose
    function is in ``names``, when given). With ``innermost_python``, only the innermost ``.py`` frame
    is looked at."""
    mask = np.zeros(len(trace.stacks) + 1, dtype=bool)  # last slot: stack -1
    frames = trace.stacks.frames
    for sid, fids in enumerate(trace.stacks.stacks):
        cand = fids
        if innermost_python:
            first = next((f for f in fids if frames[f][0].endswith(".py")), None)
            cand = (first,) if first is not None else ()
        for f in cand:
            fn, _, name = frames[f]
            if path_part in fn and (names is None or name in names):
                mask[sid] = True
                break
    return mask


def rows_with(mask: np.ndarray, stacks: np.ndarray) -> np.ndarray:
    """``mask`` (from :func:`stacks_matching`) looked up for an array of stack ids (-1 allowed)."""
    return mask[np.where(stacks >= 0, stacks, mask.shape[0] - 1)]
