"""The central data type: a snapshot turned into columnar arrays.

A :class:`Trace` is one snapshot file (usually one rank). It holds, per CUDA device with anything
recorded, a :class:`DeviceTrace`: the trace events as numpy columns, and the final segments and blocks
(the point-in-time state ``torch.cuda.memory._snapshot()`` dumped). Frames and stacks are interned in
one :class:`StackTable` shared by every device of the file: each distinct frame and stack is stored once.

Field meanings follow PyTorch's ``torch/csrc/cuda/memory_snapshot.cpp`` / ``Module.cpp``
(``traceEntryToDict``, ``segmentInfoToDict``); see ``shared/reference/snapshot_format_and_peers.md`` §1.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

# Action codes of the ``action`` column. Order is part of the saved format: append only.
ALLOC = 0
FREE_REQUESTED = 1
FREE_COMPLETED = 2
SEGMENT_ALLOC = 3
SEGMENT_FREE = 4
SEGMENT_MAP = 5
SEGMENT_UNMAP = 6
SNAPSHOT = 7
OOM = 8
ANNOTATE = 9

ACTION_NAMES: tuple[str, ...] = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
    "annotate",
)
ACTION_CODES: dict[str, int] = {name: code for code, name in enumerate(ACTION_NAMES)}

# Block states of the final segments (the strings ``Module.cpp`` emits; ``active_awaiting_free`` is the
# spelling of the ``_snapshot`` docstring and is read as pending free).
BLOCK_ALLOCATED = "active_allocated"
BLOCK_PENDING_FREE = "active_pending_free"
BLOCK_INACTIVE = "inactive"

DEFAULT_POOL: tuple[int, int] = (0, 0)

#: the version of the ``.npz`` file :meth:`Trace.save` writes and :func:`~oomdoctor.trace.store.load_trace` reads
TRACE_FORMAT_VERSION = 1

#: Event columns: name -> dtype. ``stack``/``pool``/``user_metadata``/``compile_context`` are indices
#: into the trace's tables, -1 when absent; ``device_free`` is set only on ``oom`` events (else -1).
EVENT_COLUMNS: dict[str, type] = {
    "action": np.int8,
    "addr": np.int64,
    "size": np.int64,
    "stream": np.int64,
    "time_us": np.int64,
    "stack": np.int32,
    "pool": np.int32,
    "device_free": np.int64,
    "user_metadata": np.int32,
    "compile_context": np.int32,
}

Frame = tuple[str, int, str]
"""One stack frame: ``(filename, line, name)``; C++ frames have line 0 and often filename ``??``."""


@dataclass(eq=False)  # compared, hashed and cached by identity (per-table caches: analysis/sites.py per_table)
class StackTable:
    """Interned frames and stacks: each distinct frame and stack stored once, its id its index here, in the order
    of first appearance (interned while the file is built, :class:`oomdoctor.trace.build._Tables`). A stack is a
    tuple of frame ids, innermost frame first (the order of ``frames`` in a snapshot). Stack id -1 means "no stack
    recorded"."""

    frames: list[Frame] = field(default_factory=list)
    stacks: list[tuple[int, ...]] = field(default_factory=list)

    def stack_frames(self, stack_id: int) -> list[Frame]:
        """The frames of ``stack_id``, innermost first; ``[]`` for -1."""
        if stack_id < 0:
            return []
        return [self.frames[f] for f in self.stacks[stack_id]]

    def __len__(self) -> int:
        return len(self.stacks)


@dataclass
class Block:
    """A block of the final state. Sizes in bytes; ``stack`` indexes the trace's StackTable."""

    address: int
    size: int
    requested_size: int
    state: str
    stack: int = -1

    @property
    def is_allocated(self) -> bool:
        return self.state == BLOCK_ALLOCATED

    @property
    def is_pending_free(self) -> bool:
        return self.state == BLOCK_PENDING_FREE

    @property
    def is_active(self) -> bool:
        return self.state != BLOCK_INACTIVE


@dataclass
class Segment:
    """A segment of the final state: one ``cudaMalloc``, or one contiguous mapped range of an
    expandable segment. ``blocks`` are in address order and cover the segment exactly."""

    address: int
    total_size: int
    stream: int
    segment_type: str  # "small" or "large"
    pool_id: tuple[int, int]
    is_expandable: bool
    blocks: list[Block]
    stack: int = -1

    @property
    def allocated_size(self) -> int:
        return sum(b.size for b in self.blocks if b.is_allocated)

    @property
    def active_size(self) -> int:
        return sum(b.size for b in self.blocks if b.is_active)

    @property
    def end(self) -> int:
        return self.address + self.total_size


