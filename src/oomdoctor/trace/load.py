"""Loading snapshot files and directories of per-rank files.

``load(path)`` reads one file; ``load_ranks(paths)`` reads files and directories as the ranks of one
job. The rank comes from a sidecar ``*.meta.json`` when present, else from the file name, in the
spellings the frameworks write: ``rank3``/``rank_3``/``rank-3`` (oomdoctor, Composer
``rank{rank}.{batch}.memory_snapshot``, Megatron-Bridge ``snapshot_oom_rank-{N}``), torchtitan's
``{rank:06d}_step_{step}.pickle`` and Megatron-Bridge's ``snapshot_{rank}.pickle``
(``shared/reference/snapshot_format_and_peers.md`` §1.13).
"""

from __future__ import annotations

import gc
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, TypeGuard

from ..errors import SnapshotError
from .build import Drained, build_trace
from .model import Trace
from .reader import OBJECTS_PICKLE, SNIFF_WALK_MIN_BYTES, ProgressFn, decode, read_file, sniff
from .store import load_trace
from .stream import load_streaming, should_stream

_RANK_PATTERNS = (
    re.compile(r"rank[_-]?(\d+)", re.IGNORECASE),
    re.compile(r"^(\d{6})(?=[_.\-]|$)"),
    re.compile(r"^snapshot_(\d+)(?=[_.\-]|$)", re.IGNORECASE),
)
_SNAPSHOT_SUFFIXES = (".pickle", ".pkl", ".pt.trace", ".json")
_COMPRESSED_SUFFIXES = (".gz", ".xz", ".zst", ".bz2")


#: the storage lists of a sidecar module record's root (``capture/facts.py`` ``MODULE_KINDS``): each
#: ``[[address, bytes, part], ...]``
MODULE_FACT_KINDS = ("parameters", "gradients", "untouched", "frozen", "buffers")

def rank_from_name(name: str) -> int | None:
    """The rank spelled in a file name, or None. ``rank_from_name("rank_3.pickle") == 3``."""
    base = os.path.basename(name)
    for pat in _RANK_PATTERNS:
        m = pat.search(base)
        if m:
            return int(m.group(1))
    return None


def _stem(path: str) -> str:
    name = os.path.basename(path)
    for suf in _COMPRESSED_SUFFIXES:
        if name.endswith(suf):
            name = name[: -len(suf)]
    for suf in (".pickle", ".pkl", ".json"):
        if name.endswith(suf):
            return name[: -len(suf)]
    return name


def sidecar_path(path: str) -> str | None:
    """The ``*.meta.json`` written beside a snapshot: ``<stem>.meta.json``, else ``rank{R}.meta.json``."""
    d = os.path.dirname(path) or "."
    candidates = [os.path.join(d, _stem(path) + ".meta.json")]
    r = rank_from_name(path)
    if r is not None:
        candidates.append(os.path.join(d, f"rank{r}.meta.json"))
    return next((c for c in candidates if os.path.isfile(c)), None)


def memory_stats_path(path: str) -> str | None:
    """A ``torch.cuda.memory_stats()`` JSON a framework wrote beside a snapshot that has no sidecar:
    ``<stem>.memory_stats.json``, else ``rank{R}.memory_stats.json`` / ``memory_stats_rank{R}.json``, else
    ``memory_stats.json`` for a snapshot of rank 0 or of no rank (see :func:`read_memory_stats`)."""
    d = os.path.dirname(path) or "."
    candidates = [os.path.join(d, _stem(path) + ".memory_stats.json")]
    r = rank_from_name(path)
    if r is not None:
        candidates += [os.path.join(d, f"rank{r}.memory_stats.json"), os.path.join(d, f"memory_stats_rank{r}.json")]
    if not r:
        candidates.append(os.path.join(d, "memory_stats.json"))
    return next((c for c in candidates if os.path.isfile(c)), None)


