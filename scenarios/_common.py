"""What the scenarios share: process-group setup from torchrun's variables, and a small causal LM.

Scenarios contain no recording code: run them under ``oomdoctor run`` (see README.md here).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn


def setup(dist: bool = True) -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)``; joins the NCCL process group when ``dist`` and torchrun started us."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    if dist and world > 1:
        torch.distributed.init_process_group("nccl", device_id=device)
    torch.manual_seed(0)
    return rank, world, device


def teardown() -> None:
    torch.cuda.synchronize()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def parser(variants: tuple[str, ...], doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--variant", choices=variants, required=True)
    return p


class LM(nn.Module):
    """Embedding, pre-norm Transformer layers, LM head: the usual shape of a decoder's memory."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, 4 * d, batch_first=True, norm_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def lm_train_step(model: nn.Module, opt: torch.optim.Optimizer, vocab: int, batch: int, seq: int,
                  device: torch.device) -> None:
    """One step on random tokens: bf16 autocast forward, fp32 loss, backward, ``step``, ``zero_grad``."""
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(ids)
    lm_loss(logits, ids).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
