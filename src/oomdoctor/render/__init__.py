"""Renderers: they format and lay out what the report computed; they never compute."""

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:  # the lazy names, for the type checker (nothing is imported at run time)
    from .json import render_json, render_simulation_json, report_dict, simulation_dict
    from .text import render_simulation_text, render_text

# Names load their module on first use (PEP 562), so importing one submodule does not import them all.
__getattr__ = lazy_attributes(__name__, {
    "render_json": "json",
    "render_simulation_json": "json",
    "report_dict": "json",
    "simulation_dict": "json",
    "render_simulation_text": "text",
    "render_text": "text",
})


__all__ = ["render_json", "render_simulation_json", "render_simulation_text", "render_text", "report_dict",
           "simulation_dict"]
