"""Turning a decoded snapshot (plain dicts and lists) into a columnar :class:`Trace`.

Reads every PyTorch 2.x shape (``shared/reference/snapshot_format_and_peers.md`` §1.3-1.7, §1.12):
the dict form of ``_snapshot()`` with ``segments``/``device_traces``/``allocator_settings``/
``external_annotations``; the older list-of-segments form of ``memory_snapshot()``; blocks with the
pre-2.1 ``history`` key instead of ``frames``/``requested_size``; entries without ``time_us``,
``frames``, ``pool_id``; ``oom`` entries with ``device_free`` instead of ``addr``. Every field except
the segments' ``address``/``total_size``/``blocks`` and the blocks' ``size``/``state`` is optional.
Unknown keys are ignored; unknown trace actions are skipped with a warning.
"""

from __future__ import annotations

from collections import Counter
from itertools import count, repeat
from operator import itemgetter
from typing import Any

import numpy as np

from ..errors import SnapshotError
from .model import (
    ACTION_CODES,
    BLOCK_ALLOCATED,
    BLOCK_INACTIVE,
    BLOCK_PENDING_FREE,
    DEFAULT_POOL,
    EVENT_COLUMNS,
    Annotation,
    Block,
    DeviceTrace,
    Segment,
    StackTable,
    Trace,
)

_STATES = {
    "active_allocated": BLOCK_ALLOCATED,
    "active_pending_free": BLOCK_PENDING_FREE,
    "active_awaiting_free": BLOCK_PENDING_FREE,
    "inactive": BLOCK_INACTIVE,
}
_NO_STRING = ("", "N/A", None)


def build_trace(path: str, obj: Any) -> Trace:
    """Build a :class:`Trace` from a decoded snapshot.

    Raises:
        SnapshotError: ``obj`` is not a snapshot (wrong top-level type, missing ``segments``,
            fields of the wrong type).
    """
    if isinstance(obj, list):  # memory_snapshot(): a bare list of segments, no trace
        raw = {"segments": obj, "device_traces": []}
        legacy_list = True
    elif isinstance(obj, dict):
        raw, legacy_list = obj, False
    else:
        raise SnapshotError(path, f"is a {type(obj).__name__}, not a memory snapshot (expected a dict with "
                                  "'segments' and 'device_traces')")
    if "segments" not in raw:
        keys = ", ".join(sorted(map(str, raw))[:8]) or "none"
        raise SnapshotError(path, f"is not a memory snapshot: no 'segments' key (keys: {keys})")
    segs, traces = raw.get("segments"), raw.get("device_traces", [])
    if not isinstance(segs, list):
        raise SnapshotError(path, f"'segments' is a {type(segs).__name__}, expected a list")
    if traces is None:
        traces = []
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotError(path, "'device_traces' must be a list of lists of trace entries")

    stacks = StackTable()
    strings: list[str] = []
    pools: list[tuple[int, int]] = []
    warnings: list[str] = []
    tables = _Tables(stacks, strings, pools)

    segments_by_dev: dict[int, list[Segment]] = {}
    for i, s in enumerate(segs):
        seg, dev = _segment(path, i, s, tables)
        segments_by_dev.setdefault(dev, []).append(seg)

    devices: dict[int, DeviceTrace] = {}
    for dev, entries in enumerate(traces):
        if entries or dev in segments_by_dev:
            events = _events(path, dev, entries, tables, warnings)
            devices[dev] = DeviceTrace(dev, events, sorted(segments_by_dev.get(dev, []), key=lambda s: s.address))
    for dev, dsegs in segments_by_dev.items():
        if dev not in devices:
            devices[dev] = DeviceTrace(dev, _empty_events(), sorted(dsegs, key=lambda s: s.address))
    if not devices:
        devices[0] = DeviceTrace(0, _empty_events(), [])

    annotations = raw.get("external_annotations") or []
    if isinstance(annotations, list):
        for a in annotations:
            if isinstance(a, dict) and a.get("device") in devices and isinstance(a.get("time_us"), int):
                devices[a["device"]].annotations.append(
                    Annotation(str(a.get("name", "")), str(a.get("stage", "")), int(a["time_us"])))

    has_history = any(d.num_events > 0 for d in devices.values())
    settings = raw.get("allocator_settings") if isinstance(raw.get("allocator_settings"), dict) else {}
    if legacy_list:
        warnings.append("older list-of-segments snapshot (torch.cuda.memory_snapshot()): final state only")
    if settings.get("trace_alloc_overflowed"):
        warnings.append("the allocator reports that its trace ring buffer overflowed: the oldest events were dropped")
    meta: dict[str, Any] = {"format": "memory_snapshot_list" if legacy_list else "snapshot_dict"}
    first = next((t[0] for t in traces if t and isinstance(t[0], dict)), None)
    meta["trace_entry_keys"] = sorted(map(str, first)) if first else []
    meta["snapshot_keys"] = sorted(map(str, raw))
    return Trace(path=path, devices=devices, stacks=stacks, strings=strings, pools=pools,
                 allocator_settings=dict(settings), meta=meta, has_history=has_history, warnings=warnings)


