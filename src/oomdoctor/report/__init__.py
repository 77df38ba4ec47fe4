"""The report: all numbers computed, ready for a renderer."""

# Names load their module on first use (PEP 562), so importing one submodule does not import them all.
_LAZY = {
    "build_report": "build",
    "OomInfo": "model",
    "RankSummary": "model",
    "Report": "model",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["OomInfo", "RankSummary", "Report", "build_report"]
