"""How each process of a trial of ``oomdoctor fit`` / ``verify`` ended, as PyTorch saw it: the exit records.

With ``"exits": DIR`` in ``OOMDOCTOR_RUN_CONFIG`` (set with ``stop_after_steps``), the injection
(:mod:`.autorecord`) writes one small JSON per process that initialised CUDA or stepped an optimizer, named
``pid{P}.json`` in ``DIR``:

- at the stop after K optimizer steps, before ``os._exit(0)``: ``"stopped": true``;
- at interpreter exit otherwise (``atexit``: a normal end, ``sys.exit``, an uncaught exception): ``"stopped":
  false``. A process killed by a signal writes none.

Each holds ``pid``, ``rank``, ``steps`` (optimizer steps counted), ``steps_asked`` (K), ``cuda`` (CUDA was
initialised) and ``memory_stats``: the counters of ``torch.cuda.memory_stats()`` for the current device that say
how the run went (:data:`KEPT_STATS`; None without CUDA). ``oomdoctor fit`` and ``verify`` read them
(:func:`oomdoctor.report.loop.trial_outcome`) before the exit code and the output.

Pure Python (no torch): the writer takes the counters it is given.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from .files import atomic_write_json

EXITS_FORMAT = 1
#: the counters kept: ``num_ooms`` (out-of-memory errors the caching allocator raised, caught or not),
#: ``num_alloc_retries`` (cudaMalloc retried after freeing the cache), the peaks reserved and allocated (bytes)
KEPT_STATS = ("num_ooms", "num_alloc_retries", "reserved_bytes.all.peak", "allocated_bytes.all.peak")
_NAME = re.compile(r"^pid(\d+)\.json$")


def exit_record(*, stopped: bool, steps: int, steps_asked: int, rank: int, pid: int, cuda: bool,
                memory_stats: dict[str, Any] | None) -> dict[str, Any]:
    """One process's exit record (the module doc); ``memory_stats`` cut to :data:`KEPT_STATS`."""
    stats = None
    if isinstance(memory_stats, dict):
        stats = {k: int(v) for k, v in memory_stats.items() if k in KEPT_STATS and isinstance(v, (int, float))}
    return {"format": EXITS_FORMAT, "pid": int(pid), "rank": int(rank), "stopped": bool(stopped),
            "steps": int(steps), "steps_asked": int(steps_asked), "cuda": bool(cuda), "memory_stats": stats}


def write_exit_record(directory: str, record: dict[str, Any]) -> str:
    """Write ``record`` as ``directory/pid{P}.json`` (atomically; the directory is created). Its path.

    Raises:
        OSError, OutputError: the directory cannot be created or written.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"pid{int(record['pid'])}.json")
    atomic_write_json(path, record)
    return path


def read_exit_records(directory: str) -> list[dict[str, Any]]:
    """The exit records in ``directory``, by pid; a missing directory gives none, an unreadable or foreign file is
    skipped (a record is only what :func:`exit_record` writes: a JSON object with a boolean ``stopped``)."""
    try:
        names = sorted(n for n in os.listdir(directory) if _NAME.match(n))
    except OSError:
        return []
    out = []
    for n in names:
        try:
            with open(os.path.join(directory, n), encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("stopped"), bool):
            out.append(rec)
    return out


def clear_exit_records(directory: str) -> None:
    """Remove the exit records a previous trial left in ``directory`` (only ``pid{P}.json``)."""
    try:
        names = [n for n in os.listdir(directory) if _NAME.match(n)]
    except OSError:
        return
    for n in names:
        try:
            os.unlink(os.path.join(directory, n))
        except OSError:
            pass
