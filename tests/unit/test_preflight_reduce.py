"""CUDA's reductions split across thread blocks allocate staging buffers (``Reduce.cuh``, ``setReduceConfig``):
preflight's :func:`oomdoctor.preflight.reduce.staging_bytes` against what an H200 allocated (timm's ViT-S/16 at
batch 64, bf16, the bias gradients of its linear layers: ``docs/preflight.md``, "Round 15"), and the tracer adding
them to a traced backward."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from oomdoctor.plan.gpus import gpu_sms  # noqa: E402
from oomdoctor.preflight.reduce import staging_bytes  # noqa: E402
from oomdoctor.preflight.target import target_gpu  # noqa: E402
from oomdoctor.preflight.tracer import run_traced  # noqa: E402

ROWS = 64 * 197  # ViT-S/16's tokens at batch 64


@pytest.mark.parametrize(("columns", "measured"), [
    (1152, [116_195_328, 36]),  # qkv
    (1536, [138_412_032, 48]),  # fc1
    (384, [38_731_776, 12]),  # proj and fc2
])
def test_bias_gradient_staging_as_the_h200_allocated(columns, measured):
    grad = torch.empty(ROWS, columns, dtype=torch.bfloat16)
    with target_gpu(9, sms=gpu_sms("H200")):
        assert staging_bytes(grad, [0]) == measured
        # the same reduction over (batch, tokens) of a 3-D gradient coalesces to the same iterator
        assert staging_bytes(grad.view(64, 197, columns), [0, 1]) == measured


def test_the_split_depends_on_the_gpu_and_the_shape():
    grad = torch.empty(ROWS, 1536, dtype=torch.bfloat16)
    with target_gpu(8, sms=gpu_sms("A100-80GB")):  # 108 SMs: fewer blocks per output than the H200's 176
        a100 = staging_bytes(grad, [0])
    with target_gpu(9, sms=gpu_sms("H200")):
        h200 = staging_bytes(grad, [0])
        assert staging_bytes(torch.empty(ROWS, 1536), [0])[0] == h200[0]  # fp32 accumulates in fp32 too
        assert staging_bytes(torch.empty(512, 1536, dtype=torch.bfloat16), [0]) == []  # few rows: one block
        assert staging_bytes(grad.t(), [1]) == []  # not contiguous: not modelled
        assert staging_bytes(torch.empty(ROWS, 1536, dtype=torch.int64), [0]) == []  # not floating
    assert a100 == [4 * 1536 * 144 * 128, 48] and h200 == [138_412_032, 48]


def test_a_traced_linear_backward_allocates_the_bias_staging_buffer():
    def fn(tr):
        lin = torch.nn.Linear(384, 1152, dtype=torch.bfloat16)
        x = torch.randn(ROWS, 384, dtype=torch.bfloat16, requires_grad=True)
        out = lin(x)
        out.backward(torch.randn_like(out))  # a dense gradient, as a loss's backward gives (sum's is an expand)

    with target_gpu(9, sms=132):
        rec = run_traced(fn)
    sizes = [e["size"] for e in rec.events if e["action"] == "alloc"]
    assert 116_195_328 in sizes and 36 in sizes
    frees = [e for e in rec.events if e["action"] == "free_requested" and e["size"] == 116_195_328]
    assert frees, "the staging buffer is freed when the reduction returns"
