"""Predicting per-rank peak memory before a job runs, and the parallel plans that fit.

``specs`` (model, training, hardware, parallel plan, validation), ``terms`` (one cited function per
memory term), ``schedule`` (micro-batches in flight per pipeline rank), ``estimate`` (per stage),
``search`` (enumerate, fit, rank by a throughput model), ``validate`` (Megatron-LM CI goldens).
"""

from .estimate import Estimate, StageEstimate, estimate
from .search import SearchResult, search
from .specs import PRESETS, Hardware, ModelSpec, ParallelPlan, PlanError, TrainingSpec, model_spec

__all__ = ["PRESETS", "Estimate", "Hardware", "ModelSpec", "ParallelPlan", "PlanError", "SearchResult",
           "StageEstimate", "TrainingSpec", "estimate", "model_spec", "search"]
