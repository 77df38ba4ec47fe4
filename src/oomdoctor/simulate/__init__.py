"""Replay recorded traces through a model of PyTorch's CUDA caching allocator and answer "what if".

``config``: allocator settings from ``PYTORCH_CUDA_ALLOC_CONF`` strings and snapshots; ``allocator``:
the model; ``capacity``: the memory limit; ``replay``: trace -> model, with validation against the
recording; ``whatif``: several settings, the ``--search`` grid and the recommendation.

From Python::

    from oomdoctor import load
    from oomdoctor.simulate import simulate
    sim = simulate(load("rank0.pickle"), configs=["expandable_segments:True"], search=True)
    sim.self_replay.matches_recorded, [(str(r.config), r.peak_reserved_bytes, r.oom) for r in sim.results]
"""

from .capacity import Capacity, infer_capacity, parse_bytes
from .config import AllocatorConfig, ConfigError, config_from_settings, parse_config
from .replay import IMMEDIATE, RECORDED, ReplayResult, SimulationError, prepare, replay
from .whatif import Simulation, simulate

__all__ = ["IMMEDIATE", "RECORDED", "AllocatorConfig", "Capacity", "ConfigError", "ReplayResult", "Simulation",
           "SimulationError", "config_from_settings", "infer_capacity", "parse_bytes", "parse_config", "prepare",
           "replay", "simulate"]
