"""pytest plugin (entry point ``pytest11``): a CUDA memory limit per test, and a report of each test's peak.

``@pytest.mark.limit_cuda_memory("2 GiB")`` fails a test whose peak CUDA memory exceeds the limit,
the way ``pytest-memray``'s ``limit_memory`` does for host memory. Options of the marker:

- ``measure="allocated"`` (default; ``torch.cuda.max_memory_allocated``: bytes of live tensors) or
  ``"reserved"`` (``max_memory_reserved``: what the caching allocator holds from CUDA; the cache is
  emptied before the test so that it starts from the memory still allocated);
- ``device``: the CUDA device index (default: the current device).

What is measured: the peak during the test's call phase **less what was already allocated (or
reserved) when it began** (fixtures, earlier tests): the memory the test itself adds, as
``limit_memory`` counts what a test allocates. Both numbers are in the failure message.

When a marked test exceeds its limit, the plugin writes the CUDA memory snapshot of that test
(recorded with ``torch.cuda.memory._record_memory_history`` while it ran, by
:class:`~oomdoctor.capture.recorder.Recorder`) to ``<dir>/<test>/rank0.pickle`` (``dir``:
``--cuda-memory-snapshots``, default ``oomdoctor-snapshots`` in pytest's base temporary directory),
and the failure message carries what held the memory at the peak (:mod:`oomdoctor.analysis.holders`)
and the path. Without a CUDA device a marked test is skipped.

``--cuda-memory-report`` prints the peak allocated and reserved memory of every test that ran while
CUDA was initialised, largest first.

This module imports neither torch nor the analyses until a test needs them: pytest loads it in every
session of an environment where oomdoctor is installed.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import pytest

MARKER = "limit_cuda_memory"
MEASURES = ("allocated", "reserved")
REPORT_ROWS = 20


@dataclass
class Usage:
    """One test's CUDA memory (bytes): at its start, the peak during it, and the limit when marked."""

    nodeid: str
    device: int
    start_allocated: int
    start_reserved: int
    peak_allocated: int
    peak_reserved: int
    measure: str = "allocated"
    limit: int | None = None
    snapshot: str | None = None
    holders: str | None = None

    @property
    def used(self) -> int:
        """The measured bytes: the peak less what was held at the start."""
        if self.measure == "reserved":
            return self.peak_reserved - self.start_reserved
        return self.peak_allocated - self.start_allocated

    @property
    def exceeded(self) -> bool:
        return self.limit is not None and self.used > self.limit


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("oomdoctor", "CUDA memory (oomdoctor)")
    group.addoption("--cuda-memory-report", action="store_true", default=False,
                    help="print each test's peak CUDA memory (allocated and reserved), largest first")
    group.addoption("--cuda-memory-snapshots", metavar="DIR", default=None,
                    help="where to write the snapshots of tests over their limit_cuda_memory "
                         "(default: oomdoctor-snapshots in pytest's base temporary directory)")


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(limit, *, measure='allocated', device=None): fail the test when the CUDA memory "
        "it adds at its peak (allocated or reserved) exceeds limit, e.g. '2 GiB' or a number of bytes "
        "(oomdoctor); skipped without a CUDA device")
    config._oomdoctor_usage = []  # type: ignore[attr-defined]


def parse_marker(marker: Any) -> tuple[int, str, int | None]:
    """``(limit_bytes, measure, device)`` of a ``limit_cuda_memory`` marker.

    Raises:
        pytest.UsageError: no limit, an unreadable or non-positive size, an unknown ``measure``.
    """
    from .errors import UsageError
    from .units import parse_bytes

    if len(marker.args) != 1:
        raise pytest.UsageError(f"{MARKER} takes one limit, e.g. {MARKER}('2 GiB'), got {marker.args!r}")
    limit, = marker.args
    try:
        nbytes = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else parse_bytes(str(limit))
    except UsageError as e:
        raise pytest.UsageError(f"{MARKER}: {e}") from None
    measure = marker.kwargs.get("measure", "allocated")
    if measure not in MEASURES:
        raise pytest.UsageError(f"{MARKER}: measure={measure!r}, expected one of {', '.join(MEASURES)}")
    unknown = set(marker.kwargs) - {"measure", "device"}
    if unknown:
        raise pytest.UsageError(f"{MARKER}: unknown option(s) {', '.join(sorted(unknown))}")
    device = marker.kwargs.get("device")
    return nbytes, measure, None if device is None else int(device)


def _cuda(need: bool) -> Any:
    """torch when CUDA is usable; when not ``need``, only if torch is already imported and CUDA initialised."""
    torch = sys.modules.get("torch")
    if torch is None and need:
        try:
            import torch
        except ImportError:
            return None
    if torch is None:
        return None
    try:
        if need:
            return torch if torch.cuda.is_available() else None
        return torch if torch.cuda.is_initialized() else None
    except Exception:  # noqa: BLE001
        return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: Any) -> None:
    marker = item.get_closest_marker(MARKER)
    if marker is not None:
        parse_marker(marker)
        if _cuda(need=True) is None:
            pytest.skip(f"{MARKER}: no CUDA device")


