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

import ctypes
import sys
from collections import Counter, deque
from itertools import chain, count, repeat
from operator import itemgetter
from typing import Any, Iterator, KeysView, Sequence, cast

import numpy as np

from ..errors import SnapshotError
from .model import (
    ACTION_CODES,
    BLOCK_ALLOCATED,
    BLOCK_INACTIVE,
    BLOCK_PENDING_FREE,
    DEFAULT_POOL,
    EVENT_COLUMNS,
    OOM,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
    Annotation,
    Block,
    DeviceTrace,
    Frame,
    Segment,
    StackTable,
    Trace,
)
from .reader import no_segments
from .stackmatch import match_stackless_steps

_STATES = {
    "active_allocated": BLOCK_ALLOCATED,
    "active_pending_free": BLOCK_PENDING_FREE,
    "active_awaiting_free": BLOCK_PENDING_FREE,
    "inactive": BLOCK_INACTIVE,
}
_NO_STRING = ("", "N/A", None)
_SEGMENT_CODES = (SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP)
_I63 = 1 << 63  # addresses and times are signed 64-bit integers, as the event columns that hold them
#: The largest size a block, segment or allocation can have: 2**48 bytes (256 TiB). CUDA's unified virtual
#: address space is 48 bits on x86-64 and a GPU holds under 1 TiB, so a larger size is no allocation; it is
#: refused, naming the field, before it reaches the replay. An ``oom`` entry's size is a request that failed
#: and may be anything up to 2**63.
MAX_SIZE_BYTES = 1 << 48


