"""The numbers of PyTorch's CUDA out-of-memory message, parsed (no torch).

The caching allocator raises ``torch.OutOfMemoryError`` with a message built in ``c10/cuda/CUDACachingAllocator.cpp``
(``malloc``, PyTorch 2.1 and later), e.g.::

    CUDA out of memory. Tried to allocate 9.28 GiB. GPU 0 has a total capacity of 139.80 GiB of which 6.35 GiB is
    free. Including non-PyTorch memory, this process has 133.44 GiB memory in use. Of the allocated memory 68.91 GiB
    is allocated by PyTorch, with 3.03 GiB allocated in private pools (e.g., CUDA Graphs), and 63.72 GiB is reserved
    by PyTorch but unallocated. If reserved but unallocated memory is large try setting ...

Sizes are ``format_size``'s: ``N bytes`` up to 1 KiB, else two decimals of KiB, MiB or GiB (powers of 1024), so each
is known to half a unit of its last digit (:attr:`OomMessage.precision_bytes`: the largest of them). The message's
"allocated by PyTorch" is the allocator's ``allocated_bytes`` (private pools included) and the "reserved but
unallocated" part is ``reserved - allocated``: their sum is what the allocator reserved when it failed, and
"this process has ... memory in use" less that sum is the process's memory outside the caching allocator (the CUDA
context, NCCL's buffers, cuBLAS / cuDNN workspaces, other allocators): :attr:`OomMessage.outside_bytes`.

The older form (PyTorch 1.x-2.0: ``Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB already
allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch)``) gives no process usage: its
``in_use_bytes`` is None. Lines about other processes (``Process 123 has 2.00 GiB memory in use.``) are not this
process's and are not read.

The snapshot's own ``oom`` trace entry carries no message (only ``size`` and ``device_free``:
``shared/reference/snapshot_format_and_peers.md`` §1.4); a sidecar's ``oom.message`` does, when the recorder saw the
exception (:mod:`oomdoctor.capture.recorder`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_SIZE = r"([0-9]+(?:\.[0-9]+)?) (bytes|KiB|MiB|GiB)"
_REQUEST = re.compile(r"Tried to allocate " + _SIZE)
_GPU = re.compile(r"GPU (\d+) has a total capacity of " + _SIZE + r" of which " + _SIZE + r" is free")
_IN_USE = re.compile(r"this process has " + _SIZE + r" memory in use")
_ALLOCATED = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch")
_PRIVATE = re.compile(r"with " + _SIZE + r" allocated in private pools")
_UNALLOCATED = re.compile(_SIZE + r" is reserved by PyTorch but unallocated")
# PyTorch 1.x-2.0
_OLD = re.compile(r"\(GPU (\d+); " + _SIZE + r" total capacity; " + _SIZE + r" already allocated; " + _SIZE
                  + r" free; " + _SIZE + r" reserved in total by PyTorch\)")


@dataclass(frozen=True)
class OomMessage:
    """The numbers of one OOM message (bytes; None where the message does not give them)."""

    requested_bytes: int | None
    device: int | None
    total_bytes: int | None
    free_bytes: int | None
    in_use_bytes: int | None
    allocated_bytes: int | None
    private_pools_bytes: int | None
    reserved_bytes: int | None
    #: how far any number above may be from the exact one: half a unit of the coarsest one's last digit
    #: (``reserved_bytes``, a sum of two, up to twice that; ``outside_bytes`` up to three times)
    precision_bytes: int

    @property
    def outside_bytes(self) -> int | None:
        """This process's memory outside the caching allocator: in use less reserved (bytes, at least 0);
        None without both."""
        if self.in_use_bytes is None or self.reserved_bytes is None:
            return None
        return max(self.in_use_bytes - self.reserved_bytes, 0)


def _size(number: str, unit: str) -> tuple[int, int]:
    """(bytes, half a unit of the last digit)."""
    scale = _UNITS[unit]
    decimals = len(number.split(".")[1]) if "." in number else 0
    return round(float(number) * scale), (scale // 2 // 10 ** decimals if unit != "bytes" else 0)


def parse_oom_message(text: object) -> OomMessage | None:
    """The numbers of PyTorch's CUDA OOM message in ``text`` (see the module doc); None when ``text`` is not a
    string or holds no such message (no ``Tried to allocate``). Never raises."""
    if not isinstance(text, str) or "out of memory" not in text:
        return None
    req = _REQUEST.search(text)
    if req is None:
        return None
    slack = []

    def get(m: re.Match | None, i: int) -> int | None:
        if m is None:
            return None
        v, s = _size(m.group(i), m.group(i + 1))
        slack.append(s)
        return v

    requested = get(req, 1)
    old = _OLD.search(text)
    if old is not None:
        return OomMessage(requested, int(old.group(1)), get(old, 2), get(old, 6), None, get(old, 4), None,
                          get(old, 8), max(slack))
    gpu = _GPU.search(text)
    allocated = get(_ALLOCATED.search(text), 1)
    unallocated = get(_UNALLOCATED.search(text), 1)
    reserved = allocated + unallocated if allocated is not None and unallocated is not None else None
    return OomMessage(requested, int(gpu.group(1)) if gpu else None, get(gpu, 2), get(gpu, 4),
                      get(_IN_USE.search(text), 1), allocated, get(_PRIVATE.search(text), 1), reserved, max(slack))


def sidecar_oom_message(meta: dict[str, Any]) -> OomMessage | None:
    """The parsed ``oom.message`` of a sidecar (``Trace.meta``), if any."""
    oom = meta.get("oom")
    return parse_oom_message(oom.get("message")) if isinstance(oom, dict) else None
