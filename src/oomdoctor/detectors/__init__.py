"""Detectors of memory anti-patterns: one module each, gathered in :mod:`.registry`."""

from .context import Context
from .finding import Finding, Fix, SiteRef
from .registry import DETECTORS, run_all

__all__ = ["DETECTORS", "Context", "Finding", "Fix", "SiteRef", "run_all"]