def read_memory_stats(path: str) -> dict[str, Any]:
    """Sidecar-like metadata from a ``memory_stats`` JSON: either ``torch.cuda.memory_stats()`` itself (an
    object of numbers, flat as PyTorch returns it) or an object holding it under ``"memory_stats"`` with,
    optionally, ``device``, ``device_free_bytes`` and ``gpu_total_memory_bytes`` (bytes). Returns
    ``{"memory_stats": ..., "memory_stats_file": path, ...}``; the shapes are checked with the sidecar's.

    Raises:
        SnapshotError: the file is not a JSON object (names the file).
    """
    meta = read_sidecar(path)
    out: dict[str, Any]
    if isinstance(meta.get("memory_stats"), dict):
        out = {k: meta[k] for k in ("memory_stats", "device", "device_free_bytes", "gpu_total_memory_bytes")
               if k in meta}
    else:
        out = {"memory_stats": meta}
    out["memory_stats_file"] = path
    return out


def read_sidecar(path: str) -> dict[str, Any]:
    """Parse a sidecar. Raises :class:`SnapshotError` naming the sidecar if it is not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotError(path, f"sidecar metadata is not valid JSON ({str(e)[:120]})") from None
    if not isinstance(meta, dict):
        raise SnapshotError(path, "sidecar metadata must be a JSON object")
    return meta


def is_saved_trace(path: str) -> bool:
    """Is ``path`` a trace written by :meth:`Trace.save` (a zip holding its ``doc`` column)? Never raises."""
    try:
        with open(path, "rb") as f:
            if f.read(2) != b"PK":  # numpy writes the zip from its first byte; zipfile is imported for zips only
                return False
    except OSError:
        return False
    import zipfile

    try:
        if not zipfile.is_zipfile(path):
            return False
        with zipfile.ZipFile(path) as z:
            return "doc.npy" in z.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def load(path: str | os.PathLike[str], *, progress: ProgressFn | None = None, sidecar: bool = True,
         replay_only: bool = False) -> Trace:
    """Read one snapshot file into a :class:`Trace`.

    Accepts ``torch.cuda.memory._dump_snapshot()`` pickles, traces written by :meth:`Trace.save`, the same compressed with gzip, xz, zstd
    or bzip2 (detected by magic bytes), the JSON form pytorch.org/memory_viz accepts, and the older
    list-of-segments pickles of ``torch.cuda.memory_snapshot()``.

    Args:
        path: the file.
        progress: called as ``progress(bytes_read, bytes_total)`` while the file is read.
        sidecar: read ``<stem>.meta.json`` beside the file when present.
        replay_only: build only what the allocator replay reads (:func:`~.build.build_trace`; ``oomdoctor
            simulate``); a saved trace (``.npz``) is read whole.

    Raises:
        SnapshotError: missing, empty, truncated, corrupt, or not a snapshot (message names the file).
        UnsafeSnapshotError: the pickle asks for a global; nothing from it was executed.
    """
    p = os.fspath(path)
    if is_saved_trace(p):  # Trace.save's .npz
        return load_trace(p)
    side = sidecar_path(p) if sidecar else None
    meta = read_sidecar(side) if side else None
    if sidecar and side is None and (stats_file := memory_stats_path(p)) is not None:
        meta = read_memory_stats(stats_file)
    meta, notes = sidecar_meta(meta, p, side)
    # The collector stays paused from the first entry unpickled to the last column built, and the decoded
    # entries are dropped before it resumes: resuming with them alive made the first young collection
    # scan all of them (about 0.15 s of the 28 MB `large` snapshot's 1.5 s, docs/benchmarks.md).
    if _kept:
        _kept.clear()  # the previous file's decoded snapshot is freed before this one is decoded
    with gc_paused():
        drained = None
        if should_stream(p):  # a large framed pickle: its entries are turned into columns as they arrive
            obj, drained = load_streaming(p, progress)
        else:
            data = read_file(p, progress)
            obj = decode(p, data)
            del data
        trace = build_trace(p, obj, drained, sidecar=meta, sidecar_warnings=notes, replay_only=replay_only)
        if _kept is not None:
            _kept.append(obj)
            gc.freeze()  # the collector never scans them (nor what was built before): see keep_decoded
        del obj
    return trace


#: The decoded snapshot of the last file :func:`load` read, kept alive instead of freed, once :func:`keep_decoded`
#: was called; None (the default) frees each as soon as its trace is built.
_kept: list | None = None


def keep_decoded() -> None:
    """From now on, :func:`load` keeps the decoded snapshot of the last file it read (the previous one is freed when
    the next file is read, so at most one is held) and moves everything alive to the collector's permanent
    generation (``gc.freeze``), so that no collection scans the millions of kept objects. For a process that ends
    with ``os._exit`` right after its command (:func:`oomdoctor.cli.main.exit_now`): freeing the decoded entries
    of ``large`` costs about 0.05 s (``benchmarks/diagnose_stages.py``, "drop the entries") that such a process
    never needs to pay. The analyses' peak memory then holds the decoded entries beside the trace."""
    global _kept
    if _kept is None:
        _kept = []


