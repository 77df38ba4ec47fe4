"""Small, self-consistent snapshots built in code for unit tests.

:class:`SnapBuilder` plays a toy allocator: segments are created explicitly (``segment``), blocks are
placed at offsets inside them (``alloc``), frees may be deferred (``free(..., deferred=True)`` then
``complete``). It records the trace entries PyTorch would emit and produces the final ``segments`` the
way ``torch.cuda.memory._snapshot()`` lays them out (blocks covering each segment, free gaps as
``inactive`` blocks). Dropping the first events with ``snapshot(drop_first=N)`` imitates the
``max_entries`` ring buffer.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from oomdoctor.trace.model import StackTable

MiB = 1 << 20

USER = [{"filename": "/work/train.py", "line": 10, "name": "step"}]


def frames(*specs: tuple[str, int, str]) -> list[dict]:
    return [{"filename": f, "line": line, "name": n} for f, line, n in specs]


def stack_table(*stacks: Sequence[tuple[str, int, str]]) -> tuple[StackTable, list[int]]:
    """A stack table holding ``stacks`` (each its frames, innermost first), interned as a build interns them
    (each distinct frame and stack once, in the order of first appearance), and the id of each of ``stacks``."""
    frame_ids: dict[tuple[str, int, str], int] = {}
    stack_ids: dict[tuple[int, ...], int] = {}
    ids = [stack_ids.setdefault(tuple(frame_ids.setdefault(f, len(frame_ids)) for f in st), len(stack_ids))
           for st in stacks]
    return StackTable(list(frame_ids), list(stack_ids)), ids


@dataclass
class _Block:
    addr: int
    size: int
    requested: int
    state: str
    frames: list


@dataclass
class _Segment:
    addr: int
    size: int
    stream: int
    expandable: bool
    blocks: dict[int, _Block] = field(default_factory=dict)


class SnapBuilder:
    def __init__(self, base: int = 0x7F0000000000) -> None:
        self.events: list[dict] = []
        self.segments: dict[int, _Segment] = {}
        self.annotations: list[dict] = []
        self.next_addr = base
        self.t = 1_000_000
        self.settings: dict = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "expandable_segments": False}

    # -- recording
    def _ev(self, action: str, addr: int, size: int, stream: int = 0, fr: list | None = None, **extra) -> None:
        e = {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": self.t,
             "compile_context": "N/A", "user_metadata": "", "frames": fr if fr is not None else USER}
        e.update(extra)
        self.events.append(e)
        self.t += 10

    def annotate(self, name: str, stage: str) -> None:
        self.annotations.append({"name": name, "stage": stage, "device": 0, "time_us": self.t})
        self.t += 1

    # -- segments
    def segment(self, size: int, stream: int = 0, expandable: bool = False, record: bool = True) -> int:
        addr = self.next_addr
        self.next_addr += size + 64 * MiB
        self.segments[addr] = _Segment(addr, size, stream, expandable)
        if record:
            self._ev("segment_map" if expandable else "segment_alloc", addr, size, stream)
        return addr

    def free_segment(self, addr: int, fr: list | None = None) -> None:
        seg = self.segments.pop(addr)
        assert not seg.blocks, "segment still has blocks"
        self._ev("segment_free", addr, seg.size, seg.stream, fr=fr)

    # -- blocks
    def alloc(self, seg: int, offset: int, size: int, requested: int | None = None, fr: list | None = None,
              record: bool = True) -> int:
        s = self.segments[seg]
        addr = seg + offset
        assert offset + size <= s.size
        s.blocks[addr] = _Block(addr, size, requested if requested is not None else size, "active_allocated",
                                fr if fr is not None else USER)
        if record:
            self._ev("alloc", addr, s.blocks[addr].requested, s.stream, fr=fr)
        return addr

    def _find(self, addr: int) -> tuple[_Segment, _Block]:
        for s in self.segments.values():
            if addr in s.blocks:
                return s, s.blocks[addr]
        raise KeyError(hex(addr))

    def free(self, addr: int, deferred: bool = False, fr: list | None = None) -> None:
        s, b = self._find(addr)
        self._ev("free_requested", addr, b.requested, s.stream, fr=fr)
        if deferred:
            b.state = "active_pending_free"
        else:
            self._ev("free_completed", addr, b.requested, s.stream, fr=fr)
            del s.blocks[addr]

    def complete(self, addr: int) -> None:
        s, b = self._find(addr)
        assert b.state == "active_pending_free"
        self._ev("free_completed", addr, b.requested, s.stream)
        del s.blocks[addr]

    def oom(self, size: int, device_free: int, stream: int = 0) -> None:
        e = {"action": "oom", "size": size, "stream": stream, "time_us": self.t, "device_free": device_free,
             "compile_context": "N/A", "user_metadata": "", "frames": USER}
        self.events.append(e)
        self.t += 10

    # -- output
    def snapshot(self, drop_first: int = 0) -> dict:
        segs = []
        for s in sorted(self.segments.values(), key=lambda s: s.addr):
            blocks, cur = [], s.addr
            for b in sorted(s.blocks.values(), key=lambda b: b.addr):
                if b.addr > cur:
                    blocks.append({"address": cur, "size": b.addr - cur, "requested_size": 0, "state": "inactive",
                                   "frames": []})
                blocks.append({"address": b.addr, "size": b.size, "requested_size": b.requested, "state": b.state,
                               "frames": b.frames})
                cur = b.addr + b.size
            if cur < s.addr + s.size:
                blocks.append({"address": cur, "size": s.addr + s.size - cur, "requested_size": 0,
                               "state": "inactive", "frames": []})
            segs.append({"device": 0, "address": s.addr, "total_size": s.size,
                         "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
                         "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
                         "requested_size": sum(b["requested_size"] for b in blocks if b["state"] != "inactive"),
                         "stream": s.stream, "segment_type": "small" if s.size <= 2 * MiB else "large",
                         "segment_pool_id": (0, 0), "is_expandable": s.expandable, "frames": USER, "blocks": blocks})
        return {"segments": segs, "device_traces": [self.events[drop_first:]],
                "allocator_settings": dict(self.settings), "external_annotations": list(self.annotations)}

    def write(self, path: Path, drop_first: int = 0) -> Path:
        path.write_bytes(pickle.dumps(self.snapshot(drop_first)))
        return path


class Job:
    """Offsets into one big segment, handed out in order (no reuse: the layout does not matter here)."""

    def __init__(self, size: int = 16 << 30) -> None:
        self.b = SnapBuilder()
        self.seg = self.b.segment(size)
        self.off = 0

    def alloc(self, size: int, fr: list[dict]) -> int:
        a = self.b.alloc(self.seg, self.off, size, fr=fr)
        self.off += size
        return a


def llama3_8b_plan_specs() -> tuple:
    """``(model, train, hardware, plan)`` as ``oomdoctor plan estimate --model llama3-8b --gpus 8`` reads them with its
    defaults (``oomdoctor.cli.plan._specs``), for tests that call the planner as that command does."""
    from oomdoctor.cli.plan import _specs

    return _specs({"model": "llama3-8b", "seq_len": 4096, "global_batch": 32, "micro_batch": 1, "grad_dtype": "fp32",
                   "fp8": False, "no_flash": False, "dropout": False, "fused_ce": False, "gpu": "h100-80gb", "gpus": 8,
                   "gpu_memory": None, "gpus_per_node": 8, "inter_node_gbps": 50.0, "sharding": "zero1",
                   "framework": "megatron", "loop": "plain", "use_cache": None, "return_outputs": False,
                   "expandable_segments": False})
