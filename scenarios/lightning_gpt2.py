"""A PyTorch Lightning job, as users write it: a LightningModule around GPT-2, bf16-mixed, AdamW.

Nothing in it knows about oomdoctor (run it under ``oomdoctor run``)::

    python scenarios/lightning_gpt2.py --devices 2 --strategy fsdp --batch 16 --steps 4 \
        [--validate-samples N --val-batch B --keep-val-logits]   # then trainer.validate(): the module
                              # appends every batch's logits to a list on the GPU, the way
                              # Lightning's docs show on_validation_epoch_end collecting outputs
        [--ground-truth FILE]  # scenarios/_truth.py

Lightning launches its own processes for ``--devices 2`` (its subprocess launcher), as users run it.
GPT-2 124M by default (12 layers, 768 wide, 50,257 vocabulary), sequence 1024, random tokens.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from _truth import GroundTruth
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


class LitGPT2(L.LightningModule):
    def __init__(self, cfg: GPT2Config, keep_val_logits: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.keep_val_logits = keep_val_logits
        self.model = GPT2LMHeadModel(cfg)
        self.val_logits: list[torch.Tensor] = []

    def training_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss

    def validation_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
        out = self.model(input_ids=ids, labels=ids)
        if self.keep_val_logits:
            self.val_logits.append(out.logits)  # kept on the GPU until the epoch ends
        self.log("val_loss", out.loss, sync_dist=True)
        return out.loss

    def on_validation_epoch_end(self) -> None:
        if self.val_logits:
            logits = torch.cat(self.val_logits)
            self.log("val_logit_mean", logits.float().mean(), sync_dist=True)
            self.val_logits.clear()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--validate-samples", type=int, default=0)
    p.add_argument("--val-batch", type=int, default=8)
    p.add_argument("--keep-val-logits", action="store_true")
    p.add_argument("--ground-truth")
    p.add_argument("--cpu", action="store_true", help="tiny dry run without a GPU")
    a = p.parse_args()
    L.seed_everything(0, verbose=False)
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=max(1, a.width // 64), n_positions=a.seq)
    module = LitGPT2(cfg, a.keep_val_logits)
    strategy = a.strategy
    if a.strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy
        strategy = FSDPStrategy(auto_wrap_policy={GPT2Block})
    trainer = L.Trainer(accelerator="cpu" if a.cpu else "gpu", devices=a.devices, strategy=strategy,
                        precision="32-true" if a.cpu else "bf16-mixed", max_steps=a.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    truth = GroundTruth(a.ground_truth, batch=a.batch, seq=a.seq, layers=a.layers, width=a.width,
                        vocab=cfg.vocab_size, strategy=a.strategy, validate_samples=a.validate_samples,
                        val_batch=a.val_batch, keep_val_logits=a.keep_val_logits, framework="lightning")
    if torch.cuda.is_available():
        truth.install()
    world = a.devices
    train = torch.utils.data.DataLoader(RandomTokens(a.steps * a.batch * world, a.seq, cfg.vocab_size),
                                        batch_size=a.batch)
    try:
        trainer.fit(module, train)
        if a.validate_samples:
            val = torch.utils.data.DataLoader(RandomTokens(a.validate_samples, a.seq, cfg.vocab_size, seed=1),
                                              batch_size=a.val_batch)
            trainer.validate(module, val, verbose=False)
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        os.environ.setdefault("RANK", str(trainer.global_rank))
        truth.rank = trainer.global_rank
        truth.write()


if __name__ == "__main__":
    main()