def from_snapshot(obj: Any, path: str, meta: dict[str, Any] | None = None, *,
                  sidecar_file: str | None = None, drained: Drained | None = None, replay_only: bool = False) -> Trace:
    """A :class:`Trace` from a snapshot already in memory (``torch.cuda.memory._snapshot()``'s dict,
    or a decoded file), with sidecar metadata ``meta`` merged in (:func:`sidecar_meta`: its fields of the wrong
    shape dropped, a rank it does not give taken from ``path``'s name). ``path`` names the snapshot in messages.
    ``replay_only``: as :func:`~.build.build_trace`.

    Raises:
        SnapshotError: as :func:`load`.
    """
    side, notes = sidecar_meta(meta, path, sidecar_file)
    with gc_paused():
        return build_trace(path, obj, drained, sidecar=side, sidecar_warnings=notes, replay_only=replay_only)


def sidecar_meta(meta: dict[str, Any] | None, path: str, sidecar_file: str | None = None
                 ) -> tuple[dict[str, Any], list[str]]:
    """What a trace's ``meta`` takes from the sidecar metadata ``meta`` of the snapshot ``path`` (read from
    ``sidecar_file``), and the warnings to say with it: a copy of ``meta`` without its fields of the wrong shape
    (:func:`_drop_malformed`, named in a warning), with ``"sidecar"``: ``sidecar_file``, and the rank in ``path``'s
    name (:func:`rank_from_name`, None when none) where ``meta`` gives none."""
    side = dict(meta or {})
    dropped = _drop_malformed(side)
    if meta and sidecar_file:
        side["sidecar"] = sidecar_file
    if side.get("rank") is None:
        side["rank"] = rank_from_name(path)
    return side, [f"sidecar fields of the wrong shape were ignored: {', '.join(dropped)}"] if dropped else []


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector waits inside the block, and is enabled again after it if it was before.
    Unpickling a snapshot creates millions of small dicts and lists; the collector would scan them again and
    again while they are created (more than doubling the time). None of them can form a cycle worth
    collecting here, so collection waits until the trace is built. The replay's ``prepare`` and loop use it
    for the same reason (:mod:`oomdoctor.simulate.replay`)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_INT_FIELDS = ("gpu_total_memory_bytes", "device_free_bytes", "memory_cap_bytes", "world_size", "micro_batch",
               "rank", "local_rank", "steps_completed", "device")
_DICT_FIELDS = ("recording", "env", "oom")
_STR_FIELDS = ("torch_version", "cuda_version", "nccl_version", "gpu_name", "framework")
#: A sidecar's ``gpu_total_memory_bytes`` above this (4 TiB) is not a GPU's and is dropped.
MAX_GPU_BYTES = 1 << 42


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _storage_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 and all(_is_int(x) for x in p) for p in v)


def _part_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(p, list) and len(p) == 3 and all(_is_int(x) for x in p) for p in v)


