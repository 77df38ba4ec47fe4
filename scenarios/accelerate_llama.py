"""A plain training loop with Hugging Face accelerate, as its docs show: Llama-style model, bf16, AdamW.

Nothing in it knows about oomdoctor (run it under ``oomdoctor run``)::

    torchrun --nproc_per_node=2 scenarios/accelerate_llama.py --batch 16 --steps 4 \
        [--grad-accum 2] [--ground-truth FILE]

``Accelerator(mixed_precision="bf16", gradient_accumulation_steps=K)`` wraps the model in DDP;
``accelerator.accumulate`` / ``backward`` / ``optimizer.step`` / ``zero_grad`` as in accelerate's
README. The model is transformers' ``LlamaForCausalLM`` at random init: 8 layers, 1024 wide, 16 heads,
FFN 2816, vocabulary 32,000, sequence 2048 by default.
"""

from __future__ import annotations

import argparse

import torch
from _truth import GroundTruth
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--ground-truth")
    p.add_argument("--cpu", action="store_true", help="tiny dry run without a GPU")
    a = p.parse_args()
    torch.manual_seed(0)
    acc = Accelerator(mixed_precision="no" if a.cpu else "bf16", gradient_accumulation_steps=a.grad_accum,
                      cpu=a.cpu)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=a.width, intermediate_size=int(a.width * 2.75) // 64 * 64,
                      num_hidden_layers=a.layers, num_attention_heads=max(1, a.width // 64),
                      num_key_value_heads=max(1, a.width // 64), max_position_embeddings=a.seq)
    model = LlamaForCausalLM(cfg)
    truth = GroundTruth(a.ground_truth, batch=a.batch, seq=a.seq, layers=a.layers, width=a.width,
                        vocab=cfg.vocab_size, grad_accum=a.grad_accum, framework="accelerate")
    if torch.cuda.is_available():
        truth.install()
    n = a.steps * a.grad_accum * a.batch * acc.num_processes
    ids = torch.randint(0, cfg.vocab_size, (n, a.seq), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(ids, batch_size=a.batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    model.train()
    try:
        for batch in loader:
            with acc.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        truth.write(num_processes=acc.num_processes)


if __name__ == "__main__":
    main()
