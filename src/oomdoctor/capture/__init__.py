"""Recording CUDA memory snapshots: the :class:`Recorder` (``oomdoctor.record``), its files and
sidecar, the gathering of the in-job summary, and what ``oomdoctor run``'s injected ``sitecustomize``
(:mod:`oomdoctor.cli.inject`) sets up (:mod:`~oomdoctor.capture.autorecord`).

The only part of oomdoctor that imports torch, and only inside functions: importing this package
works without torch.
"""

from .files import CaptureError
from .recorder import DEFAULT_MAX_ENTRIES, Recorder, parse_steps

__all__ = ["DEFAULT_MAX_ENTRIES", "CaptureError", "Recorder", "parse_steps"]