def _drop_malformed(meta: dict[str, Any]) -> list[str]:
    """Sidecar fields the analyses read, of the wrong shape, are dropped from ``meta`` (the sidecar's metadata),
    and their names returned, for a warning (the snapshot itself is fine): ``memory_stats`` (an object of numbers), ``device_counters`` (objects with an integer
    ``device`` and non-negative integers or nulls, :func:`oomdoctor.capture.metadata.device_counters`), ``tensors`` (records of an integer
    ``time_us`` and ``[data_ptr, nbytes]`` integer pairs, :mod:`oomdoctor.capture.facts`), ``modules`` (records of an
    integer ``time_us`` and ``roots`` whose ``parameters`` / ``gradients`` / ``untouched`` / ``frozen`` / ``buffers``
    are ``[data_ptr, nbytes, part]`` integer triples),
    ``phase_markers`` / ``step_markers`` (objects with an integer ``time_us``, phases a string ``phase``),
    ``memory_fraction`` (a number in [0, 1]), and the fields of :data:`_INT_FIELDS` (non-negative
    integers), :data:`_DICT_FIELDS` (objects) and :data:`_STR_FIELDS` (strings). A wrong ``rank`` falls back
    to the one in the file name (:func:`from_snapshot`)."""
    bad = []
    stats = meta.get("memory_stats")
    if stats is not None and not (isinstance(stats, dict) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in stats.items())):
        bad.append("memory_stats")
    counters = meta.get("device_counters")
    if counters is not None and not (isinstance(counters, list) and all(
            isinstance(c, dict) and _is_int(c.get("device")) and all(
                v is None or (_is_int(v) and v >= 0) for k, v in c.items() if k != "device") for c in counters)):
        bad.append("device_counters")
    recs = meta.get("tensors")
    if recs is not None and not (isinstance(recs, list) and all(
            isinstance(r, dict) and _is_int(r.get("time_us"))
            and all(_storage_list(r.get(k, [])) for k in ("parameters", "gradients", "optimizer_state", "workspaces"))
            for r in recs)):
        bad.append("tensors")
    mods = meta.get("modules")
    if mods is not None and not (isinstance(mods, list) and all(
            isinstance(r, dict) and _is_int(r.get("time_us")) and isinstance(r.get("roots"), list) and all(
                isinstance(root, dict) and isinstance(root.get("class", ""), str)
                and all(_part_list(root.get(k, [])) for k in MODULE_FACT_KINDS)
                for root in r["roots"]) for r in mods)):
        bad.append("modules")
    marks = meta.get("phase_markers")
    if marks is not None and not (isinstance(marks, list) and all(
            isinstance(m, dict) and _is_int(m.get("time_us")) and isinstance(m.get("phase"), str) for m in marks)):
        bad.append("phase_markers")
    steps = meta.get("step_markers")
    if steps is not None and not (isinstance(steps, list) and all(
            isinstance(m, dict) and _is_int(m.get("time_us")) for m in steps)):
        bad.append("step_markers")
    frac = meta.get("memory_fraction")
    if frac is not None and not (isinstance(frac, (int, float)) and not isinstance(frac, bool) and 0 <= frac <= 1):
        bad.append("memory_fraction")  # NaN fails the range test too
    bad += [k for k in _INT_FIELDS if meta.get(k) is not None and not (_is_int(meta[k]) and meta[k] >= 0)]
    total = meta.get("gpu_total_memory_bytes")
    if "gpu_total_memory_bytes" not in bad and _is_int(total) and not 0 < total <= MAX_GPU_BYTES:
        bad.append("gpu_total_memory_bytes")  # no GPU has 0 bytes or more than 4 TiB
    bad += [k for k in _DICT_FIELDS if meta.get(k) is not None and not isinstance(meta[k], dict)]
    bad += [k for k in _STR_FIELDS if meta.get(k) is not None and not isinstance(meta[k], str)]
    for k in bad:
        del meta[k]
    return bad


@dataclass(frozen=True)
class Skipped:
    """A file that a directory holds beside its snapshots and that was not read as one, with why.

    ``rank`` is the rank the file claims (:func:`claimed_rank`: its sidecar, else its name) when it is named like a
    snapshot and could not be read as one: cut off, corrupt, or refused because unpickling it would run code. Such a
    file is a rank of the job that was lost, not a file beside the snapshots: the job's result is incomplete
    (:attr:`oomdoctor.report.model.Report.unread`, and ``--fail-on`` fails). None for a file that is plainly not a
    snapshot (a log, a metrics JSON, a zip checkpoint) or that claims no rank."""

    path: str
    reason: str
    rank: int | None = None


def claimed_rank(path: str) -> int | None:
    """The rank a file claims without being read: its sidecar's ``rank`` (:func:`sidecar_path`), else the rank in
    its name (:func:`rank_from_name`); None when neither says. A sidecar that is not valid JSON claims nothing."""
    side = sidecar_path(path)
    if side is not None:
        try:
            r = read_sidecar(side).get("rank")
        except SnapshotError:
            r = None
        if _is_int(r) and r >= 0:
            return r
    return rank_from_name(path)


