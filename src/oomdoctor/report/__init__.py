"""The report: all numbers computed, ready for a renderer."""

from .build import build_report
from .model import OomInfo, RankSummary, Report

__all__ = ["OomInfo", "RankSummary", "Report", "build_report"]