def _snapshot_dir(config: Any, nodeid: str) -> str:
    base = config.getoption("cuda_memory_snapshots")
    if base is None:
        try:
            base = str(config._tmp_path_factory.getbasetemp() / "oomdoctor-snapshots")
        except Exception:  # noqa: BLE001 - private API moved
            base = os.path.join(tempfile.gettempdir(), "oomdoctor-snapshots")
    return os.path.join(base, re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:200] or "test")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any):
    marker = item.get_closest_marker(MARKER)
    if marker is None and not item.config.getoption("cuda_memory_report"):
        yield
        return
    torch = _cuda(need=marker is not None)
    if torch is None:
        yield
        torch = _cuda(need=False)  # the test itself may have initialised CUDA: its peak is the process's
        if torch is not None:
            dev = torch.cuda.current_device()
            _record(item, Usage(item.nodeid, dev, 0, 0, int(torch.cuda.max_memory_allocated(dev)),
                                int(torch.cuda.max_memory_reserved(dev))))
        return
    limit, measure, device = parse_marker(marker) if marker is not None else (None, "allocated", None)
    dev = torch.cuda.current_device() if device is None else device
    recorder = None
    if marker is not None:
        from .capture.recorder import Recorder

        recorder = Recorder(_snapshot_dir(item.config, item.nodeid), on_oom=False).start()
    torch.cuda.synchronize(dev)
    if measure == "reserved":
        torch.cuda.empty_cache()
    start_a, start_r = int(torch.cuda.memory_allocated(dev)), int(torch.cuda.memory_reserved(dev))
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        yield
    finally:
        torch.cuda.synchronize(dev)
        usage = Usage(item.nodeid, dev, start_a, start_r, int(torch.cuda.max_memory_allocated(dev)),
                      int(torch.cuda.max_memory_reserved(dev)), measure, limit)
        if recorder is not None:
            if usage.exceeded:
                usage.snapshot = recorder.dump_now("rank0.pickle", "test")
            recorder.stop(dump=False)
        if usage.snapshot is not None:
            usage.holders = _holders(usage.snapshot)
        _record(item, usage)


def _holders(path: str) -> str:
    """What held the memory at the peak, from the snapshot just written (never raises)."""
    try:
        from . import load
        from .render.text import render_peak_holders
        from .report.pipeline import build_report

        return render_peak_holders(build_report([load(path)]))
    except Exception as e:  # noqa: BLE001 - the message must still say the test failed
        return f"holders unknown ({type(e).__name__}: {e})"


def _record(item: Any, usage: Usage) -> None:
    item._oomdoctor_usage = usage
    item.config._oomdoctor_usage.append(usage)


def failure_message(u: Usage) -> str:
    """The failure text of a test over its limit (bytes shown as people read them)."""
    from .render.format import format_bytes

    peak, start = (u.peak_reserved, u.start_reserved) if u.measure == "reserved" else (u.peak_allocated, u.start_allocated)
    lines = [f"{MARKER}: the test's peak {u.measure} CUDA memory on cuda:{u.device} exceeds its limit: "
             f"{format_bytes(u.used)} > {format_bytes(u.limit or 0)} "
             f"(peak {format_bytes(peak)} less {format_bytes(start)} held when the test began)"]
    if u.holders:
        lines.append(u.holders)
    if u.snapshot:
        lines.append(f"snapshot: {u.snapshot} (oomdoctor diagnose {u.snapshot}; opens in pytorch.org/memory_viz)")
    else:
        lines.append("no snapshot could be written (see the warning above)")
    return "\n".join(lines)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any):
    outcome = yield
    report = outcome.get_result()
    usage = getattr(item, "_oomdoctor_usage", None)
    if call.when != "call" or usage is None or not usage.exceeded:
        return
    message = failure_message(usage)
    if report.passed:
        report.outcome = "failed"
        report.longrepr = message
    else:
        report.sections.append(("CUDA memory limit exceeded (oomdoctor)", message))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    if not config.getoption("cuda_memory_report"):
        return
    from .render.format import format_bytes

    usage = sorted(getattr(config, "_oomdoctor_usage", []), key=lambda u: -u.peak_allocated)
    terminalreporter.section("CUDA memory per test (oomdoctor)")
    if not usage:
        terminalreporter.write_line("no test ran with CUDA initialised")
        return
    terminalreporter.write_line(f"{'peak allocated':>15} {'peak reserved':>15} {'added':>12}  test")
    for u in usage[:REPORT_ROWS]:
        terminalreporter.write_line(f"{format_bytes(u.peak_allocated):>15} {format_bytes(u.peak_reserved):>15} "
                                    f"{format_bytes(u.peak_allocated - u.start_allocated):>12}  {u.nodeid}")
    if len(usage) > REPORT_ROWS:
        terminalreporter.write_line(f"... and {len(usage) - REPORT_ROWS} more")