def lost_rank(path: str) -> int | None:
    """The rank a file named like a snapshot claims (:func:`claimed_rank`), for a file of a directory that could not
    be read: that rank's data is lost. None for a name that is not a snapshot's."""
    return claimed_rank(path) if _looks_like_snapshot(os.path.basename(path)) else None


def refuse_unranked(files: list[str], ranks: list[int | None], named: set[str]) -> None:
    """Refuse a directory holding two or more snapshots whose rank neither a sidecar nor the file name gives: they
    may be separate runs (two single-GPU jobs) as well as the ranks of one, and numbering them by path order would
    compare them as ranks. Files named one by one (``named``) are the user's own grouping and pass.

    Raises:
        SnapshotError: naming the directory, how many files give no rank, and the first of them.
    """
    by_dir: dict[str, list[str]] = {}
    for f, r in zip(files, ranks):
        if r is None and f not in named:
            by_dir.setdefault(os.path.dirname(f), []).append(os.path.basename(f))
    for d, names in sorted(by_dir.items()):
        if len(names) > 1:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise SnapshotError(d, f"{len(names)} snapshots here give no rank, in their names or a sidecar "
                                   f"({shown}): they may be separate runs, so they are not read as the ranks of "
                                   "one job; diagnose each file on its own, or name them by rank: rank0.pickle, "
                                   "rank1.pickle, ...")


def none_loads(directory: str, skipped: list[Skipped]) -> SnapshotError:
    """The error for a directory none of whose files loads: one line with how many files it holds
    (``skipped``: all of them, with why each was passed over) and every one that has a reason, each with it
    (those named like snapshots first)."""
    bad = sorted((s for s in skipped if s.reason), key=lambda s: not _looks_like_snapshot(os.path.basename(s.path)))
    why = " | ".join(f"{os.path.basename(s.path)}: {s.reason}" for s in bad)
    return SnapshotError(directory, f"none of the {len(skipped)} files in this directory is a snapshot that loads"
                                    + (f": {why}" if why else ""))


def discover(paths: Iterable[str | os.PathLike[str]], skipped: list[Skipped] | None = None) -> list[str]:
    """Expand directories into the snapshot files they hold (sorted); files pass through.

    A directory may hold other files (metrics JSON, logs, checkpoints): those whose name is not a
    snapshot's, and those whose first MiB shows they are not one (:func:`~.reader.sniff`), are appended to
    ``skipped`` when given. The recorder's own files (sidecars, ``summary.*``, hidden temporaries) are
    passed over silently.

    Raises:
        SnapshotError: a path does not exist, or a directory holds no snapshot file.
    """
    out: list[str] = []
    for raw in paths:
        p = os.fspath(raw)
        if os.path.isdir(p):
            from pathlib import Path  # a directory only: pathlib costs a file 10-40 ms of start-up

            found, other = [], []
            for f in sorted(Path(p).iterdir(), key=lambda f: f.name):
                if _ours(f.name):
                    continue
                if not f.is_file():
                    other.append(Skipped(str(f), "a directory" if f.is_dir() else "not a regular file"))
                elif not _looks_like_snapshot(f.name):
                    other.append(Skipped(str(f), ""))
                elif (why := sniff(str(f), walk=f.stat().st_size > SNIFF_WALK_MIN_BYTES)) is not None:
                    # a zip or a JSON of other things is plainly not a snapshot; a pickle that would run code,
                    # named as a rank's, is that rank's snapshot refused (as load refuses a small one)
                    other.append(Skipped(str(f), why, lost_rank(str(f)) if why.startswith(OBJECTS_PICKLE) else None))
                else:
                    found.append(str(f))
            if not found:
                names = ", ".join(os.path.basename(s.path) for s in other[:5]) + (" ..." if len(other) > 5 else "")
                raise SnapshotError(p, "directory holds no snapshot files (*.pickle, *.pkl, *.json, optionally "
                                       ".gz/.xz/.zst/.bz2)" + (f"; it holds {names}" if other else ""))
            if skipped is not None:
                skipped.extend(other)
            out.extend(prefer_one_per_rank(found))
        elif os.path.exists(p):
            out.append(p)
        else:
            raise SnapshotError(p, "no such file or directory")
    return out


_RECORDER_NAME = re.compile(r"^rank(\d+)(?:_(oom)|_step(\d+))?\.pickle$")


