"""Recording CUDA memory snapshots: the :class:`Recorder` (``oomdoctor.record``), its files and
sidecar, the gathering of the in-job summary, and what ``oomdoctor run``'s injected ``sitecustomize``
(:mod:`oomdoctor.cli.inject`) sets up (:mod:`~oomdoctor.capture.autorecord`).

The only part of oomdoctor that imports torch, and only inside functions: importing this package
works without torch.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes
from .files import CaptureError

if TYPE_CHECKING:  # the lazy names, for the type checker (nothing is imported at run time)
    from .recorder import DEFAULT_MAX_ENTRIES, Recorder, parse_steps

# the recorder (and the sidecar's modules: socket, ...) only where it is used: `oomdoctor diagnose` imports
# capture.files to write its output, and nothing else of this package (start-up: docs/benchmarks.md)
__getattr__ = lazy_attributes(__name__, {"DEFAULT_MAX_ENTRIES": "recorder", "Recorder": "recorder",
                                         "parse_steps": "recorder"})

__all__ = ["DEFAULT_MAX_ENTRIES", "CaptureError", "Recorder", "parse_steps"]
