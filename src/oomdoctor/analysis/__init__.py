"""Pure analyses of a :class:`~oomdoctor.trace.Trace`: no I/O, no printing.

:func:`analyze` bundles what most consumers need for one rank (lifetimes, timeline, steps, and the
fragmentation anatomy at the peak / OOM / end, computed on first use).
"""

from .accounting import CATEGORIES, Accounting, Breakdown
from .device import DeviceAnalysis, analyze
from .fragmentation import Anatomy, PoolAnatomy, anatomy
from .iterations import find_steps, step_growth
from .lifetimes import Lifetimes, lifetimes
from .phases import PHASE_NAMES, Phases, Steps
from .sites import Site, group_sites, site_label, sites_at
from .timeline import Timeline, timeline

__all__ = ["CATEGORIES", "PHASE_NAMES", "Accounting", "Anatomy", "Breakdown", "DeviceAnalysis", "Phases", "Lifetimes", "PoolAnatomy", "Site", "Steps", "Timeline", "analyze",
           "anatomy", "find_steps", "group_sites", "lifetimes", "site_label", "sites_at", "step_growth",
           "timeline"]