def prefer_one_per_rank(files: list[str]) -> list[str]:
    """Among the files ``oomdoctor.record`` names in one directory (``rank{R}.pickle``,
    ``rank{R}_step{S}.pickle``, ``rank{R}_oom.pickle``), keep one per rank: the OOM dump, else the
    whole run, else the last step window. Other files pass through unchanged."""
    best: dict[int, tuple[tuple[int, int], str]] = {}
    out = []
    for f in files:
        m = _RECORDER_NAME.match(os.path.basename(f))
        if not m:
            out.append(f)
            continue
        rank, oom, step = int(m.group(1)), m.group(2), m.group(3)
        key = (2, 0) if oom else (1, 0) if step is None else (0, int(step))
        if rank not in best or key > best[rank][0]:
            best[rank] = (key, f)
    return sorted(out + [f for _, f in best.values()])


def _ours(name: str) -> bool:
    """Files the recorder writes beside the snapshots: sidecars, the in-job summary, hidden temporaries; and
    the ``memory_stats`` JSON frameworks write (:func:`memory_stats_path`)."""
    return (name.endswith((".meta.json", ".memory_stats.json")) or name in ("summary.json", "summary.txt")
            or name.startswith(".") or (name.startswith("memory_stats") and name.endswith(".json")))


def _looks_like_snapshot(name: str) -> bool:
    if _ours(name):
        return False
    base = name
    for suf in _COMPRESSED_SUFFIXES:
        if base.endswith(suf):
            base = base[: -len(suf)]
    return base.endswith(_SNAPSHOT_SUFFIXES)


def load_ranks(paths: Iterable[str | os.PathLike[str]], *, progress: ProgressFn | None = None,
               skipped: list[Skipped] | None = None, replay_only: bool = False) -> list[Trace]:
    """Read files and directories as the ranks of one job, sorted by rank (``replay_only``: as :func:`load`).

    Files whose rank cannot be told (no sidecar, no rank in the name) are numbered in path order
    after the known ranks, with a warning on each; two or more such files found in one directory are refused
    (:func:`refuse_unranked`).

    Files named on the command line must load. Files found in a directory may be something else (a
    metrics JSON, a checkpoint): with ``skipped`` given, those that are not snapshots, or do not load,
    are appended to it with the reason, and only a directory without any loadable snapshot is an error.

    Raises:
        SnapshotError: as :func:`load` (for a directory: when none of its files loads); also when two
            files claim the same rank, or a directory holds several files that give no rank.
    """
    paths = [os.fspath(p) for p in paths]
    own: list[Skipped] = []
    files = discover(paths, own if skipped is not None else None)
    named = {p for p in paths if not os.path.isdir(p)}
    traces = []
    for f in files:
        if f in named or skipped is None:
            traces.append(load(f, progress=progress, replay_only=replay_only))
            continue
        try:
            traces.append(load(f, progress=progress, replay_only=replay_only))
        except SnapshotError as e:
            own.append(Skipped(f, e.problem, lost_rank(f)))
    if skipped is not None:
        skipped.extend(sorted(own, key=lambda s: s.path))
        dirs = [p for p in paths if os.path.isdir(p)]

        def inside(path: str, d: str) -> bool:
            return os.path.normpath(os.path.dirname(path)) == os.path.normpath(d)

        for d in dirs:
            if not any(inside(t.path, d) for t in traces):
                raise none_loads(d, [s for s in own if inside(s.path, d)])
    if len(traces) > 1:
        refuse_unranked([t.path for t in traces], [t.rank for t in traces], named)
        seen: dict[int, str] = {}
        for t in traces:
            if t.rank is None:
                continue
            if t.rank in seen:
                raise SnapshotError(t.path, f"claims rank {t.rank}, like {seen[t.rank]}: pass the files of one "
                                            "run at a time (a directory may hold several runs)")
            seen[t.rank] = t.path
        nxt = max(seen, default=-1) + 1
        for t in traces:
            if t.rank is None:
                t.meta["rank"] = nxt
                t.warnings.append(f"rank not found in the file name or a sidecar: numbered {nxt} by path order")
                nxt += 1
    elif traces and traces[0].rank is None:
        traces[0].meta["rank"] = 0
        traces[0].meta["rank_assumed"] = True
    return sorted(traces, key=lambda t: t.rank if t.rank is not None else 0)
