"""Detectors of memory anti-patterns: one module each, gathered in :mod:`.registry`."""

from .._lazy import lazy_attributes

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
