"""The in-job summary: every rank analyses its own snapshot, rank 0 merges the compact results.

A 1,000-rank job gets one report without copying 1,000 snapshots: each rank builds the report of its
own trace on its own CPU (the same analyses and detectors as ``diagnose``) plus its
:class:`~oomdoctor.analysis.ranks.RankProfile` for cross-rank comparison, sends both as JSON (tens
of kB) through :func:`~oomdoctor.capture.gather.gather_payloads`, and rank 0 merges them
(:func:`~oomdoctor.report.merge.merge_reports`), writes ``summary.json`` (``diagnose --format json``'s
schema) and ``summary.txt``, and prints the text report. Ranks that never answer within the timeout
are named in the report; nothing waits on a collective.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .capture.files import atomic_write_bytes
from .capture.gather import DirectoryStore, Gathered, gather_payloads
from .capture.recorder import Recorder, warn
from .render.json import json_default, render_json
from .render.text import render_text_plain
from .report.merge import merge_reports
from .report.model import Report
from .report.pipeline import summarize_rank as summarize_one_rank
from .report.serial import profile_from_plain, profile_to_plain, report_from_plain, report_to_plain
from .trace.load import from_snapshot

SUMMARY_JSON = "summary.json"
SUMMARY_TEXT = "summary.txt"


def rank_payload(snapshot: dict, meta: dict[str, Any], path: str) -> bytes:
    """This rank's report and profile as JSON bytes (what it sends to rank 0)."""
    got = summarize_one_rank(from_snapshot(snapshot, path, meta))
    return json.dumps({"report": report_to_plain(got.report), "profile": profile_to_plain(got.profile)},
                      default=json_default).encode("utf-8")


def merge_payloads(got: Gathered, world_size: int):
    """The merged :class:`~oomdoctor.report.Report` of the gathered payloads.

    A payload that cannot be read counts as missing (named in the report), never as an error."""
    reports, profiles, bad = [], [], []
    for r, raw in sorted(got.payloads.items()):
        try:
            d = json.loads(raw.decode("utf-8"))
            reports.append(report_from_plain(d["report"]))
            profiles.append(profile_from_plain(d["profile"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            bad.append(r)
    return merge_reports(reports, profiles, missing_ranks=sorted(got.missing + bad), world_size=world_size,
                         waited_s=got.waited_s)


def summarize_rank(recorder: Recorder, snapshot: dict, meta: dict[str, Any], *, timeout_s: float = 120.0,
                   print_report: bool = True) -> Report | None:
    """:data:`~oomdoctor.capture.recorder.FinishHook` of ``record(summarize=True)``: rank 0 writes
    ``summary.json`` and ``summary.txt`` and prints the text (``print_report``). Returns the merged
    report on rank 0 (None elsewhere, or when rank 0 could not write the summary)."""
    rank, world = recorder.rank, max(recorder.world_size, 1)
    out_dir = recorder.out_dir
    assert out_dir is not None  # the recorder ran (its directory was writable), so it calls this hook
    path = recorder.written[-1] if recorder.written else os.path.join(out_dir, f"rank{rank}.pickle")
    payload = rank_payload(snapshot, meta, path)
    store, prefix = _store(recorder, out_dir)
    got = gather_payloads(store, prefix, rank, world, payload, timeout_s=timeout_s)
    if got is None:
        return None
    report = merge_payloads(got, world)
    out = os.path.join(out_dir, SUMMARY_JSON)
    text = render_text_plain(report)
    try:
        atomic_write_bytes(out, render_json(report).encode("utf-8"))
        atomic_write_bytes(os.path.join(out_dir, SUMMARY_TEXT), text.encode("utf-8"))
    except OSError as e:
        warn(f"could not write {out}: {e}")
        return None
    if print_report:
        print(text, flush=True)
    return report


def _store(recorder: Recorder, out_dir: str) -> tuple[Any, str]:
    """The job's key-value store (else a directory store in ``out_dir``, the recorder's) and a key prefix unique to
    this run (and restart)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "job")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"oomdoctor/summary/{run}/{restart}"
    if recorder.world_size > 1:
        store = recorder.store or _client_store()
        if store is not None:
            return store, prefix
    return DirectoryStore(out_dir), prefix.replace("/", "_")


def _client_store() -> Any:
    """A client of the launcher's ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``, or None."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        from datetime import timedelta

        import torch.distributed as dist
        # public, but torch.distributed does not re-export it to type checkers (imported from torch._C there)
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=30))  # pyright: ignore[reportPrivateImportUsage]
    except Exception:  # noqa: BLE001
        return None
