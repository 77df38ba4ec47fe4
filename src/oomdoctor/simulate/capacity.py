"""How much memory the replay may use: the cap that made (or would make) the recorded run fail.

Two kinds of limit exist in PyTorch (``shared/reference/caching_allocator_spec.md`` §6.2, §10.3):

- ``fraction``: ``allowed_memory_maximum`` from ``torch.cuda.set_per_process_memory_fraction`` (or
  ``per_process_memory_fraction`` in the config, 2.9+). ``alloc_block`` refuses, before any driver
  call, a segment that would take reserved bytes above it, and it enables the garbage collector.
- ``device``: what ``cudaMalloc``/``cuMemCreate`` can get: the GPU's memory minus the CUDA context,
  NCCL buffers and other processes.

Inference from a snapshot (:func:`infer_capacity`), first that applies:

1. the sidecar's ``memory_cap_bytes`` (written by ``oomdoctor.record`` when a fraction is set);
2. a recorded ``oom`` entry: its ``device_free`` (``cudaMemGetInfo`` at the failure) plus the reserved
   bytes then is the device limit, when the device could not hold the segment; when it could, the
   failure came from a fraction cap, which lies between the peak reserved before the OOM and the
   reserved bytes at the OOM plus the segment size; the lower end is taken (a recommendation that
   fits it fits the real cap);
3. none: unlimited.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..analysis.rounding import allocation_size
from ..analysis.timeline import reserved_series
from ..trace.model import OOM, DeviceTrace, Trace
from ..units import parse_bytes  # noqa: F401 - re-exported (the CLI reads sizes here)


@dataclass(frozen=True)
class Capacity:
    """A memory limit in bytes (None: unlimited), its ``kind`` (``fraction``, ``device`` or ``none``)
    and a sentence saying where it came from."""

    limit_bytes: int | None
    kind: str
    source: str


def infer_capacity(trace: Trace, device: DeviceTrace) -> Capacity:
    """The limit a replay of ``trace`` should use by default (see the module doc)."""
    cap = trace.meta.get("memory_cap_bytes")
    if isinstance(cap, int) and cap > 0:
        return Capacity(cap, "fraction", "the memory cap in the sidecar (memory_cap_bytes)")
    act = device.events["action"]
    ooms = np.flatnonzero(act == OOM)
    if ooms.size == 0:
        return Capacity(None, "none", "unlimited (no OOM recorded, no cap in the metadata)")
    o = int(ooms[0])
    reserved_start, reserved = reserved_series(device)
    at_oom = int(reserved[o])
    device_free = int(device.events["device_free"][o])
    if device_free < 0:
        device_free = int(device.events["addr"][o])
    request = int(device.events["size"][o])
    seg = allocation_size(request)
    if device_free < seg:
        return Capacity(at_oom + device_free, "device",
                        f"the OOM at event {o}: {device_free} bytes free on the device + {at_oom} reserved")
    lower = int(max(reserved[:o].max() if o else reserved_start, reserved_start))
    upper = at_oom + seg - 1
    return Capacity(lower, "fraction",
                    f"the OOM at event {o} came from a memory-fraction cap (the device still had {device_free} "
                    f"bytes free): the cap lies in [{lower}, {upper}] bytes; the lower end is used")
