"""The GPU a traced job is predicted for, as the kernels' choices need it: compute capability (which attention
kernel CUDA takes, :mod:`.attention`) and streaming multiprocessors (how a reduction splits its input across
blocks, :mod:`.reduce`). Set by :func:`target_gpu` around a trace; an H100/H200 (sm90, 132 SMs) when unset."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

from ..plan.gpus import sms_of_major


@dataclass(frozen=True, kw_only=True)
class Target:
    """One GPU's properties as CUDA reports them."""

    sm_major: int = 9
    sm_minor: int = 0
    sms: int = 132
    """``multiProcessorCount``"""
    max_threads_per_sm: int = 2048
    """``maxThreadsPerMultiProcessor``: 2048 on sm80, sm90 and sm100 (CUDA C++ Programming Guide, compute
    capabilities table)"""


_TARGET: contextvars.ContextVar[Target] = contextvars.ContextVar("oomdoctor_preflight_target", default=Target())


def current() -> Target:
    """The target GPU of the trace running now."""
    return _TARGET.get()


@contextlib.contextmanager
def target_gpu(sm_major: int, sm_minor: int = 0, *, sms: int | None = None) -> Iterator[None]:
    """While active, kernels are chosen and sized as on a GPU of compute capability ``sm_major.sm_minor`` with
    ``sms`` streaming multiprocessors (when None, the GPU table's for that major: ``plan.gpus.sms_of_major``)."""
    token = _TARGET.set(Target(sm_major=sm_major, sm_minor=sm_minor,
                               sms=sms if sms is not None else sms_of_major(sm_major)))
    try:
        yield
    finally:
        _TARGET.reset(token)
