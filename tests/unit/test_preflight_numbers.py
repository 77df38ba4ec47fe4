"""Preflight's numbers against the snapshot it writes (issue 52): what ``oomdoctor preflight`` says of a traced job
(its events, its breakdown and where each line comes from, its optimizer steps) is what ``oomdoctor diagnose`` says of
the snapshot it wrote, and its gradients are the gradients its own sidecar lists.

The job: a user's script (two ``Linear`` layers whose weights are 32 MiB each in fp32, AdamW, bf16 autocast), traced
under fake tensors for 2 optimizer steps; the autograd engine's cuBLAS workspace is 32 MiB too, a parameter's size."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

pytest.importorskip("torch")

from oomdoctor.cli.main import main  # noqa: E402

MiB = 1 << 20

_SCRIPT = '''
import torch

model = torch.nn.Sequential(torch.nn.Linear(1024, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 1024)).to("cuda")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    x = torch.randn(64, 1024, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
'''


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    d = tmp_path_factory.mktemp("pf52")
    (d / "train.py").write_text(_SCRIPT)
    snap = d / "s.pickle"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["preflight", "--gpu", "H100-80GB", "--no-search", "--format", "json", "-o", str(snap), "--",
                     "python", str(d / "train.py")]) == 0
    pf = json.loads(out.getvalue())
    meta = json.loads(snap.with_name("s.meta.json").read_text())
    dg = d / "diagnose.json"
    assert main(["diagnose", str(snap), "--format", "json", "-o", str(dg)]) == 0
    return pf, meta, json.loads(dg.read_text())


def test_the_gradients_are_the_ones_the_sidecar_lists(traced):
    """The autograd engine's cuBLAS workspace (32 MiB, kept for good, a weight's size) is a workspace the tracer
    made, never a gradient: preflight said 96.04 MiB of gradients where its sidecar lists 64.04 MiB."""
    pf, meta, _ = traced
    listed = {tuple(g) for rec in meta["tensors"] for g in rec["gradients"]}
    assert pf["breakdown"]["gradients"] == sum(n for rec in meta["tensors"][-1:] for _, n in rec["gradients"])
    assert pf["breakdown"]["gradients"] <= sum(n for _, n in listed)
    kernel = meta["preflight"]["kernel_buffers"]
    assert sum(k["bytes"] for k in kernel if k["what"] == "cublas_workspace") == 64 * MiB
    assert pf["breakdown"]["workspaces"] >= 64 * MiB and pf["breakdown_sources"]["workspaces"] == "recorded"


def test_diagnose_of_the_snapshot_says_what_preflight_said(traced):
    """The snapshot's events are preflight's (the allocator model's segment calls included), its breakdown at the
    peak allocated is preflight's line by line and source by source (the sidecar's facts name the laid-out blocks),
    and its steps are the 2 traced: "2 optimizer steps", "2 steps (markers)"."""
    pf, _, dg = traced
    r = dg["ranks"][0]
    assert r["events"] == pf["events"]
    bd = next(b for b in r["breakdowns"] if b["at"] == "peak_allocated")
    assert bd["allocated_bytes"] == pf["breakdown_at"]["allocated_bytes"] == pf["peak_allocated_bytes"]
    assert {k: v for k, v in bd["categories"].items() if v} == {k: v for k, v in pf["breakdown"].items() if v}
    assert bd["sources"] == pf["breakdown_sources"]
    assert bd["sources"]["parameters"] == bd["sources"]["gradients"] == "recorded"
    assert (r["steps"], r["trace_kind"]) == (2, "2 optimizer steps")