@dataclass
class Annotation:
    """An ``external_annotations`` record (``record_function`` scope START/END), times in µs."""

    name: str
    stage: str
    time_us: int


@dataclass
class DeviceTrace:
    """Everything recorded for one CUDA device of one process.

    ``events`` maps each name of :data:`EVENT_COLUMNS` to a 1-D array of length ``num_events``,
    ordered as recorded (oldest first). ``segments`` is the final state, sorted by address.

    Set when it is built, from ``events`` and ``segments`` (neither is replaced afterwards):
    ``num_events``; ``final_reserved_bytes``, the bytes of the final segments; ``blocks``, every block of the
    final state with its segment, ``(segment, block)`` in the segments' order.
    """

    device: int
    events: dict[str, np.ndarray]
    segments: list[Segment]
    annotations: list[Annotation] = field(default_factory=list)
    num_events: int = field(init=False)
    final_reserved_bytes: int = field(init=False)
    blocks: list[tuple[Segment, Block]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.num_events = int(self.events["action"].shape[0])
        self.final_reserved_bytes = sum(s.total_size for s in self.segments)
        self.blocks = [(seg, blk) for seg in self.segments for blk in seg.blocks]

    def __getattr__(self, name: str) -> np.ndarray:
        # Column access as attributes: ``dt.addr``, ``dt.size``, ...
        events = self.__dict__.get("events")
        if events is not None and name in events:
            return events[name]
        raise AttributeError(name)


@dataclass
class Trace:
    """One snapshot file, as columns.

    Attributes:
        path: the file it was read from.
        devices: device index -> :class:`DeviceTrace`, for every device with events or segments (at least one).
        stacks: interned frames and stacks shared by all devices.
        strings: interned strings (``user_metadata``, ``compile_context``) indexed by those columns.
        pools: interned memory-pool ids indexed by the ``pool`` column.
        allocator_settings: the snapshot's ``allocator_settings`` dict (``{}`` before PyTorch 2.3).
        meta: rank, world size, versions, environment, step markers... from the sidecar or file name.
        has_history: False when the snapshot was recorded with ``enabled="state"`` (no trace).
        warnings: what the loader skipped or repaired, one line each.
        primary: the device with the most events (then the most segments): the rank's own GPU; set when it is
            built (``devices`` is not changed afterwards).
    """

    path: str
    devices: dict[int, DeviceTrace]
    stacks: StackTable
    strings: list[str] = field(default_factory=list)
    pools: list[tuple[int, int]] = field(default_factory=list)
    allocator_settings: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    has_history: bool = True
    warnings: list[str] = field(default_factory=list)
    primary: DeviceTrace = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.primary = max(self.devices.values(), key=lambda d: (d.num_events, len(d.segments), -d.device))

    @property
    def rank(self) -> int | None:
        r = self.meta.get("rank")
        return int(r) if r is not None else None

    def save(self, path: str | os.PathLike) -> None:
        """Write this trace to ``path`` losslessly (``.npz``: numpy columns and one JSON document, no pickled
        objects), for a report rebuilt later; :func:`oomdoctor.load` reads it back.

        Raises:
            OSError: ``path`` cannot be written.
        """
        arrays: dict[str, np.ndarray] = {}
        devices = []
        for dev, dt in self.devices.items():
            for name in EVENT_COLUMNS:
                arrays[f"d{dev}_{name}"] = dt.events[name]
            devices.append({
                "device": dev,
                "segments": [asdict(s) for s in dt.segments],
                "annotations": [asdict(a) for a in dt.annotations],
            })
        doc = {
            "format_version": TRACE_FORMAT_VERSION,
            "path": self.path,
            "devices": devices,
            "frames": self.stacks.frames,
            "stacks": self.stacks.stacks,
            "strings": self.strings,
            "pools": self.pools,
            "allocator_settings": self.allocator_settings,
            "meta": self.meta,
            "has_history": self.has_history,
            "warnings": self.warnings,
        }
        arrays["doc"] = np.frombuffer(json.dumps(doc).encode(), dtype=np.uint8)
        columns: dict[str, Any] = arrays  # by name, as keywords: none is named like savez's allow_pickle
        with open(path, "wb") as f:
            np.savez_compressed(f, **columns)