class _Tables:
    """Interning helpers shared while one file is built."""

    def __init__(self, stacks: StackTable, strings: list[str], pools: list[tuple[int, int]]) -> None:
        self.stacks = stacks
        self.strings = strings
        self.pools = pools
        self._string_ids: dict[str, int] = {}
        self._pool_ids: dict[tuple[int, int], int] = {}

    def string(self, s: Any) -> int:
        if s in _NO_STRING:
            return -1
        s = str(s)
        sid = self._string_ids.get(s)
        if sid is None:
            sid = self._string_ids[s] = len(self.strings)
            self.strings.append(s)
        return sid

    def pool(self, p: Any) -> int:
        if p is None:
            return -1
        try:
            key = (int(p[0]), int(p[1]))
        except (TypeError, ValueError, IndexError):
            return -1
        pid = self._pool_ids.get(key)
        if pid is None:
            pid = self._pool_ids[key] = len(self.pools)
            self.pools.append(key)
        return pid

    def stack(self, path: str, frames: Any) -> int:
        if not frames:
            return -1
        if not isinstance(frames, list):
            raise SnapshotError(path, f"'frames' is a {type(frames).__name__}, expected a list of frame dicts")
        ids = []
        for f in frames:
            if isinstance(f, dict):
                ids.append(self.stacks.intern_frame((str(f.get("filename", "??")), _int(f.get("line", 0)),
                                                     str(f.get("name", "??")))))
            elif isinstance(f, str):  # forward_frames style: preformatted text
                ids.append(self.stacks.intern_frame((f, 0, "")))
            else:
                raise SnapshotError(path, f"a stack frame is a {type(f).__name__}, expected a dict")
        return self.stacks.intern_stack(tuple(ids))


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def _empty_events() -> dict[str, np.ndarray]:
    return {name: np.zeros(0, dtype=dt) for name, dt in EVENT_COLUMNS.items()}


def _segment(path: str, i: int, s: Any, t: _Tables) -> tuple[Segment, int]:
    where = f"segments[{i}]"
    if not isinstance(s, dict):
        raise SnapshotError(path, f"{where} is a {type(s).__name__}, expected a dict")
    try:
        address, total = int(s["address"]), int(s["total_size"])
        raw_blocks = s["blocks"]
    except KeyError as e:
        raise SnapshotError(path, f"{where} has no {e.args[0]!r}") from None
    except (TypeError, ValueError):
        raise SnapshotError(path, f"{where}: 'address'/'total_size' must be integers") from None
    if not isinstance(raw_blocks, list):
        raise SnapshotError(path, f"{where}.blocks is a {type(raw_blocks).__name__}, expected a list")
    blocks: list[Block] = []
    addr = address
    for j, b in enumerate(raw_blocks):
        if not isinstance(b, dict):
            raise SnapshotError(path, f"{where}.blocks[{j}] is a {type(b).__name__}, expected a dict")
        try:
            size = int(b["size"])
            state = _STATES[b["state"]]
        except KeyError as e:
            raise SnapshotError(path, f"{where}.blocks[{j}]: missing or unknown {e.args[0]!r}") from None
        except (TypeError, ValueError):
            raise SnapshotError(path, f"{where}.blocks[{j}].size must be an integer") from None
        frames = b.get("frames")
        requested = b.get("requested_size")
        history = b.get("history")
        if isinstance(history, list) and history and isinstance(history[-1], dict):  # pre-2.1 blocks
            frames = frames or history[-1].get("frames")
            requested = requested if requested is not None else history[-1].get("real_size")
        if requested is None:
            requested = size if state != BLOCK_INACTIVE else 0
        baddr = _int(b.get("address", addr))
        blocks.append(Block(baddr, size, _int(requested), state, t.stack(path, frames)))
        addr = baddr + size
    pool = s.get("segment_pool_id", DEFAULT_POOL)
    try:
        pool_id = (int(pool[0]), int(pool[1]))
    except (TypeError, ValueError, IndexError):
        pool_id = DEFAULT_POOL
    seg_type = s.get("segment_type")
    if seg_type not in ("small", "large"):
        seg_type = "small" if total <= (2 << 20) else "large"
    seg = Segment(address=address, total_size=total, stream=_int(s.get("stream", 0)), segment_type=seg_type,
                  pool_id=pool_id, is_expandable=bool(s.get("is_expandable", False)), blocks=blocks,
                  stack=t.stack(path, s.get("frames")))
    return seg, _int(s.get("device", 0))


_get_action = itemgetter("action")


