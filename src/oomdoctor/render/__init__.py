"""Renderers: they format and lay out what the report computed; they never compute."""

from .json import render_json, report_dict
from .text import render_text

__all__ = ["render_json", "render_text", "report_dict"]
