"""Issue 41 on a GPU: the counters the recorder writes at a dump are PyTorch's own, read at the dump.

A job whose peak comes first (a large block, freed) then many small allocations, recorded by
:class:`oomdoctor.capture.Recorder` with a ring buffer too small to keep the peak; right after the dump the
test reads ``torch.cuda.memory_stats()`` itself and compares. Nothing is allocated between the dump and that
read, so the peaks, the retry and OOM counts and the device alloc/free counts must be equal, and the current
bytes too. Then ``diagnose`` must report the job's peak, above the window's. Run:
``python -m pytest -m gpu tests/gpu/test_job_counters_gpu.py -v``.
"""

from __future__ import annotations

import json

import pytest

from oomdoctor.capture import Recorder
from oomdoctor.capture.metadata import COUNTER_KEYS

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def test_recorded_counters_equal_memory_stats_read_right_after_the_dump(tmp_path):
    import torch

    from oomdoctor.analysis.device import analyze
    from oomdoctor.trace import load

    dev = torch.cuda.current_device()
    rec = Recorder(str(tmp_path), max_entries=200, on_oom=False).start()
    try:
        big = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")  # the job's peak, soon out of the window
        del big
        keep = [torch.empty(1 * MiB, dtype=torch.uint8, device="cuda") for _ in range(64)]
        for _ in range(300):  # pushes the peak's events out of the 200-entry ring buffer
            x = torch.empty(256 * 1024, dtype=torch.uint8, device="cuda")
            del x
        path = rec.dump_now("rank0.pickle", "final")
        stats = torch.cuda.memory_stats(dev)
        free, total = torch.cuda.mem_get_info(dev)
    finally:
        rec.stop(dump=False)
    assert path is not None
    meta = json.loads((tmp_path / "rank0.meta.json").read_text())
    [c] = [c for c in meta["device_counters"] if c["device"] == dev]
    for k in COUNTER_KEYS:
        assert c[k] == stats[k], k
    assert c["device_total_bytes"] == total
    assert c["gpu_total_memory_bytes"] == torch.cuda.get_device_properties(dev).total_memory
    assert abs(c["device_free_bytes"] - free) <= 64 * MiB  # other processes may use the GPU meanwhile
    assert c["allocated_bytes.all.peak"] >= 512 * MiB

    a = analyze(load(path))
    p = a.job_peak
    assert p.source == "sidecar"
    assert p.job_peak_allocated_bytes == stats["allocated_bytes.all.peak"]
    # the window holds the 64 blocks kept and what was alive before (other tests' tensors), not the 512 MiB block
    assert p.allocated_missed and p.job_peak_allocated_bytes - p.window_peak_allocated_bytes >= 400 * MiB
    del keep
