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

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

# ``replay`` is both a submodule and a function: imported here, or the submodule, once imported
# anywhere, would shadow the function.
from .replay import IMMEDIATE, RECORDED, ReplayResult, SimulationError, prepare, replay  # noqa: E402

if TYPE_CHECKING:  # the lazy names, for the type checker (nothing is imported at run time)
    from .capacity import Capacity, infer_capacity, parse_bytes
    from .config import AllocatorConfig, ConfigError, config_from_settings, parse_config
    from .whatif import Simulation, simulate

# Other names load their module on first use (PEP 562), so importing one submodule does not import them all.
__getattr__ = lazy_attributes(__name__, {
    "Capacity": "capacity",
    "infer_capacity": "capacity",
    "parse_bytes": "capacity",
    "AllocatorConfig": "config",
    "ConfigError": "config",
    "config_from_settings": "config",
    "parse_config": "config",
    "Simulation": "whatif",
    "simulate": "whatif",
})


__all__ = ["IMMEDIATE", "RECORDED", "AllocatorConfig", "Capacity", "ConfigError", "ReplayResult", "Simulation",
           "SimulationError", "config_from_settings", "infer_capacity", "parse_bytes", "parse_config", "prepare",
           "replay", "simulate"]
