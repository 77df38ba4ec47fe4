"""``nn.MultiheadAttention`` traced as CUDA runs it: ``F.multi_head_attention_forward`` is a Python function the
autocast policy (a torch-function mode) sees whole, and a mode is off inside its own handler, so the body's
``scaled_dot_product_attention`` ran CPU's kernel choice (``_scaled_dot_product_flash_attention_for_cpu``, no
backward buffers of its own). torchvision's ViT-B/16 (issue 51's ViT job) attends through it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from oomdoctor.preflight.attention import cudnn_first, target_gpu  # noqa: E402
from oomdoctor.preflight.tracer import run_traced  # noqa: E402

_aten = torch.ops.aten


def _mha_step(b: int, s: int, e: int, heads: int, seen: list) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    mha = torch.nn.MultiheadAttention(e, heads, batch_first=True)
    x = torch.randn(b, s, e, requires_grad=True)
    with Ops():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = mha(x, x, x, need_weights=False)
        out.float().sum().backward()


def test_multihead_attention_runs_cudas_flash_kernel_and_its_backward_buffers():
    """On an A100 (sm80), flash attention."""
    b, s, e, heads = 2, 100, 64, 4
    seen: list = []
    before = (F.scaled_dot_product_attention, F.softmax, F.dropout)
    with target_gpu(8):
        rec = run_traced(lambda tr: _mha_step(b, s, e, heads, seen))
    assert _aten._scaled_dot_product_flash_attention.default in seen
    assert _aten._scaled_dot_product_flash_attention_for_cpu.default not in seen
    d, s_r = e // heads, 128  # s = 100 rounds to 128 (flash_api.cpp mha_bwd)
    sizes = [ev["size"] for ev in rec.events if ev["action"] == "alloc"]
    assert b * heads * s_r * 4 in sizes and b * s_r * heads * d * 4 in sizes  # softmax_d, dq_accum
    assert (F.scaled_dot_product_attention, F.softmax, F.dropout) == before  # the body's names restored


def test_multihead_attention_on_sm90_runs_cudnn_attention():
    """On an H100/H200 (sm90) with torch 2.11+, cuDNN attention (``attention.py``'s module doc), and its backward
    workspace of ``b × h × s × (d + 1) × 4 + 256`` bytes instead of flash's buffers."""
    b, s, e, heads = 2, 100, 64, 4
    seen: list = []
    with target_gpu(9):
        if not cudnn_first():
            pytest.skip("this torch predates cuDNN attention first on sm90")
        rec = run_traced(lambda tr: _mha_step(b, s, e, heads, seen))
    assert _aten._scaled_dot_product_cudnn_attention.default in seen
    assert _aten._scaled_dot_product_flash_attention.default not in seen
    d = e // heads
    sizes = [ev["size"] for ev in rec.events if ev["action"] == "alloc"]
    assert b * heads * s * (d + 1) * 4 + 256 in sizes
    assert b * 128 * heads * d * 4 not in sizes  # no flash dq_accum
