"""Issue 50, item 6: the review's findings in preflight, each with a test that failed before its fix, and the
search paths no test reached before (the budget stop, the line guess, the second probe, the OOM's
``device_free``, ``--gpu-memory``'s compute capability, flash attention's backward buffers, cuBLASLt's
workspace, NCCL's bytes for ``--nproc-per-node``)."""

from __future__ import annotations

import json
import os
import pickle
import re

import pytest

torch = pytest.importorskip("torch")

from oomdoctor.cli.main import main  # noqa: E402
from oomdoctor.preflight.tracer import CUBLASLT_WORKSPACE_BYTES, run_traced  # noqa: E402
from oomdoctor.report.preflight import (  # noqa: E402
    MAX_CHECK_TRACES,
    TRACE_TIME_BUDGET_S,
    Replayed,
    largest_micro_batch,
    lay_out,
    margin_bytes,
    room,
)

_TINY = '''
import torch
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(10):
    x = torch.randn(32, 256, device="cuda")
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
'''


@pytest.fixture
def tiny_py(tmp_path):
    f = tmp_path / "tiny.py"
    f.write_text(_TINY)
    return f


# -- Capacity.source is an id ------------------------------------------------------------------------------------

def test_the_rooms_capacity_source_is_an_id_that_has_words():
    """``room()`` passed a sentence where ``Capacity.source`` needs an id of ``SOURCES``: saying it raised KeyError."""
    from oomdoctor.render.words.capacity import said
    from oomdoctor.simulate.capacity import SOURCES

    for given, nccl in ((False, False), (True, True)):
        cap = room(80 << 30, 740 * 10**6, given=given, nccl=nccl)
        assert cap.source in SOURCES and cap.limit_bytes == (80 << 30) - 740 * 10**6
        words = said(cap)
        assert "CUDA context" in words and ("NCCL" in words) == nccl and ("--gpu-memory" in words) == given


# -- private APIs behind checks that fail with one line -----------------------------------------------------------

