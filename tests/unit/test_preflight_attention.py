"""Preflight's attention: the kernel CUDA picks for each ``scaled_dot_product_attention`` call (``sdp_utils.cpp``
filters: dtypes, head sizes, strides, storage offsets), and the memory of the math kernel it falls back to (the
T5 miss, issue 50 item 4: a relative position bias whose last dimension has stride ``h`` sends T5's attention to
math on the GPU, where fp16/bf16 inputs are upcast and the ``b × h × s × s`` scores kept in fp32)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from oomdoctor.preflight.attention import CUDNN_FIRST_TORCH, cuda_backend, target_gpu  # noqa: E402
from oomdoctor.preflight.tracer import run_traced  # noqa: E402

B, H, S, D = 2, 4, 128, 32
BF = torch.bfloat16


def _qkv(dtype=BF, d=D, heads=H):
    return [torch.randn(B, heads, S, d, dtype=dtype) for _ in range(3)]


def _position_bias(contiguous: bool, dtype=BF):
    """T5's ``compute_bias``: an embedding of (s_q, s_k) buckets to h values, permuted to (1, h, s_q, s_k):
    the last dimension's stride is h."""
    values = torch.randn(S, S, H, dtype=dtype)
    bias = values.permute(2, 0, 1).unsqueeze(0)
    return bias.contiguous() if contiguous else bias


@pytest.fixture
def sm80():
    """An A100's choice: no cuDNN attention first (``check_prefer_cudnn_attention`` is for sm90 and sm100)."""
    with target_gpu(8):
        yield


def test_the_backend_follows_cudas_filters(sm80):
    q, k, v = _qkv()
    assert cuda_backend(q, k, v) == "flash"
    assert cuda_backend(q, k, v, is_causal=True) == "flash"
    assert cuda_backend(*_qkv(torch.float32)) == "efficient"  # flash takes 16-bit types only
    assert cuda_backend(q, k, v, _position_bias(True)) == "efficient"  # a mask: no flash
    assert _position_bias(False).stride(-1) == H
    assert cuda_backend(q, k, v, _position_bias(False)) == "math"  # the mask's last stride is not 1
    q36, k36, v36 = _qkv(d=36)
    assert cuda_backend(q36, k36, v36) == "flash"  # padded to 40 first
    assert cuda_backend(q36, k36, v36, _position_bias(True)) == "math"  # 36 is not a multiple of 8
    assert cuda_backend(*_qkv(d=320)) == "efficient"  # flash: at most 256
    base = torch.randn(B * H * S * D + 1, dtype=BF)
    q_off = base[1:].view(B, H, S, D)  # storage offset 1: not aligned to 8 elements
    assert cuda_backend(q_off, k, v, _position_bias(True)) == "math"
    assert cuda_backend(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v) == "math"  # q's last stride S
    kv2 = _qkv(heads=2)
    assert cuda_backend(q, kv2[1], kv2[2], enable_gqa=True) == "flash"
    assert cuda_backend(q, kv2[1], kv2[2], _position_bias(True), enable_gqa=True) == "math"
    assert cuda_backend(q[0], k[0], v[0]) == "math"  # 3-D


def _torch_cudnn_first() -> bool:
    v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return v >= CUDNN_FIRST_TORCH


@pytest.mark.skipif(not _torch_cudnn_first(), reason="this torch predates cuDNN attention first on sm90")
def test_sm90_takes_cudnn_attention_first(monkeypatch):
    """On an H100/H200 (sm90) and a B200 (sm100) torch 2.11+ tries cuDNN attention first (``sdp_utils.cpp``
    ``check_prefer_cudnn_attention``); measured on an H200: every unmasked bf16/fp16 shape of
    ``docs/device_runs/round15-sdpa.jsonl`` went to cuDNN."""
    q, k, v = _qkv()
    with target_gpu(9):
        assert cuda_backend(q, k, v) == "cudnn"
        assert cuda_backend(q, k, v, is_causal=True) == "cudnn"
        kv2 = _qkv(heads=2)
        assert cuda_backend(q, kv2[1], kv2[2], enable_gqa=True) == "cudnn"  # grouped-query heads allowed
        assert cuda_backend(*_qkv(d=256)) == "cudnn"  # sm90: head sizes up to 256
        assert cuda_backend(*_qkv(d=36)) == "flash"  # not a multiple of 8
        assert cuda_backend(*_qkv(d=320)) == "efficient"
        assert cuda_backend(*_qkv(torch.float32)) == "efficient"  # 16-bit types only
        assert cuda_backend(q, k, v, _position_bias(True)) == "efficient"  # masked calls: not measured, as before
        one = [torch.randn(B, H, 1, D, dtype=BF) for _ in range(3)]
        assert cuda_backend(q, one[1], one[2]) == "flash"  # a key length of 1
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            assert cuda_backend(q, k, v) == "flash"
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)
        monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
        assert cuda_backend(q, k, v) == "flash"
        monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED")
        monkeypatch.setenv("TORCH_CUDNN_SDPA_PREFERRED", "0")
        assert cuda_backend(q, k, v) == "flash"
        monkeypatch.delenv("TORCH_CUDNN_SDPA_PREFERRED")
    with target_gpu(10):
        assert cuda_backend(q, k, v) == "cudnn"
        assert cuda_backend(*_qkv(d=256)) == "flash"  # off sm90: cuDNN takes head sizes up to 128
    with target_gpu(8):
        assert cuda_backend(q, k, v) == "flash"


