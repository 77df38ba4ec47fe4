"""Renderers: they format and lay out what the report computed; they never compute."""

# Names load their module on first use (PEP 562), so importing one submodule does not import them all.
_LAZY = {
    "render_json": "json",
    "render_simulation_json": "json",
    "report_dict": "json",
    "simulation_dict": "json",
    "render_simulation_text": "text",
    "render_text": "text",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["render_json", "render_simulation_json", "render_simulation_text", "render_text", "report_dict",
           "simulation_dict"]
