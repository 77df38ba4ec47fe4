"""Which SDPA kernel CUDA takes, and what each allocates (issue 50: the timm ViT miss, whose backward on the
H200 has buffers the flash model in ``preflight/attention.py`` lacks). One call on nvidia-h200, < 1 min:

    python benchmarks/device/round15_sdpa.py OUT.jsonl

Then the same for cuDNN's RNNs (the mnist_rnn miss): an LSTM or GRU's forward and backward allocations.

Per case (shape b × h × s × d, dtype, causal, mask) and per backend (the default, then each forced with
``torch.nn.attention.sdpa_kernel``): ``torch._fused_sdp_choice``'s answer, and every allocation of the caching
allocator during the forward and during the backward (sizes in bytes, in order, from
``torch.cuda.memory._record_memory_history``'s trace), with the bytes still live after each.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CASES = [
    (64, 6, 197, 64, "bfloat16", False),    # timm vit_small_patch16_224, b 64
    (32, 6, 197, 64, "bfloat16", False),
    (64, 6, 256, 64, "bfloat16", False),
    (64, 12, 197, 64, "bfloat16", False),
    (32, 12, 197, 64, "float16", False),
    (64, 6, 197, 128, "bfloat16", False),
    (8, 12, 1024, 64, "bfloat16", True),    # GPT-2 causal
    (8, 12, 1000, 64, "bfloat16", True),
    (4, 16, 2048, 128, "bfloat16", True),
    (16, 8, 384, 64, "float16", False),
]
NAMES = {int(v): k for k, v in SDPBackend.__members__.items()}


def trace_sizes(fn):
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python", context="alloc")
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    ev = [e for t in snap["device_traces"] for e in t]
    allocs = [e["size"] for e in ev if e["action"] == "alloc"]
    return out, allocs, torch.cuda.memory_allocated() - before


def case(b, h, s, d, dt, causal, backend):
    dtype = getattr(torch, dt)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    choice = int(torch._fused_sdp_choice(q, k, v, None, 0.0, causal))
    ctx = sdpa_kernel([backend]) if backend is not None else torch.enable_grad()
    try:
        with ctx:
            out, fwd, live_fwd = trace_sizes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            g = torch.randn_like(out)
            _, bwd, live_bwd = trace_sizes(lambda: out.backward(g))
        err = None
    except Exception as e:  # noqa: BLE001
        fwd = bwd = []
        live_fwd = live_bwd = 0
        err = f"{type(e).__name__}: {str(e)[:200]}"
    return dict(shape=[b, h, s, d], dtype=dt, causal=causal, default_choice=NAMES.get(choice, choice),
                forced=None if backend is None else backend.name, error=err, fwd_allocs=fwd, fwd_live=live_fwd,
                bwd_allocs=bwd, bwd_live=live_bwd)


RNNS = [  # (mode, input, hidden, layers, batch, seq, dtype): mnist_rnn's LSTM first
    ("LSTM", 28, 64, 1, 64, 28, "float32"), ("LSTM", 28, 64, 1, 32, 28, "float32"),
    ("LSTM", 28, 64, 1, 64, 56, "float32"), ("LSTM", 28, 256, 1, 64, 28, "float32"),
    ("LSTM", 28, 64, 2, 64, 28, "float32"), ("GRU", 28, 64, 1, 64, 28, "float32"),
    ("LSTM", 512, 512, 2, 20, 35, "float32"), ("LSTM", 256, 256, 1, 64, 28, "float16"),
]


def rnn_case(mode, inp, hid, layers, b, s, dt):
    dtype = getattr(torch, dt)
    m = getattr(torch.nn, mode)(inp, hid, layers, batch_first=True).cuda().to(dtype)
    x = torch.randn(b, s, inp, device="cuda", dtype=dtype, requires_grad=True)
    out, fwd, live_fwd = trace_sizes(lambda: m(x)[0])
    _, bwd, live_bwd = trace_sizes(lambda: out.sum().backward())
    return dict(rnn=[mode, inp, hid, layers, b, s], dtype=dt, fwd_allocs=fwd, fwd_live=live_fwd, bwd_allocs=bwd,
                bwd_live=live_bwd)


def main(out: str) -> None:
    rows = []
    info = dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                device=torch.cuda.get_device_name(), cap=list(torch.cuda.get_device_capability()),
                flash=torch.backends.cuda.flash_sdp_enabled(), mem_eff=torch.backends.cuda.mem_efficient_sdp_enabled(),
                cudnn_sdp=torch.backends.cuda.cudnn_sdp_enabled(), math=torch.backends.cuda.math_sdp_enabled())
    rows.append(info)
    for c in CASES:
        for be in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            r = case(*c, be)
            rows.append(r)
            print(r["shape"], r["dtype"], r["causal"], "default", r["default_choice"], "forced", r["forced"],
                  "fwd", r["fwd_allocs"][:8], "bwd", r["bwd_allocs"][:10], r["error"] or "", flush=True)
            torch.cuda.empty_cache()
    for c in RNNS:
        r = rnn_case(*c)
        rows.append(r)
        print(r["rnn"], r["dtype"], "fwd", r["fwd_allocs"], "bwd", r["bwd_allocs"], flush=True)
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