@pytest.mark.skipif(not _torch_cudnn_first(), reason="this torch predates cuDNN attention first on sm90")
def test_cudnn_attention_allocates_as_measured_on_the_h200():
    """ViT-S/16 at batch 64 (b 64, h 6, s 197, d 64, bf16): the H200's forward allocated 8, 8, the output
    (9,682,944 B), the statistics (302,592 B) and a 256 B workspace; its backward dq, dk, dv and 19,668,736 B
    (``docs/device_runs/round15-sdpa.jsonl``, first case). Flash's backward buffers (393,216 + 25,165,824 B) are
    not made."""
    b, h, s, d = 64, 6, 197, 64

    def fn(tr):
        q, k, v = (torch.randn(b, h, s, d, dtype=BF, requires_grad=True) for _ in range(3))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        out.backward(torch.randn_like(out))

    with target_gpu(9):
        sizes = [e["size"] for e in run_traced(fn).events if e["action"] == "alloc"]
    out = b * h * s * d * 2
    assert sizes.count(out) >= 1 + 1 + 3 + 3  # q, k, v; the output; its gradient; dq, dk, dv
    assert b * h * s * 4 in sizes  # the statistics
    assert 256 in sizes and sizes.count(8) >= 2
    assert 19_668_736 in sizes
    assert 25_165_824 not in sizes and 393_216 not in sizes


def _allocs(bias_contiguous: bool, dropout: float = 0.1):
    def fn(tr):
        q, k, v = (torch.randn(B, S, H, D, requires_grad=True).transpose(1, 2) for _ in range(3))
        bias = _position_bias(bias_contiguous, torch.float32).requires_grad_()
        with torch.autocast("cpu", dtype=BF):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout,
                                                                   scale=1.0)
        out.float().sum().backward()

    return [e["size"] for e in run_traced(fn).events if e["action"] == "alloc"]


def test_a_strided_position_bias_runs_the_math_kernel_in_fp32():
    """With a strided bias (T5's), the scores, their softmax and the dropout output are ``b × h × s × s`` fp32, the
    dropout mask ``bool`` (CUDA's ``native_dropout``), and ``_safe_softmax`` holds a bool ``eq(-inf)`` while it runs;
    q, k and v are upcast to fp32 first. With a contiguous bias the memory-efficient kernel keeps none of them."""
    scores = B * H * S * S * 4
    math_sizes = _allocs(bias_contiguous=False)
    assert math_sizes.count(scores) >= 4  # scores, softmax, dropout output; backward's gradient of the scores
    assert B * H * S * S in math_sizes  # the dropout mask, and _safe_softmax's eq(-inf), one byte an element
    assert B * H * S * D * 4 in math_sizes  # q, k, v upcast to fp32
    assert B * H * S * S * 2 in math_sizes  # the second output, attn.to(bf16), made and dropped
    efficient = _allocs(bias_contiguous=True)
    assert scores not in efficient
    assert B * H * S * 4 in efficient  # the log-sum-exp
    assert sum(math_sizes) > 3 * sum(efficient)


def test_multihead_attention_inside_reaches_cudas_kernel(sm80):
    """``nn.MultiheadAttention`` calls SDPA from inside ``F.multi_head_attention_forward``, a Python torch function:
    the trace's torch-function layer is off there, so before, SDPA ran CPU's choice (math, for dropout: ``b × h × s ×
    s`` scores). On CUDA a bf16 call without a mask takes flash attention: no score matrix, a ``b × h × s`` fp32
    log-sum-exp."""
    b, h, s, e = 2, 8, 320, 512  # no other allocation has a score matrix's size

    def fn(tr):
        mha = torch.nn.MultiheadAttention(e, h, dropout=0.1, batch_first=True)
        x = torch.randn(b, s, e)
        with torch.autocast("cpu", dtype=BF):
            out, _ = mha(x, x, x, need_weights=False)
        out.float().sum().backward()

    sizes = [e["size"] for e in run_traced(fn).events if e["action"] == "alloc"]
    assert not {b * h * s * s * k for k in (1, 2, 4)} & set(sizes)  # no scores, softmax or dropout mask of them
    assert b * h * s * 4 in sizes
