"""Saving and re-loading a :class:`Trace` losslessly (``.npz``: numpy columns + one JSON document).

The file holds no pickled objects (``allow_pickle=False`` both ways), so a saved trace is as safe
to open as a snapshot read through the restricted unpickler.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ..errors import SnapshotError
from .model import (
    EVENT_COLUMNS,
    TRACE_FORMAT_VERSION,
    Annotation,
    Block,
    DeviceTrace,
    Segment,
    StackTable,
    Trace,
)

FORMAT_VERSION = TRACE_FORMAT_VERSION


def save_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Write ``trace`` to ``path`` (``.npz``): :meth:`Trace.save`.

    Raises:
        OSError: ``path`` cannot be written.
    """
    trace.save(path)


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a trace written by :func:`save_trace`; its ``path`` is ``path`` (the file read).

    Raises:
        SnapshotError: not such a file, written by an incompatible version, or holding no device.
    """
    p = os.fspath(path)
    try:
        with np.load(p, allow_pickle=False) as z:
            doc: dict[str, Any] = json.loads(bytes(z["doc"]).decode())
            columns = {k: z[k] for k in z.files if k != "doc"}
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise SnapshotError(p, f"is not a saved oomdoctor trace ({str(e)[:100]})") from None
    if doc.get("format_version") != FORMAT_VERSION:
        raise SnapshotError(p, f"saved trace format {doc.get('format_version')!r} is not {FORMAT_VERSION}")
    stacks = StackTable([(f[0], f[1], f[2]) for f in doc["frames"]], [tuple(s) for s in doc["stacks"]])
    devices = {}
    for d in doc["devices"]:
        dev = d["device"]
        segs = [Segment(**{**s, "pool_id": tuple(s["pool_id"]), "blocks": [Block(**b) for b in s["blocks"]]})
                for s in d["segments"]]
        events = {name: columns[f"d{dev}_{name}"].astype(dt, copy=False) for name, dt in EVENT_COLUMNS.items()}
        devices[dev] = DeviceTrace(dev, events, segs, [Annotation(**a) for a in d["annotations"]])
    if not devices:  # a built trace has at least one (Trace.primary)
        raise SnapshotError(p, "saved trace holds no device")
    # the file read, as for a snapshot (the path the trace was first loaded from stays in the file's "path")
    return Trace(path=p, devices=devices, stacks=stacks, strings=doc["strings"],
                 pools=[tuple(p) for p in doc["pools"]], allocator_settings=doc["allocator_settings"],
                 meta=doc["meta"], has_history=doc["has_history"], warnings=doc["warnings"])
