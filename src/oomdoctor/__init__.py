"""oomdoctor: find, explain and fix GPU memory problems in distributed PyTorch training.

Public API::

    trace = oomdoctor.load("rank0.pickle")             # one snapshot -> Trace
    traces = oomdoctor.load_ranks(["snapshots/"])      # files/directories -> one Trace per rank
    report = oomdoctor.diagnose(["snapshots/"])        # analyses + findings
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import OomdoctorError, SnapshotError, UnsafeSnapshotError  # noqa: E402
from .trace import Trace, load, load_ranks  # noqa: E402


def diagnose(paths, *, progress=None):
    """Load ``paths`` (files or directories of per-rank snapshots) and return the :class:`~oomdoctor.report.Report`.

    Raises:
        SnapshotError: an input cannot be read as a snapshot (the message names the file).
    """
    from .report import build_report

    return build_report(load_ranks(paths, progress=progress))


__all__ = ["OomdoctorError", "SnapshotError", "Trace", "UnsafeSnapshotError", "__version__", "diagnose", "load",
           "load_ranks"]