def _events(path: str, dev: int, entries: list, t: _Tables, warnings: list[str]) -> dict[str, np.ndarray]:
    """Columns for one device's trace. Every pass over the entries runs in C (``map`` with
    ``itemgetter``/``dict.get``), which keeps a 271k-event trace at a fraction of its unpickling time."""
    if set(map(type, entries)) - {dict}:
        bad = next(i for i, e in enumerate(entries) if not isinstance(e, dict))
        raise SnapshotError(path, f"device_traces[{dev}][{bad}] is a {type(entries[bad]).__name__}, expected a dict")
    try:
        names = list(map(_get_action, entries))
    except KeyError:
        bad = next(i for i, e in enumerate(entries) if "action" not in e)
        raise SnapshotError(path, f"device_traces[{dev}][{bad}] has no 'action'") from None
    codes_map = ACTION_CODES
    try:
        distinct = set(names)
    except TypeError:
        raise SnapshotError(path, f"device_traces[{dev}]: an 'action' is not a string") from None
    if distinct - codes_map.keys():
        counts = Counter(n for n in names if n not in codes_map)
        warnings.append("skipped trace actions this version does not know: "
                        + ", ".join(f"{n!r} x{c}" for n, c in sorted(counts.items(), key=lambda kv: str(kv[0]))))
        keep = [i for i, n in enumerate(names) if n in codes_map]
        entries = [entries[i] for i in keep]
        names = [names[i] for i in keep]
    n = len(entries)
    cols: dict[str, np.ndarray] = {}
    cols["action"] = np.fromiter(map(codes_map.__getitem__, names), dtype=np.int8, count=n)

    def int_col(key: str, default: int) -> np.ndarray:
        try:
            try:
                return np.fromiter(map(itemgetter(key), entries), dtype=np.int64, count=n)
            except KeyError:  # optional key (``addr`` is absent on oom entries, ``time_us`` before 2.2)
                return np.fromiter(map(dict.get, entries, repeat(key), repeat(default)), dtype=np.int64, count=n)
        except (TypeError, ValueError, OverflowError):
            bad = next(i for i, e in enumerate(entries) if not isinstance(e.get(key, default), int)
                       or not -(1 << 63) <= e.get(key, default) < (1 << 63))
            raise SnapshotError(path, f"device_traces[{dev}][{bad}].{key} is {entries[bad].get(key)!r}, "
                                      "expected an integer") from None

    cols["addr"] = int_col("addr", 0)
    cols["size"] = int_col("size", 0)
    cols["stream"] = int_col("stream", 0)
    cols["time_us"] = int_col("time_us", 0)
    cols["device_free"] = int_col("device_free", -1)
    cols["stack"] = _stack_col(path, entries, t)
    cols["pool"] = _table_col(entries, "pool_id", t.pool, lambda v: v is None)
    cols["user_metadata"] = _table_col(entries, "user_metadata", t.string, lambda v: v in _NO_STRING)
    cols["compile_context"] = _table_col(entries, "compile_context", t.string, lambda v: v in _NO_STRING)
    return cols


def _table_col(entries: list, key: str, intern: Any, is_default: Any) -> np.ndarray:
    n = len(entries)
    values = map(dict.get, entries, repeat(key))
    try:
        distinct = set(values)
    except TypeError:  # unhashable values (lists for pool ids in JSON)
        distinct = None
    if distinct is not None and all(is_default(v) for v in distinct):
        return np.full(n, -1, dtype=np.int32)
    vals = [tuple(v) if isinstance(v, list) else v for v in map(dict.get, entries, repeat(key))]
    try:
        ids = {v: intern(v) for v in set(vals)}
    except TypeError:
        raise SnapshotError("", f"trace entries have unhashable {key!r} values") from None
    return np.fromiter(map(ids.__getitem__, vals), dtype=np.int32, count=n)


def _stack_col(path: str, entries: list, t: _Tables) -> np.ndarray:
    """Intern each entry's frames. Pickled snapshots share frame dicts through the pickle memo, so a
    key made of the frame dicts' identities finds repeated stacks without hashing their text; each key
    maps to the index of its first entry (``setdefault`` with a counter, all in C)."""
    n = len(entries)
    frame_lists = list(map(dict.get, entries, repeat("frames"), repeat(())))
    try:
        keys: dict[tuple[int, ...], int] = {}
        first_of = np.fromiter(map(keys.setdefault, map(tuple, map(map, repeat(id), frame_lists)), count()),
                               dtype=np.int64, count=n)
    except TypeError:
        bad = next(i for i, f in enumerate(frame_lists) if not isinstance(f, (list, tuple)) and f is not None)
        raise SnapshotError(path, f"trace entry {bad}: 'frames' is a {type(frame_lists[bad]).__name__}, "
                                  "expected a list") from None
    firsts = np.fromiter(keys.values(), dtype=np.int64, count=len(keys))
    sid_of_first = np.full(n, -1, dtype=np.int32)
    for i in firsts.tolist():
        f = frame_lists[i]
        sid_of_first[i] = t.stack(path, list(f) if f else None)
    return sid_of_first[first_of] if n else np.zeros(0, dtype=np.int32)
