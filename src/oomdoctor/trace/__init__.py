"""Safe loading of CUDA memory snapshots into the columnar :class:`Trace`."""

from .load import Skipped, discover, load, load_ranks, rank_from_name
from .model import Block, DeviceTrace, Segment, StackTable, Trace
from .store import load_trace, save_trace

__all__ = ["Block", "DeviceTrace", "Segment", "Skipped", "StackTable", "Trace", "discover", "load", "load_ranks",
           "load_trace", "rank_from_name", "save_trace"]
