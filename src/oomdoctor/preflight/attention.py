"""``F.scaled_dot_product_attention`` as CUDA runs it, on fake CPU tensors.

CUDA picks a kernel per call (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` ``select_sdp_backend``:
flash, then memory-efficient, then math; cuDNN first where ``check_prefer_cudnn_attention`` holds), each by a list
of filters on the inputs' dtypes, shapes, **strides** and storage offsets (``sdp_utils_cpp.h``). A CPU build picks
among CPU kernels, so the trace sends each call to the kernel CUDA would take, with the memory that kernel has:

- **cuDNN** (``can_use_cudnn_attention``), first on an sm90 or sm100 GPU (``major`` 9 or 10, ``minor`` 0) with
  the cuDNN that CUDA builds of torch 2.11 and later ship (``check_prefer_cudnn_attention``: cuDNN 9.9 and later;
  off with ``TORCH_CUDNN_SDPA_PREFERRED=0`` or ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``): fp16 or bf16, 4-D, head
  sizes multiples of 8 of at most 256 (128 off sm90), a key length above 1, the last dimension of stride 1,
  grouped-query heads allowed; not under ``torch.use_deterministic_algorithms`` (unless ``warn_only``). Measured
  on an H200 (torch 2.11, cuDNN 9.19, ``docs/device_runs/round15-sdpa.jsonl``, ten shapes, every one taken by
  cuDNN; ``docs/preflight.md``, "cuDNN attention"): the forward allocates the philox seed and offset (8 B each,
  kept), the output, the softmax statistics (``b × h × s_q`` fp32, kept for backward) and a 256 B workspace it
  frees; the backward allocates dq, dk, dv and one workspace of ``b × h × s_q × (d + 1) × 4 + 256`` bytes (an
  fp32 dq accumulator and the ``dO · O`` row sums), freed before it returns. Only calls without an ``attn_mask``
  are sent here: masked cuDNN calls were not measured and keep the rules below.

- **flash** (``can_use_flash_attention``): no ``attn_mask``; q, k, v fp16 or bf16, 4-D, one head size of at most
  256; ``is_causal`` only with equal query and key lengths; the same batch and (unless ``enable_gqa``) the same
  heads; the last dimension of q, k, v of stride 1. Saves the log-sum-exp (``b × h × s`` fp32); a head size not
  a multiple of 8 is padded first (``attention.cpp`` ``pad_last_dim<8>``).
- **memory-efficient** (``can_use_mem_efficient_attention``): fp16, bf16 or fp32; head sizes a multiple of the
  GEMM alignment (8 for 16-bit types, 4 for fp32 on sm80+, ``minimum_gemm_alignment``); storage offsets of q, k, v
  multiples of it (``check_data_ptr_alignment_mem_efficient``); the last dimension of q, k, v **and the mask** of
  stride 1 (``check_last_dim_stride_equals_1_dense``); the same batch and heads. A mask whose strides are not
  multiples of 8 is copied padded (``preprocess_mask``, ``pad_bias<8>``) and expanded to ``b × h × s_q × s_k``.
- **math** (everything else, ``_scaled_dot_product_attention_math``): fp16/bf16 q, k, v are **upcast to fp32**
  (unless ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``), the ``b × h × s_q × s_k`` scores,
  their softmax (``_safe_softmax``) and dropout (CUDA's fused ``native_dropout``: a bool mask) are materialized
  in fp32 and saved for backward. Measured on an H200 (torch 2.11): a T5 whose relative position bias is a
  permuted embedding (last-dimension stride = the number of heads) runs every self-attention here
  (``docs/preflight.md``, "The T5 miss").

A boolean mask is first made additive in the query's dtype (``convert_boolean_attn_mask``).

The target GPU's compute capability comes from :func:`.target.target_gpu` (the traced job's ``--gpu``; sm90 when
none is set).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from ._private import _version
from .target import current, target_gpu

__all__ = ["CUDNN_FIRST_TORCH", "CUDNN_WORKSPACE_EXTRA", "cuda_backend", "cudnn_first", "math_attention",
           "sdpa_as_cuda", "target_gpu"]

_aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
#: ``preprocess_mask``'s ``mem_eff_alignment`` (``attention.cpp``)
MASK_ALIGNMENT = 8


#: the first torch release measured to put cuDNN attention first on sm90 (``docs/preflight.md``)
CUDNN_FIRST_TORCH = (2, 11)
#: the workspace cuDNN's forward allocates and frees, and the constant part of its backward's (bytes, measured)
CUDNN_WORKSPACE_EXTRA = 256


def _env_flag(name: str) -> bool | None:
    """``c10::utils::check_env``: ``1``/``true``/... True, ``0``/``false``/... False, unset (or other) None."""
    v = os.environ.get(name)
    if v is None:
        return None
    v = v.strip().lower()
    if v in ("1", "true", "yes", "on", "y"):
        return True
    if v in ("0", "false", "no", "off", "n"):
        return False
    return None


def cudnn_first() -> bool:
    """``check_prefer_cudnn_attention`` for the target GPU (:func:`target_gpu`) and this torch (module doc)."""
    t = current()
    major, minor = t.sm_major, t.sm_minor
    if major not in (9, 10) or minor or _version() < CUDNN_FIRST_TORCH:
        return False
    if _env_flag("TORCH_CUDNN_SDPA_PREFERRED") is False or _env_flag("TORCH_CUDNN_SDPA_DEPRIORITIZED"):
        return False
    return True


def _cudnn_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any, dropout_p: float,
              enable_gqa: bool) -> bool:
    """``can_use_cudnn_attention``'s filters for a dense call without a mask (the module doc)."""
    if attn_mask is not None or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _HALF):
        return False
    t = current()
    limit = 256 if (t.sm_major, t.sm_minor) == (9, 0) else 128
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if not (d_qk == k.shape[-1] and 0 < d_qk <= limit and 0 < d_v <= limit and d_qk % 8 == 0 and d_v % 8 == 0):
        return False
    s_q, s_k = q.shape[-2], k.shape[-2]
    if s_k == 1 or (s_q == 1 and dropout_p > 0.0):
        return False
    return _heads_ok(q, k, v, enable_gqa=True, gqa=True) and _last_dim_stride_1([q, k, v], ignore_singleton=True)


