"""The report: all numbers computed, ready for a renderer."""

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:  # the lazy names, for the type checker (nothing is imported at run time)
    from .model import OomInfo, RankSummary, Report
    from .pipeline import build_report

# Names load their module on first use (PEP 562), so importing one submodule does not import them all.
__getattr__ = lazy_attributes(__name__, {
    "build_report": "pipeline",
    "OomInfo": "model",
    "RankSummary": "model",
    "Report": "model",
})


__all__ = ["OomInfo", "RankSummary", "Report", "build_report"]