def build_trace(path: str, obj: Any, drained: Drained | None = None, *, sidecar: dict[str, Any] | None = None,
                sidecar_warnings: Sequence[str] = (), replay_only: bool = False) -> Trace:
    """Build a :class:`Trace` from a decoded snapshot, then give the steps recorded without stacks the stacks of
    a stacked step (:func:`~.stackmatch.match_stackless_steps`). ``sidecar``: the metadata of the snapshot's
    sidecar, checked (:func:`~.load.sidecar_meta`), merged into ``meta`` after the snapshot's own, its warnings
    ``sidecar_warnings`` after the build's. ``drained``: the columns of trace entries taken
    out of ``obj``'s lists while it was streamed in (:mod:`.stream`); they come before what the lists
    still hold. ``replay_only``: only what the allocator replay (:mod:`oomdoctor.simulate`) reads, for
    ``oomdoctor simulate`` (issue 38: the stack column was 40% of the build of ``large``): the ``stack``
    column holds the stacks of the segment entries (``segment_alloc/free/map/unmap``: a release's frames may
    name ``empty_cache``) and -1 for every other entry, ``user_metadata`` / ``compile_context`` are -1, the
    external annotations are not read, and ``meta["columns"]`` is ``"replay"``. Streamed entries
    (``drained``) keep all their columns.

    Raises:
        SnapshotError: ``obj`` is not a snapshot (wrong top-level type, missing ``segments``,
            fields of the wrong type).
    """
    raw: dict[Any, Any]
    if isinstance(obj, list):  # memory_snapshot(): a bare list of segments, no trace
        raw = {"segments": obj, "device_traces": []}
        legacy_list = True
    elif isinstance(obj, dict):
        raw, legacy_list = obj, False
    else:
        raise SnapshotError(path, f"is a {type(obj).__name__}, not a memory snapshot (expected a dict with "
                                  "'segments' and 'device_traces')")
    if "segments" not in raw:
        raise SnapshotError(path, no_segments(raw))
    segs, traces = raw.get("segments"), raw.get("device_traces", [])
    if not isinstance(segs, list):
        raise SnapshotError(path, f"'segments' is a {type(segs).__name__}, expected a list")
    if traces is None:
        traces = []
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotError(path, "'device_traces' must be a list of lists of trace entries")

    drained = drained or Drained(path)
    tables, warnings = drained.tables, drained.warnings
    stacks, strings, pools = tables.stacks, tables.strings, tables.pools

    segments_by_dev: dict[int, list[Segment]] = {}
    for i, s in enumerate(segs):
        seg, dev = _segment(path, i, s, tables)
        segments_by_dev.setdefault(dev, []).append(seg)

    events_by_dev: dict[int, dict[str, np.ndarray]] = {}  # every device with events or segments (else device 0)
    for dev, entries in enumerate(traces):
        chunks = drained.chunks.get(id(entries), [])
        if entries or chunks or dev in segments_by_dev:
            offset = sum(len(c["action"]) for c in chunks)
            last = _events(path, dev, entries, tables, warnings, offset=offset, refs=bool(drained.chunks),
                           replay_only=replay_only and not drained.chunks)
            events_by_dev[dev] = (last if not chunks
                                  else {k: np.concatenate([c[k] for c in chunks] + [last[k]]) for k in last})
    for dev in segments_by_dev:
        if dev not in events_by_dev:
            events_by_dev[dev] = _empty_events()
    if not events_by_dev:
        events_by_dev[0] = _empty_events()

    annotations: dict[int, list[Annotation]] = {dev: [] for dev in events_by_dev}
    if not replay_only:
        _annotations(raw.get("external_annotations"), annotations, warnings)

    has_history = any(events["action"].size > 0 for events in events_by_dev.values())
    given = raw.get("allocator_settings")
    settings: dict[Any, Any] = given if isinstance(given, dict) else {}
    if legacy_list:
        warnings.append("older list-of-segments snapshot (torch.cuda.memory_snapshot()): final state only")
    if tables.bad_frames:
        warnings.append(f"{tables.bad_frames} malformed stack frames or stacks were shown as unknown ('??'); "
                        "they hold no bytes")
    if settings.get("trace_alloc_overflowed"):
        warnings.append("the allocator reports that its trace ring buffer overflowed: the oldest events were dropped")
    meta: dict[str, Any] = {"format": "memory_snapshot_list" if legacy_list else "snapshot_dict"}
    first = drained.first_keys or next((sorted(map(str, t[0])) for t in traces if t and isinstance(t[0], dict)), None)
    meta["trace_entry_keys"] = first or []
    meta["snapshot_keys"] = sorted(map(str, raw))
    if replay_only:
        meta["columns"] = "replay"
    if sidecar:
        meta.update(sidecar)
    warnings += sidecar_warnings
    devices = {dev: DeviceTrace(dev, events, sorted(segments_by_dev.get(dev, []), key=lambda s: s.address),
                                annotations[dev])
               for dev, events in events_by_dev.items()}
    trace = Trace(path=path, devices=devices, stacks=stacks, strings=strings, pools=pools,
                  allocator_settings=dict(settings), meta=meta, has_history=has_history, warnings=warnings)
    match_stackless_steps(trace)  # steps recorded without stacks (--stack-steps K/N): matched, said in meta
    if not has_history:
        warnings.append("no allocation history was recorded (enabled='state' or an empty trace): "
                        "only the final state is reported")
    return trace


def _annotations(raw: Any, devices: dict[int, list[Annotation]], warnings: list[str]) -> None:
    """Append ``external_annotations`` (``record_function`` scopes: ``{"device", "stage", "name",
    "time_us"}``, ``torch/csrc/cuda/memory_snapshot.cpp``) to their devices' lists (``devices``: device index ->
    its annotations). Annotations hold no bytes: one
    whose ``device`` is not an integer naming a device of the snapshot, whose ``stage`` is not ``START`` or
    ``END``, whose ``name`` is not text, or whose ``time_us`` is not a signed 64-bit integer is skipped and
    counted in a warning, as malformed frames are."""
    if raw is None:
        return
    if not isinstance(raw, list):
        warnings.append(f"'external_annotations' is a {type(raw).__name__}, not a list: skipped "
                        "(annotations hold no bytes)")
        return
    if _annotations_alike(raw, devices):
        return
    bad = 0
    for a in raw:
        if not isinstance(a, dict):
            bad += 1
            continue
        dev, stage, name, t = a.get("device"), a.get("stage"), a.get("name", ""), a.get("time_us")
        if (type(dev) is not int or dev not in devices or stage not in ("START", "END") or not isinstance(name, str)
                or type(t) is not int or not -_I63 <= t < _I63):
            bad += 1
            continue
        devices[dev].append(Annotation(name, stage, t))
    if bad:
        warnings.append(f"{bad} malformed external annotations were skipped (a device, stage, name or time_us "
                        "of the wrong type or out of range); they hold no bytes")



