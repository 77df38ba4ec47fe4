"""A PyTorch Lightning job with oomdoctor's callback: the one added line is marked ``# oomdoctor``.

GPT-2 from its config (random init, no download) in a LightningModule, random tokens, AdamW,
bf16-mixed on a GPU, a validation loop. Options as ``callback_trainer.py``:

    python scenarios/callback_lightning.py --out memory/ --batch 4 --steps 8 --val-every 4 --window 2:5
    python scenarios/callback_lightning.py --out memory/ --batch 64 --cap-gib 6   # an induced OOM
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from oomdoctor.integrations import LightningMemoryCallback


class GPT2Module(L.LightningModule):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(cfg)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="oomdoctor-memory")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: never)")
    p.add_argument("--window", default=None)
    p.add_argument("--cap-gib", type=float, default=None)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--no-callback", action="store_true")
    return p.parse_args(argv)


def build(a: argparse.Namespace, callbacks: list) -> tuple[L.Trainer, GPT2Module, torch.utils.data.DataLoader, list]:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=a.heads, vocab_size=a.vocab, n_positions=a.seq)
    g = torch.Generator().manual_seed(0)
    train = torch.utils.data.DataLoader(torch.randint(0, a.vocab, (a.batch * a.steps, a.seq), generator=g),
                                        batch_size=a.batch)
    val = [torch.utils.data.DataLoader(torch.randint(0, a.vocab, (2 * a.batch, a.seq), generator=g),
                                       batch_size=a.batch)] if a.val_every else []
    cuda = torch.cuda.is_available()
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision="bf16-mixed" if cuda else "32-true",
                        max_steps=a.steps, val_check_interval=a.val_every or None, limit_val_batches=2 if a.val_every else 0,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    return trainer, GPT2Module(cfg), train, val


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    if a.cap_gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * 2**30 / total))
    callbacks = [] if a.no_callback else [LightningMemoryCallback(a.out, steps=a.window)]  # oomdoctor
    trainer, module, train, val = build(a, callbacks)
    trainer.fit(module, train, *val)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    print("RESULT " + json.dumps({"steps": trainer.global_step, "loss": float(trainer.callback_metrics["train_loss"]),
                                  "max_memory_allocated": peak}), flush=True)


if __name__ == "__main__":
    main()