def _heads_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, gqa: bool) -> bool:
    """``check_batch_size_and_num_heads_dense``: one batch size; the same heads, or grouped-query heads
    where the kernel supports them."""
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hq == hk == hv:
        return True
    return gqa and enable_gqa and hk == hv and hk > 0 and hq % hk == 0


def _last_dim_stride_1(ts: list[torch.Tensor], ignore_singleton: bool) -> bool:
    return all(t.stride(-1) == 1 or (ignore_singleton and t.shape[-1] == 1) for t in ts)


def cuda_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False) -> str:
    """``"cudnn"``, ``"flash"``, ``"efficient"`` or ``"math"``: the kernel CUDA's ``select_sdp_backend`` takes for
    these inputs on the target GPU (:func:`target_gpu`, sm80 or later) with every backend enabled (the module doc
    lists the filters). The inputs are the ones the kernel receives (after autocast's casts)."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "math"
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return "math"
    if cudnn_first() and _cudnn_ok(q, k, v, attn_mask, dropout_p, enable_gqa):
        return "cudnn"
    same_dtype = q.dtype == k.dtype == v.dtype
    d_q, d_k, d_v = q.shape[-1], k.shape[-1], v.shape[-1]
    if (attn_mask is None and same_dtype and q.dtype in _HALF and d_q == d_k == d_v and 0 < d_q <= 256
            and (not is_causal or q.shape[-2] == k.shape[-2]) and _heads_ok(q, k, v, enable_gqa, gqa=True)
            and _last_dim_stride_1([q, k, v], ignore_singleton=True)):
        return "flash"
    align = 8 if q.dtype in _HALF else 4  # minimum_gemm_alignment on sm80+ (tensor cores)
    if (same_dtype and q.dtype in (*_HALF, torch.float32) and d_q == d_k and d_q > 0 and d_v > 0
            and d_q % align == 0 and d_v % align == 0
            and all(t.storage_offset() % align == 0 for t in (q, k, v) if t.numel())
            and _last_dim_stride_1([q, k, v] + ([attn_mask] if attn_mask is not None else []), ignore_singleton=False)
            and _heads_ok(q, k, v, enable_gqa, gqa=False)):
        return "efficient"
    return "math"


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert_boolean_attn_mask``: a boolean mask as 0 / -inf in ``dtype``; any other mask as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    out = torch.zeros_like(mask, dtype=dtype)
    return out.masked_fill_(mask.logical_not(), -math.inf)


def _aligned(t: torch.Tensor) -> bool:
    """``aligned_tensor<8>``: every stride but the last a multiple of 8, the last 1."""
    return all(s % MASK_ALIGNMENT == 0 for s in t.stride()[:-1]) and t.stride(-1) == 1


def _pad_last(t: torch.Tensor, alignment: int, slice_back: bool) -> torch.Tensor:
    n = t.shape[-1]
    pad = alignment - n % alignment
    padded = torch.nn.functional.pad(t, (0, pad))
    return padded[..., :n] if slice_back else padded


def _flash(q: Any, k: Any, v: Any, dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    d = q.shape[-1]
    og_scale = scale if scale is not None else 1.0 / math.sqrt(d)
    if d % 8:  # pad_last_dim<8, false>: copies of q, k, v with the head size padded, the output sliced back
        q, k, v = (_pad_last(x, 8, slice_back=False) for x in (q, k, v))
    out = _aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=og_scale)[0]
    return out[..., :d] if out.shape[-1] != d else out


def _cudnn(q: Any, k: Any, v: Any, dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    """``_scaled_dot_product_cudnn_attention`` (``attention.cpp``), the log-sum-exp asked for when a gradient
    will be (``should_compute_logsumexp``); its workspaces are the tracer's kernel buffers."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _aten._scaled_dot_product_cudnn_attention(q, k, v, None, grad, dropout_p, is_causal, False,
                                                    scale=scale)[0]