def _annotations_alike(raw: list, devices: dict[int, list[Annotation]]) -> bool:
    """The usual case of :func:`_annotations`, checked and read in C passes (``map``, ``set``, ``min``/``max``)
    instead of one Python iteration per record: every record a dict with an ``int`` device of the snapshot, a
    ``START``/``END`` stage, a ``str`` name (absent: ``""``) and an ``int`` time in the signed 64-bit range. Appends
    them and returns True; returns False, appending nothing, when any record is otherwise (the loop then skips
    and counts the bad ones)."""
    if not raw or set(map(type, raw)) != {dict}:
        return not raw
    # the records' values, of any type until checked below
    devs: list[Any] = list(map(dict.get, raw, repeat("device")))
    stages: list[Any] = list(map(dict.get, raw, repeat("stage")))
    names: list[Any] = list(map(dict.get, raw, repeat("name"), repeat("")))
    times: list[Any] = list(map(dict.get, raw, repeat("time_us")))
    try:
        distinct_devs = set(devs)
        if (set(map(type, devs)) != {int} or not distinct_devs <= devices.keys()
                or not set(stages) <= {"START", "END"} or not all(isinstance(n, str) for n in set(names))
                or set(map(type, times)) != {int} or not (-_I63 <= min(times) and max(times) < _I63)):
            return False
    except TypeError:  # an unhashable device, stage or name
        return False
    anns = list(map(Annotation, names, stages, times))
    if len(distinct_devs) == 1:
        devices[devs[0]].extend(anns)
    else:
        for d, a in zip(devs, anns):
            devices[d].append(a)
    return True

class _StackRef:
    """What a drained entry's ``frames`` list is shrunk to: ``[_StackRef]`` holding one shared copy of
    its frames. The list itself stays alive (the pickle memo holds it, and a later entry may point to
    it: PyTorch shares one list between a ``free_requested`` and its ``free_completed``). Nothing
    unpickled can be one (the unpickler builds no class)."""

    __slots__ = ("frames",)

    def __init__(self, frames: list) -> None:
        self.frames = frames