@pytest.mark.parametrize("owner,name,nproc", [
    ("torch._C.StorageBase", "_expired", 1),
    ("torch._C", "_current_autograd_node", 1),
    ("torch.optim.optimizer", "_get_foreach_kernels_supported_devices", 1),
    ("torch.autograd.graph", "_engine_run_backward", 1),
    ("torch.testing._internal.distributed.fake_pg", "FakeStore", 2),
])
def test_a_missing_private_api_is_one_line_naming_it_and_the_torch_version(owner, name, nproc, tiny_py, monkeypatch,
                                                                          capsys):
    import importlib

    if owner == "torch._C.StorageBase":  # an immutable type: a torch whose StorageBase lacks it
        monkeypatch.setattr(torch._C, "StorageBase", type("StorageBase", (), {}))
    else:
        monkeypatch.delattr(importlib.import_module(owner), name)
    rc = main(["preflight", "--nproc-per-node", str(nproc), "--", "python", str(tiny_py)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{owner}.{name}" in err and f"torch {torch.__version__}" in err


# -- -o through the output helper -------------------------------------------------------------------------------

def test_the_snapshot_replaces_the_previous_file_atomically(tiny_py, tmp_path, capsys):
    """``-o``: a temporary file renamed over the target (a new inode), never the old file truncated and
    rewritten in place; the sidecar beside it likewise."""
    snap = tmp_path / "s.pickle"
    side = tmp_path / "s.meta.json"
    snap.write_bytes(b"OLD")
    side.write_text("{}")
    before = (os.stat(snap).st_ino, os.stat(side).st_ino)
    assert main(["preflight", "-o", str(snap), "--", "python", str(tiny_py)]) == 0
    assert (os.stat(snap).st_ino, os.stat(side).st_ino) != before
    assert pickle.loads(snap.read_bytes())["device_traces"][0]
    assert json.loads(side.read_text())["framework"] == "preflight"


def test_an_output_in_a_missing_directory_is_one_line_before_tracing(tiny_py, tmp_path, capsys, monkeypatch):
    import oomdoctor.preflight.script as script

    def never(*a, **k):
        raise AssertionError("traced before the output was checked")

    monkeypatch.setattr(script, "trace_script", never)
    rc = main(["preflight", "-o", str(tmp_path / "nope" / "s.pickle"), "--", "python", str(tiny_py)])
    err = capsys.readouterr().err
    assert rc == 2 and "nope" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# -- text at 80 columns, binary units --------------------------------------------------------------------------

def test_the_text_fits_80_columns_in_binary_units(tiny_py, capsys):
    assert main(["preflight", "--nproc-per-node", "2", "--", "python", str(tiny_py)]) == 0
    out = capsys.readouterr().out
    long = [ln for ln in out.splitlines() if len(ln) > 80]
    assert long == [], long
    assert not re.search(r"\b[KMG]B\b", out), out
    assert "MiB" in out or "GiB" in out


# -- the search paths -------------------------------------------------------------------------------------------

def _job(fits_up_to, calls, wall_s=0.0, slope=10):
    """A job whose peak allocated grows ``slope`` bytes a sample and which runs out above ``fits_up_to``."""
    def at(n):
        calls.append(n)
        alloc = 100 + slope * n
        return Replayed(n, alloc, alloc, alloc, n > fits_up_to, None, 0, wall_s)
    return at


def test_the_second_probe_of_a_first_size_of_one_is_two():
    calls: list[int] = []
    at = _job(10, calls)
    largest_micro_batch(at, at(1), 10**6)
    assert calls[:2] == [1, 2]


def test_the_third_probe_is_the_lines_prediction():
    """Two traced sizes that fit: the line through their peaks, plus the reserved overhead, predicts the size
    that fills the room less the margin; that is the size probed next."""
    room_bytes = 100_000
    calls: list[int] = []
    at = _job(10**9, calls)  # never an OOM: only the margin decides
    largest_micro_batch(at, at(100), room_bytes)
    line = int(100 + (room_bytes - margin_bytes(room_bytes) - 0 - (100 + 10 * 100)) / 10)
    assert calls[:3] == [100, 50, line]


def test_the_search_stops_at_its_budget_without_an_answer():
    """A job whose peak does not grow with the batch (the line says nothing) and whose traces are slow: after
    MAX_CHECK_TRACES probes past the time budget, no answer (never a size not bracketed)."""
    calls: list[int] = []
    at = _job(700, calls, wall_s=TRACE_TIME_BUDGET_S, slope=0)
    got, seen = largest_micro_batch(at, at(1), 10**6)
    assert got is None and len(calls) == 2 + MAX_CHECK_TRACES


def test_a_laid_out_oom_says_the_room_left_on_the_device():
    """``lay_out``'s ``oom`` entry: ``device_free`` is the room less what the model reserved before the request
    (here one 20 MiB segment of a 30 MiB room; the second 20 MiB request needs a new segment)."""
    MiB = 1 << 20

    def ev(action, addr, size):
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": addr, "frames": []}

    snap = {"segments": [], "device_traces": [[ev("alloc", 1, 20 * MiB), ev("alloc", 2, 20 * MiB)]],
            "allocator_settings": {}}
    out = lay_out(snap, 30 * MiB)["device_traces"][0]
    assert out[-1]["action"] == "oom" and out[-1]["size"] == 20 * MiB
    assert out[-1]["device_free"] == 10 * MiB


def test_gpu_memory_assumes_hoppers_cublas_workspace(tiny_py, tmp_path, capsys):
    """``--gpu-memory`` names no GPU: its compute capability is taken as 9 (Hopper), so the cuBLAS workspace is
    32 MiB, as with ``--gpu H100-80GB``; ``--gpu A100-80GB`` (8) gets 8.125 MiB."""
    def workspaces(*gpu):
        snap = tmp_path / "w.pickle"
        assert main(["preflight", *gpu, "-o", str(snap), "--", "python", str(tiny_py)]) == 0
        meta = json.loads(snap.with_name("w.meta.json").read_text())
        return {k["bytes"] for k in meta["preflight"]["kernel_buffers"] if k["what"] == "cublas_workspace"}
    assert workspaces("--gpu-memory", "80GiB") == {32 << 20}
    assert workspaces("--gpu", "A100-80GB") == {4096 * 1024 * 2 + 16 * 1024 * 8}


def test_flash_attention_backward_adds_its_own_buffers():
    """``mha_bwd``: ``softmax_d`` (b × h × round_up(s, 128) fp32) and ``dq_accum`` (b × round_up(s, 128) × h × d
    fp32), allocated and freed inside the backward kernel; s = 100 rounds to 128."""
    from oomdoctor.preflight.target import target_gpu

    b, h, s, d = 2, 3, 100, 16
    with target_gpu(8):  # an A100: flash (sm90's first choice is cuDNN attention, test_preflight_attention.py)
        rec = run_traced(lambda tr: torch.nn.functional.scaled_dot_product_attention(
            *(torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))).sum().backward())
    back = [e["size"] for e in rec.events if e["action"] == "alloc" and not e["frames"]]
    assert b * h * 128 * 4 in back and b * 128 * h * d * 4 in back


def test_cublaslt_workspace_once_at_the_first_addmm_of_the_main_thread():
    rec = run_traced(lambda tr: [torch.nn.Linear(8, 8)(torch.randn(4, 8, requires_grad=True)).sum().backward()
                                 for _ in range(2)], cublas_workspace_bytes=32 << 20)
    lt = [k for k in rec.extra_allocations if k["what"] == "cublaslt_workspace"]
    assert [(k["bytes"], k["backward"]) for k in lt] == [(CUBLASLT_WORKSPACE_BYTES, False)]


def test_nccl_is_outside_the_allocator_for_nproc_per_node(tiny_py, capsys):
    def outside(n):
        assert main(["preflight", "--nproc-per-node", str(n), "--format", "json", "--", "python", str(tiny_py)]) == 0
        return json.loads(capsys.readouterr().out)
    one, two = outside(1), outside(2)
    assert two["outside_allocator_bytes"] - one["outside_allocator_bytes"] == 880 * 10**6
    assert two["room_bytes"] == one["room_bytes"] - 880 * 10**6