def _efficient(q: Any, k: Any, v: Any, mask: Any, dropout_p: float, is_causal: bool,
               scale: float | None) -> torch.Tensor:
    mask = _additive(mask, q.dtype)
    if mask is not None:
        if not _aligned(mask):
            mask = _pad_last(mask, MASK_ALIGNMENT, slice_back=True)
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return _aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, dropout_p, is_causal, scale=scale)[0]


def math_attention(q: Any, k: Any, v: Any, mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``_scaled_dot_product_attention_math`` (``aten/src/ATen/native/transformers/attention.cpp``), op for op,
    with CUDA's dropout (``native_dropout``: ``at::dropout`` takes the fused kernel on CUDA,
    ``Dropout.cpp`` ``is_fused_kernel_acceptable``; on a CPU tensor it would save a noise tensor of the
    scores' dtype instead). The second output (``attn.to(origin_dtype)``) is made and dropped as the C++
    does, before the last matmul (GCC evaluates ``std::make_tuple``'s arguments right to left)."""
    origin = q.dtype
    mask = _additive(mask, origin)
    upcast = not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()

    def acc(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32) if upcast and x.dtype in _HALF else x

    q_acc, k_acc, v_acc = acc(q), acc(k), acc(v)
    negative = scale is not None and scale < 0
    s = abs(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    factor = math.sqrt(s)
    query = q_acc * (-factor if negative else factor)
    if is_causal:
        causal = query.new_ones((query.shape[-2], k_acc.shape[-2]), dtype=torch.bool).tril()
        mask = _additive(causal, query.dtype)
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        k_acc = k_acc.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v_acc = v_acc.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    attn = torch.matmul(query, k_acc.transpose(-2, -1) * factor)
    if mask is not None:
        attn.add_(mask)
    attn = _aten._safe_softmax(attn, -1)
    if dropout_p > 0.0:
        attn = _aten.native_dropout(attn, dropout_p, True)[0]
    second = attn.to(origin)
    out = torch.matmul(attn, v_acc).to(origin)
    del second
    return out


def sdpa_as_cuda(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` through the kernel :func:`cuda_backend` picks (autocast already applied
    by the caller; run with autocast off)."""
    backend = cuda_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if backend == "cudnn":
        return _cudnn(query, key, value, dropout_p, is_causal, scale)
    if backend == "flash":
        return _flash(query, key, value, dropout_p, is_causal, scale)
    if backend == "efficient":
        return _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale)
    return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