class Drained:
    """Trace entries taken out of their lists while a large pickle streams in (:mod:`.stream`), as
    event columns per list (``chunks``, keyed by the list's ``id``), with the interning tables and
    warnings the rest of the build continues."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tables = _Tables()
        self.warnings: list[str] = []
        self.chunks: dict[int, list[dict[str, np.ndarray]]] = {}
        self.first_keys: list[str] | None = None
        self._refs: dict[int, _StackRef] = {}

    def drain(self, entries: list) -> int:
        """Turn the entries now in ``entries`` (a device's trace list, still being filled) into columns,
        empty the list, and shrink the entries the pickle memo keeps: each dict is cleared, each frames
        list reduced to ``[_StackRef]``. Returns how many were taken.

        Raises:
            SnapshotError: as :func:`build_trace`.
        """
        taken = entries[:]
        del entries[:]
        if not taken:
            return 0
        if self.first_keys is None and isinstance(taken[0], dict):
            self.first_keys = sorted(map(str, taken[0]))
        chunks = self.chunks.setdefault(id(entries), [])
        offset = sum(len(c["action"]) for c in chunks)
        cols = _events(self.path, "?", taken, self.tables, self.warnings, offset=offset, refs=True)
        chunks.append(cols)
        refs = self._refs
        for e, sid in zip(taken, cols["stack"].tolist()) if len(cols["action"]) == len(taken) else ():
            fl = e.get("frames")
            if fl.__class__ is list and fl and fl[0].__class__ is not _StackRef:
                ref = refs.get(sid)
                if ref is None:
                    ref = refs[sid] = _StackRef(list(fl))
                fl[:] = [ref]
            e.clear()
        return len(taken)


class _Tables:
    """The interning of one file while it is built: frames and stacks (into ``stacks``), strings, pools. Each
    distinct value is stored once; its id is its index, in the order of first appearance."""

    def __init__(self) -> None:
        self.stacks = StackTable()
        self.strings: list[str] = []
        self.pools: list[tuple[int, int]] = []
        self._frame_ids: dict[Frame, int] = {}
        self._stack_ids: dict[tuple[int, ...], int] = {}
        self._string_ids: dict[str, int] = {}
        self._pool_ids: dict[tuple[int, int], int] = {}
        self.bad_frames = 0  # malformed frames or stacks replaced by unknown ones (a warning)

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
        if frames.__class__ is list and len(frames) == 1 and frames[0].__class__ is _StackRef:
            frames = frames[0].frames  # shrunk by Drained.drain (a block's frames list is its entry's)
        if not isinstance(frames, (list, tuple)):
            self.bad_frames += 1  # a stack of the wrong type: no stack, counted in a warning
            return -1
        ids = []
        for f in frames:
            frame: Frame
            if isinstance(f, dict):
                frame = (str(f.get("filename", "??")), _int(f.get("line", 0)), str(f.get("name", "??")))
            elif isinstance(f, str):  # forward_frames style: preformatted text
                frame = (f, 0, "")
            else:  # a malformed frame holds no bytes: shown as unknown, counted in a warning
                self.bad_frames += 1
                frame = ("??", 0, "??")
            fid = self._frame_ids.get(frame)
            if fid is None:
                fid = self._frame_ids[frame] = len(self.stacks.frames)
                self.stacks.frames.append(frame)
            ids.append(fid)
        key = tuple(ids)
        sid = self._stack_ids.get(key)
        if sid is None:
            sid = self._stack_ids[key] = len(self.stacks.stacks)
            self.stacks.stacks.append(key)
        return sid


def _int(v: Any) -> int:
    """A frame's line number: an integer, or 0 for anything else (None, text, NaN, infinity)."""
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
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
    except (TypeError, ValueError, OverflowError):
        raise SnapshotError(path, f"{where}: 'address'/'total_size' must be integers") from None
    if not (0 <= address < _I63 and 0 <= total < MAX_SIZE_BYTES):
        raise SnapshotError(path, f"{where}: address {address} / total_size {total} out of range (a segment's "
                                  "size is below 2**48 bytes, its address a non-negative 63-bit integer)")
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
        except (TypeError, ValueError, OverflowError):
            raise SnapshotError(path, f"{where}.blocks[{j}].size must be an integer") from None
        if not 0 <= size < MAX_SIZE_BYTES:
            raise SnapshotError(path, f"{where}.blocks[{j}].size is {size}: a block's size is in [0, 2**48)")
        frames = b.get("frames")
        requested = b.get("requested_size")
        history = b.get("history")
        if isinstance(history, list) and history and isinstance(history[-1], dict):  # pre-2.1 blocks
            frames = frames or history[-1].get("frames")
            requested = requested if requested is not None else history[-1].get("real_size")
        if requested is None:
            requested = size if state != BLOCK_INACTIVE else 0
        baddr = _in_range(path, f"{where}.blocks[{j}].address", _int(b.get("address", addr)), 0, _I63)
        requested = _in_range(path, f"{where}.blocks[{j}].requested_size", _int(requested), 0, MAX_SIZE_BYTES)
        blocks.append(Block(baddr, size, requested, state, t.stack(path, frames)))
        addr = baddr + size
    pool = s.get("segment_pool_id", DEFAULT_POOL)
    try:
        pool_id = (int(pool[0]), int(pool[1]))
    except (TypeError, ValueError, IndexError):
        pool_id = DEFAULT_POOL
    seg_type = s.get("segment_type")
    if seg_type not in ("small", "large"):
        seg_type = "small" if total <= (2 << 20) else "large"
    stream = _in_range(path, f"{where}.stream", _int(s.get("stream", 0)), -_I63, _I63)
    seg = Segment(address=address, total_size=total, stream=stream, segment_type=seg_type,
                  pool_id=pool_id, is_expandable=bool(s.get("is_expandable", False)), blocks=blocks,
                  stack=t.stack(path, s.get("frames")))
    return seg, _in_range(path, f"{where}.device", _int(s.get("device", 0)), 0, 1 << 16)


def _in_range(path: str, field: str, v: int, lo: int, hi: int) -> int:
    """``v`` if ``lo <= v < hi``. Raises :class:`SnapshotError` naming ``field`` otherwise."""
    if not lo <= v < hi:
        raise SnapshotError(path, f"{field} is {v}: out of range [{lo}, {hi})")
    return v


_get_action = itemgetter("action")
_FOUR = ("addr", "size", "stream", "time_us")


def _own_keys(entries: list) -> dict[str, str]:
    """The first entry's own key strings, by their text: ``{"addr": <its "addr">, ...}``. The unpickler builds
    one string object per key (the pickle memo shares it between all entries), which is not the ``"addr"`` of
    this module, so a lookup with this module's string matches the hash, then compares the text (``memcmp``);
    with the entries' own object it stops at the identity test. On ``shared/snapshots/large`` the build does
    about 2.2 million lookups (docs/benchmarks.md, round 11). Any other key reads as before: a lookup by an
    equal string finds the same item either way."""
    first = entries[0] if entries else None
    if first is None or first.__class__ is not dict:
        return {}
    return {k: k for k in first if k.__class__ is str}


def _events(path: str, dev: int | str, entries: list, t: _Tables, warnings: list[str], *, offset: int = 0,
            refs: bool = False, replay_only: bool = False) -> dict[str, np.ndarray]:
    """Columns for one device's trace (``entries``, which start at index ``offset`` of it). Every pass
    over the entries runs in C (``map`` with ``itemgetter``/``dict.get``), which keeps a 271k-event trace
    at a fraction of its unpickling time. ``refs``: frames lists may be ``[_StackRef]`` (streamed in).
    ``replay_only``: stacks of the segment entries only, no ``user_metadata`` / ``compile_context``
    (:func:`build_trace`)."""
    codes_map = ACTION_CODES
    cols: dict[str, np.ndarray] = {}
    own = _own_keys(entries).get
    try:  # the usual case, every entry a dict with a known action: one pass
        cols["action"] = np.fromiter(map(codes_map.__getitem__, map(itemgetter(own("action", "action")), entries)),
                                     dtype=np.int8,
                                     count=len(entries))
    except (KeyError, TypeError):
        entries, cols["action"] = _checked_actions(path, dev, entries, warnings, offset)
    n = len(entries)

    def int_col(key: str, default: int) -> np.ndarray:
        key = own(key, key)
        try:
            try:
                return np.fromiter(map(itemgetter(key), entries), dtype=np.int64, count=n)
            except KeyError:  # optional key (``addr`` is absent on oom entries, ``time_us`` before 2.2)
                return np.fromiter(map(dict.get, entries, repeat(key), repeat(default)), dtype=np.int64, count=n)
        except (TypeError, ValueError, OverflowError):
            bad = next(i for i, e in enumerate(entries) if not isinstance(e.get(key, default), int)
                       or not -(1 << 63) <= e.get(key, default) < (1 << 63))
            raise SnapshotError(path, f"device_traces[{dev}][{offset + bad}].{key} is {entries[bad].get(key)!r}, "
                                      "expected an integer") from None

    four = None
    try:  # the usual case, every entry with all four: one pass over the entries (half the time of four)
        get_four = itemgetter(*(own(k, k) for k in _FOUR))
        four = np.fromiter(chain.from_iterable(map(get_four, entries)), dtype=np.int64, count=4 * n).reshape(n, 4)
    except (KeyError, TypeError, ValueError, OverflowError):  # one missing or not an int: column by column
        pass
    cols["addr"] = np.ascontiguousarray(four[:, 0]) if four is not None else int_col("addr", 0)
    cols["size"] = np.ascontiguousarray(four[:, 1]) if four is not None else int_col("size", 0)
    negative = np.flatnonzero(cols["size"] < 0)
    if negative.size:
        i = int(negative[0])
        raise SnapshotError(path, f"device_traces[{dev}][{offset + i}].size is {int(cols['size'][i])}: "
                                  "sizes are never negative")
    huge = np.flatnonzero((cols["size"] >= MAX_SIZE_BYTES) & (cols["action"] != OOM))
    if huge.size:
        i = int(huge[0])
        raise SnapshotError(path, f"device_traces[{dev}][{offset + i}].size is {int(cols['size'][i])}: "
                                  "no allocation or segment reaches 2**48 bytes (256 TiB)")
    cols["stream"] = np.ascontiguousarray(four[:, 2]) if four is not None else int_col("stream", 0)
    cols["time_us"] = np.ascontiguousarray(four[:, 3]) if four is not None else int_col("time_us", 0)
    # A key read from every entry is "present"; when every entry has as many keys as the first and each of the
    # first's keys is present, all entries have the same keys, and one the first lacks (``device_free`` and
    # ``pool_id`` on most traces) is absent from all: its column is the default, without a pass over the entries.
    present = {"action"} | ({"addr", "size", "stream", "time_us"} if four is not None else set())
    if replay_only:
        segs = np.flatnonzero(np.isin(cols["action"], _SEGMENT_CODES)).tolist()
        seg_entries = [entries[i] for i in segs]
        frame_lists = list(map(dict.get, seg_entries, repeat(own("frames", "frames")), repeat(())))
        user_metadata, compile_context = np.full(n, -1, dtype=np.int32), np.full(n, -1, dtype=np.int32)
    else:
        frame_lists = _field(entries, own("frames", "frames"), (), present)
        user_metadata = _table_col(_field(entries, own("user_metadata", "user_metadata"), None, present), t.string,
                                   lambda v: v in _NO_STRING)
        compile_context = _table_col(_field(entries, own("compile_context", "compile_context"), None, present),
                                     t.string,
                                     lambda v: v in _NO_STRING)
    first: KeysView[str] | frozenset[str] = entries[0].keys() if n else frozenset()
    if replay_only:  # the keys not read from every entry: present when every entry has them
        present |= _present_in_all(entries, [k for k in first if k not in present])
    alike = bool(n) and first <= present and set(map(len, entries)) == {len(first)}

    def absent(key: str) -> bool:
        return alike and key not in first

    cols["device_free"] = np.full(n, -1, dtype=np.int64) if absent("device_free") else int_col("device_free", -1)
    if replay_only:
        cols["stack"] = np.full(n, -1, dtype=np.int32)
        cols["stack"][segs] = _stack_col(path, frame_lists, t, refs)
    else:
        cols["stack"] = _stack_col(path, frame_lists, t, refs)
    cols["pool"] = (np.full(n, -1, dtype=np.int32) if absent("pool_id")
                    else _table_col(_field(entries, own("pool_id", "pool_id"), None, present), t.pool,
                               lambda v: v is None))
    cols["user_metadata"] = user_metadata
    cols["compile_context"] = compile_context
    return cols


def _present_in_all(entries: list, keys: list[str]) -> set[str]:
    """The ``keys`` that every entry (all dicts) has. One pass in C for all of them together (``itemgetter`` raises
    ``KeyError`` at the first entry that lacks one), then, only where some entry lacks one, a pass per key."""
    if not keys:
        return set()
    try:
        deque(map(itemgetter(*keys), entries), maxlen=0)
    except KeyError:
        return {k for k in keys if all(map(dict.__contains__, entries, repeat(k)))}
    return set(keys)


def _field(entries: list, key: str, default: Any, present: set[str]) -> list:
    """``key`` of every entry (all dicts), ``default`` where absent; ``key`` is added to ``present`` when no entry
    lacks it."""
    try:
        got = list(map(itemgetter(key), entries))
    except KeyError:
        return list(map(dict.get, entries, repeat(key), repeat(default)))
    present.add(key)
    return got


def _checked_actions(path: str, dev: int | str, entries: list, warnings: list[str], offset: int
                     ) -> tuple[list, np.ndarray]:
    """``entries`` without those whose action this version does not know (named in a warning), and their action
    codes. Raises :class:`SnapshotError` for an entry that is not a dict, has no ``action``, or whose action is
    not a string."""
    try:  # an entry that is not a dict raises TypeError here: the checks below say which
        names = list(map(_get_action, entries))
    except (KeyError, TypeError):
        if set(map(type, entries)) - {dict}:
            bad = next(i for i, e in enumerate(entries) if not isinstance(e, dict))
            raise SnapshotError(path, f"device_traces[{dev}][{offset + bad}] is a {type(entries[bad]).__name__}, "
                                      "expected a dict") from None
        bad = next(i for i, e in enumerate(entries) if "action" not in e)
        raise SnapshotError(path, f"device_traces[{dev}][{offset + bad}] has no 'action'") from None
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
    return entries, np.fromiter(map(codes_map.__getitem__, names), dtype=np.int8, count=len(entries))


def _table_col(values: list, intern: Any, is_default: Any) -> np.ndarray:
    """Interned ids of an entry field that holds no bytes (pool id, metadata strings), given its ``values`` (one
    per entry); -1 for none. A value that cannot be a key (a dict, a nested list) counts as none: the field is
    labels, not memory."""
    n = len(values)
    if n and is_default(values[0]) and values.count(values[0]) == n:
        # every value equal to one default (``compile_context`` is "N/A" on every entry of a 2.x trace, each its
        # own string object, which a set would hash one by one: 271,109 on ``shared/snapshots/large``)
        return np.full(n, -1, dtype=np.int32)
    try:
        distinct = set(values)
    except TypeError:  # unhashable values (lists for pool ids in JSON)
        distinct = None
    if distinct is not None and all(is_default(v) for v in distinct):
        return np.full(n, -1, dtype=np.int32)
    vals = [tuple(v) if isinstance(v, list) else v for v in values]
    # interned in the order of first appearance: a set's order follows the string hash seed of the process, and the
    # ids must not depend on it
    try:
        ids = {v: intern(v) for v in dict.fromkeys(vals)}
    except TypeError:
        vals = [v if _hashable(v) else None for v in vals]
        ids = {v: intern(v) for v in dict.fromkeys(vals)}
    return np.fromiter(map(ids.__getitem__, vals), dtype=np.int32, count=n)


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def _stack_col(path: str, frame_lists: list, t: _Tables, refs: bool = False) -> np.ndarray:
    """Intern each entry's frames (``frame_lists``: its ``frames``, ``()`` when absent). Pickled snapshots share frame dicts through the pickle memo, so a
    key made of the frame dicts' identities finds repeated stacks without hashing their text; each key
    maps to the index of its first entry, and stacks are interned in the order of their first entries.
    ``refs``: a frames list shrunk by :meth:`Drained.drain` stands for the frames its ``_StackRef`` holds.

    The keys are compared in NumPy (:func:`_first_of_identical`); where that cannot be used (a ``frames``
    that is not a sequence), one key tuple per entry (``setdefault`` with a counter, in C). Both give the
    same stack ids: stacks are interned by content, in the order of their first entries."""
    n = len(frame_lists)
    if refs:
        frame_lists = [f[0].frames if f.__class__ is list and len(f) == 1 and f[0].__class__ is _StackRef else f
                       for f in frame_lists]
    try:
        first_of = _first_of_identical(frame_lists)
    except TypeError:  # a 'frames' that is not a sequence (None, a number): keyed one by one below
        first_of = None
    if first_of is not None:
        firsts = np.flatnonzero(first_of == np.arange(n))
    else:
        try:
            keys: dict[tuple[int, ...], int] = {}
            first_of = np.fromiter(map(keys.setdefault, _id_tuples(frame_lists), count()), dtype=np.int64, count=n)
        except TypeError:  # 'frames' of the wrong type on some entries: those get no stack, counted in a warning
            t.bad_frames += sum(1 for f in frame_lists if f is not None and not isinstance(f, (list, tuple)))
            frame_lists = [f if isinstance(f, (list, tuple)) else () for f in frame_lists]
            keys = {}
            first_of = np.fromiter(map(keys.setdefault, _id_tuples(frame_lists), count()), dtype=np.int64, count=n)
        firsts = np.fromiter(keys.values(), dtype=np.int64, count=len(keys))
    sid_of_first = np.full(n, -1, dtype=np.int32)
    for i in firsts.tolist():
        f = frame_lists[i]
        sid_of_first[i] = t.stack(path, list(f) if f else None)
    return sid_of_first[first_of] if n else np.zeros(0, dtype=np.int32)


def _id_tuples(frame_lists: list) -> Iterator[tuple[int, ...]]:
    """The key of each frames list for :func:`_stack_col`: the tuple of its frames' ``id()`` (lazy, in C)."""
    ids = cast("Iterator[Iterator[int]]", map(map, repeat(id), frame_lists))  # map(id, frames) of each
    return map(tuple, ids)


_MIX = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio, odd: multiplying by it permutes uint64


#: Where a ``list``'s pointer to its item array sits in the object (CPython: ``PyObject_VAR_HEAD``, then
#: ``ob_item``, then ``allocated``: ``Include/cpython/listobject.h``); None on another layout or interpreter.
_LIST_ITEMS_AT = (list.__basicsize__ - 16 if sys.implementation.name == "cpython" and list.__basicsize__ == 40
                  and ctypes.sizeof(ctypes.c_void_p) == 8 else None)


def _list_addresses(items: list) -> np.ndarray | None:
    """``id()`` of every element of ``items``, copied from the list's own array of object pointers (one
    ``memcpy``, where a NumPy object array of them costs a conversion per element: about 60 million fewer
    instructions for the 2,159,444 frames of ``shared/snapshots/large``); None where the layout is not
    CPython's (:data:`_LIST_ITEMS_AT`) or the first and last pointers are not their objects' ``id``."""
    if items.__class__ is not list or _LIST_ITEMS_AT is None:
        return None
    if not items:
        return np.zeros(0, dtype=np.int64)
        return None
    base = ctypes.c_void_p.from_address(id(items) + _LIST_ITEMS_AT).value
    if not base:
        return None
    ptr = np.frombuffer(memoryview((ctypes.c_int64 * len(items)).from_address(base)), dtype=np.int64).copy()
    return ptr if int(ptr[0]) == id(items[0]) and int(ptr[-1]) == id(items[-1]) else None


def _first_of_identical(frame_lists: list) -> np.ndarray | None:
    """For each list, the index of the first list holding the same objects (by identity) in the same
    order, as :func:`_stack_col`'s key tuples group them; None when it cannot be told this way.

    Each list's objects are hashed from their addresses and positions (a sum of mixed 64-bit words,
    wrapping), lists are grouped by (hash, length) with :func:`numpy.unique`, and every list is then
    compared object by object with its group's first: on any mismatch (a hash collision) None is returned
    and the caller keys the lists one by one. Raises TypeError when an element of ``frame_lists`` has no
    length or cannot be iterated. About 4x fewer CPU seconds than one key tuple per list on the
    271,109 entries (2,159,444 frames) of ``shared/snapshots/large`` (docs/benchmarks.md)."""
    n = len(frame_lists)
    lens = np.fromiter(map(len, frame_lists), dtype=np.int64, count=n)
    total = int(lens.sum())
    flat = list(chain.from_iterable(frame_lists))
    ptr = _list_addresses(flat) if len(flat) == total else None
    del flat
    if ptr is None:
        return None
    ends = np.cumsum(lens)
    starts = ends - lens
    off = np.arange(total, dtype=np.int64) - np.repeat(starts, lens)  # each object's position in its list
    with np.errstate(over="ignore"):
        h = (ptr.view(np.uint64) + off.view(np.uint64)) * _MIX
        h ^= h >> np.uint64(29)
        h *= _MIX
        csum = np.zeros(total + 1, dtype=np.uint64)
        np.cumsum(h, out=csum[1:])
        key = (csum[ends] - csum[starts]) ^ (lens.view(np.uint64) * _MIX)
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    first_of = first[inverse.reshape(-1)]
    if not np.array_equal(lens[first_of], lens):
        return None
    if total and not np.array_equal(ptr[np.repeat(starts[first_of], lens) + off], ptr):
        return None
    return first_of
