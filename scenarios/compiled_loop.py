"""A plain PyTorch loop compiled with ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), one GPU.

Nothing in it knows about oomdoctor (run it under ``oomdoctor run``)::

    python scenarios/compiled_loop.py --batch 32 --steps 6 [--ground-truth FILE]

The model is the pre-norm Transformer LM of ``_common.py`` (``nn.TransformerEncoderLayer``), 8 layers,
1024 wide, vocabulary 32,000, sequence 1024; bf16 autocast, fused AdamW, loss in fp32 outside the
compiled module. ``reduce-overhead`` records the forward and backward into CUDA graphs whose memory
lives in a private pool (cudagraph trees), after a few eager warm-up steps.
"""

from __future__ import annotations

import argparse

import torch
from _common import LM, lm_loss
from _truth import GroundTruth


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--mode", default="reduce-overhead")
    p.add_argument("--ground-truth")
    a = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = LM(a.vocab, a.width, a.layers).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    truth = GroundTruth(a.ground_truth, batch=a.batch, seq=a.seq, layers=a.layers, width=a.width, vocab=a.vocab,
                        compile_mode=a.mode, framework="torch.compile").install()
    cmodel = torch.compile(model, mode=a.mode)
    g = torch.Generator(device=dev).manual_seed(0)
    try:
        for _ in range(a.steps):
            ids = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev, generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = cmodel(ids)
            loss = lm_loss(logits, ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        truth.write()


if __name__ == "__main__":
    main()
