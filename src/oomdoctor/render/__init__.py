"""Renderers: they format and lay out what the report computed; they never compute."""

from .json import render_json, render_simulation_json, report_dict, simulation_dict
from .text import render_simulation_text, render_text

__all__ = ["render_json", "render_simulation_json", "render_simulation_text", "render_text", "report_dict",
           "simulation_dict"]
