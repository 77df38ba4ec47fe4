"""Detectors of memory anti-patterns: one module each, gathered in :mod:`.registry`."""

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:  # the lazy names, for the type checker (nothing is imported at run time)
    from .context import Context
    from .finding import Finding, FindingTitle, Fix, SiteRef
    from .registry import DETECTORS, run_all

# Names load their module on first use (PEP 562), so importing one submodule does not import them all.
__getattr__ = lazy_attributes(__name__, {
    "Context": "context",
    "Finding": "finding",
    "FindingTitle": "finding",
    "Fix": "finding",
    "SiteRef": "finding",
    "DETECTORS": "registry",
    "run_all": "registry",
})


__all__ = ["DETECTORS", "Context", "Finding", "FindingTitle", "Fix", "SiteRef", "run_all"]
