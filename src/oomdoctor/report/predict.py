"""Predictions for fixes: replay the trace with the fix applied (:mod:`..simulate`).

Only fixes whose detector says how to replay them (``Fix.what_if``) are simulated, on the rank with the
most bytes at stake, once per distinct experiment, so ``diagnose`` pays for a few replays of the
findings' own traces and nothing else. Each prediction is only as trustworthy as the self-replay of
the recorded settings, so that result travels with it (``self_replay_exact``).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from ..analysis.device import DeviceAnalysis
from ..detectors.finding import Finding
from ..simulate.capacity import infer_capacity
from ..simulate.config import DEFAULT, AllocatorConfig, parse_config
from ..simulate.replay import RECORDED, Prepared, ReplayResult, SimulationError, prepare, replay


def _on_top(base: AllocatorConfig, text: str) -> AllocatorConfig:
    """``base`` with the options ``text`` sets (the fix changes one setting, keeps the others)."""
    parsed = parse_config(text)
    changes = {f.name: getattr(parsed, f.name) for f in fields(AllocatorConfig)
               if f.compare and getattr(parsed, f.name) != getattr(DEFAULT, f.name)}
    return replace(base, **changes)


class _Predictor:
    def __init__(self, analysis: DeviceAnalysis) -> None:
        self.analysis = analysis
        self.prepared: Prepared = prepare(analysis.trace, analysis.device, analysis.lifetimes)
        self.capacity = infer_capacity(analysis.trace, analysis.device)
        self.self_replay = replay(self.prepared, capacity=self.capacity)
        self.cache: dict[tuple, ReplayResult] = {}

    def run(self, what_if: dict[str, str]) -> dict[str, Any]:
        config = self.prepared.recorded_config
        if what_if.get("config"):
            config = _on_top(config, what_if["config"])
        mode = what_if.get("deferred_frees", RECORDED)
        key = (config, mode)
        if key not in self.cache:
            self.cache[key] = replay(self.prepared, config, deferred_frees=mode, capacity=self.capacity)
        r = self.cache[key]
        peak, _ = self.analysis.peak_reserved
        return {
            "rank": self.analysis.rank,
            "config": config.to_string(),
            "deferred_frees": mode,
            "peak_reserved_bytes": r.peak_reserved_bytes,
            "recorded_peak_reserved_bytes": int(peak),
            "oom": None if r.oom is None else {"event_index": r.oom.event_index,
                                                 "requested_bytes": r.oom.requested_bytes},
            "recorded_oom_event_index": self.prepared.recorded_oom,
            "capacity_bytes": self.capacity.limit_bytes,
            "capacity_kind": self.capacity.kind,
            "self_replay_exact": self.self_replay.matches_recorded,
        }


def attach_predictions(findings: list[Finding], analyses: list[DeviceAnalysis]) -> None:
    """Fill ``Fix.prediction`` for every fix with a ``what_if`` and ``Finding.prediction`` with the first
    one. Mutates ``findings``. A trace the simulator cannot replay leaves its predictions empty."""
    by_rank = {a.rank: a for a in analyses}
    predictors: dict[int, _Predictor | None] = {}
    for f in findings:
        wanted = [fx for fx in f.fixes if fx.what_if]
        if not wanted:
            continue
        rank = max(f.ranks, key=lambda r: f.per_rank_bytes.get(r, 0)) if f.ranks else None
        a = by_rank.get(rank)
        if a is None or not a.trace.has_history:
            continue
        if rank not in predictors:
            try:
                predictors[rank] = _Predictor(a)
            except SimulationError:
                predictors[rank] = None
        p = predictors[rank]
        if p is None:
            continue
        for fx in wanted:
            fx.prediction = p.run(fx.what_if)
        f.prediction = wanted[0].prediction
