"""Detectors of memory anti-patterns: one module each, gathered in :mod:`.registry`."""

# Names load their module on first use (PEP 562), so importing one submodule does not import them all.
_LAZY = {
    "Context": "context",
    "Finding": "finding",
    "Fix": "finding",
    "SiteRef": "finding",
    "DETECTORS": "registry",
    "run_all": "registry",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DETECTORS", "Context", "Finding", "Fix", "SiteRef", "run_all"]
