"""Pure analyses of a :class:`~oomdoctor.trace.Trace`: no I/O, no printing.

:func:`analyze` bundles what most consumers need for one rank (lifetimes, timeline, steps, and the
fragmentation anatomy at the peak / OOM / end, computed on first use).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

# ``lifetimes`` and ``timeline`` are both a submodule and a function: imported here, or the submodule,
# once imported anywhere, would shadow the function.
from .lifetimes import Lifetimes, lifetimes  # noqa: E402
from .timeline import Timeline, timeline  # noqa: E402

if TYPE_CHECKING:  # the lazy names, for the type checker (nothing is imported at run time)
    from .accounting import CATEGORIES, Accounting, Breakdown
    from .device import DeviceAnalysis, analyze
    from .fragmentation import Anatomy, PoolAnatomy, anatomy
    from .iterations import find_steps, step_growth
    from .phases import PHASE_NAMES, Phases, Steps
    from .sites import Site, group_sites, site_label, sites_at

# Other names load their module on first use (PEP 562), so importing one submodule does not import them all.
__getattr__ = lazy_attributes(__name__, {
    "CATEGORIES": "accounting",
    "Accounting": "accounting",
    "Breakdown": "accounting",
    "DeviceAnalysis": "device",
    "analyze": "device",
    "Anatomy": "fragmentation",
    "PoolAnatomy": "fragmentation",
    "anatomy": "fragmentation",
    "find_steps": "iterations",
    "step_growth": "iterations",
    "PHASE_NAMES": "phases",
    "Phases": "phases",
    "Steps": "phases",
    "Site": "sites",
    "group_sites": "sites",
    "site_label": "sites",
    "sites_at": "sites",
})


__all__ = ["CATEGORIES", "PHASE_NAMES", "Accounting", "Anatomy", "Breakdown", "DeviceAnalysis", "Phases", "Lifetimes", "PoolAnatomy", "Site", "Steps", "Timeline", "analyze",
           "anatomy", "find_steps", "group_sites", "lifetimes", "site_label", "sites_at", "step_growth",
           "timeline"]
