"""A plain training loop whose optimizer is written in the job's own file, as research code often has it.

Nothing in it knows about oomdoctor (run it under ``oomdoctor run``)::

    python scenarios/own_optimizer.py --optimizer adam --batch 8 --steps 4 [--ground-truth FILE]

- ``--optimizer adam``: ``HandAdam``, a ``torch.optim.Optimizer`` subclass with its own ``step``: torch wraps
  it like any optimizer (``Optimizer.step#HandAdam.step`` annotations, the global step hooks), but no frame of
  ``torch/optim`` makes its state; GPT-2 124M (transformers, random init).
- ``--optimizer lion``: ``Lion`` (Chen et al. 2023, arXiv:2302.06675), a plain class: no annotation, no hook,
  one moment per parameter; the job measures its own tensors around ``step()``; a decoder built from
  ``torch.nn.TransformerEncoderLayer``.

bf16 autocast over fp32 weights, sequence 1024, random tokens.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from _truth import GroundTruth


class HandAdam(torch.optim.Optimizer):
    """Adam (Kingma and Ba 2015, Algorithm 1) written out: two moments per parameter, made at the first step."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["t"], st["m"], st["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["t"] += 1
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (st["v"] / (1 - b2 ** st["t"])).sqrt_().add_(group["eps"])
                p.addcdiv_(st["m"], denom, value=-group["lr"] / (1 - b1 ** st["t"]))


class Lion:
    """Lion: the sign of an interpolated momentum; one moment per parameter. Not a torch optimizer."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99)):
        self.param_groups = [{"params": [p for p in params if p.requires_grad]}]
        self.state: dict = {}
        self.lr, self.betas = lr, betas

    @torch.no_grad()
    def step(self) -> None:
        b1, b2 = self.betas
        for p in self.param_groups[0]["params"]:
            if p.grad is None:
                continue
            st = self.state.setdefault(p, {})
            if "exp_avg" not in st:
                st["exp_avg"] = torch.zeros_like(p)
            m = st["exp_avg"]
            p.add_((m * b1 + p.grad * (1 - b1)).sign_(), alpha=-self.lr)
            m.mul_(b2).add_(p.grad, alpha=1 - b2)

    def zero_grad(self) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None


class Decoder(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 16, 4 * d, batch_first=True, norm_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", choices=("adam", "lion"), required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--ground-truth")
    p.add_argument("--cpu", action="store_true", help="tiny dry run without a GPU")
    a = p.parse_args()
    dev = torch.device("cpu" if a.cpu else "cuda")
    torch.manual_seed(0)
    vocab = 50257 if a.optimizer == "adam" else 32000
    if a.optimizer == "adam":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_positions=a.seq, n_layer=2 if a.cpu else 12, n_embd=64 if a.cpu else 768,
                         n_head=2 if a.cpu else 12)
        model = GPT2LMHeadModel(cfg).to(dev)
        opt = HandAdam(model.parameters())
    else:
        model = Decoder(vocab, 64 if a.cpu else 1024, 2 if a.cpu else 8).to(dev)
        opt = Lion(model.parameters())
    truth = GroundTruth(a.ground_truth, batch=a.batch, seq=a.seq, optimizer=type(opt).__name__, framework="plain")
    if not a.cpu:
        truth.install()
    own = not isinstance(opt, torch.optim.Optimizer)
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(a.steps):
            ids = torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=not a.cpu):
                if a.optimizer == "adam":
                    loss = model(input_ids=ids, labels=ids).loss
                else:
                    logits = model(ids)
                    loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            if own and not a.cpu:
                truth.before_step(opt)
            opt.step()
            if own and not a.cpu:
                truth.after_step(opt)
            opt.zero_grad()
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        truth.write()


if __name__ == "__main__":
    main()
