"""Validation that forgets ``torch.no_grad()``: ``val_loss += loss`` chains every batch's graph to the last,
so each batch's activations stay allocated until the sum is dropped. A common bug; memory grows batch by
batch and the job runs out.

Nothing in it knows about oomdoctor (run it under ``oomdoctor run``)::

    python scenarios/eval_no_grad.py --model decoder --eval-batches 400 [--ground-truth FILE]

Two training steps (AdamW, bf16 autocast), then the validation loop. ``--model decoder``: a decoder of
``torch.nn.TransformerEncoderLayer`` (1024 wide, 8 layers, vocabulary 32,000); ``--model gpt2``:
transformers' GPT-2 124M, the loss from ``labels=``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from _truth import GroundTruth
from own_optimizer import Decoder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("decoder", "gpt2"), default="decoder")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--eval-batches", type=int, default=400)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--ground-truth")
    p.add_argument("--cpu", action="store_true", help="tiny dry run without a GPU")
    a = p.parse_args()
    dev = torch.device("cpu" if a.cpu else "cuda")
    torch.manual_seed(0)
    if a.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_positions=a.seq, n_layer=2 if a.cpu else 12, n_embd=64 if a.cpu else 768,
                         n_head=2 if a.cpu else 12)
        model, vocab = GPT2LMHeadModel(cfg).to(dev), cfg.vocab_size
    else:
        vocab = 32000
        model = Decoder(vocab, 64 if a.cpu else 1024, 2 if a.cpu else 8).to(dev)

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=not a.cpu):
            if a.model == "gpt2":
                return model(input_ids=ids, labels=ids).loss
            logits = model(ids)
            return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    truth = GroundTruth(a.ground_truth, batch=a.batch, seq=a.seq, model=a.model, framework="plain")
    if not a.cpu:
        truth.install()
    g = torch.Generator().manual_seed(0)
    done = 0
    try:
        model.train()
        for _ in range(2):
            loss_of(torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(dev)).backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        val_loss = 0.0
        for _ in range(a.eval_batches):
            val_loss += loss_of(torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(dev))  # no no_grad()
            done += 1
        truth.note(val_loss=float(val_loss) / a.eval_batches)
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        truth.write(eval_batches_done=done)


if __name__ == "__main__":
    main()
