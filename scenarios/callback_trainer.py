"""A Hugging Face Trainer job with oomdoctor's callback: the one added line is marked ``# oomdoctor``.

GPT-2 from its config (random init, no download) on random tokens, AdamW, bf16 on a GPU. Options:

    python scenarios/callback_trainer.py --out memory/ --batch 4 --steps 8 --eval-steps 4 --window 2:5
    python scenarios/callback_trainer.py --out memory/ --batch 64 --cap-gib 6   # an induced OOM

``--cap-gib`` caps the process with ``torch.cuda.set_per_process_memory_fraction`` so that the OOM
happens at the same batch on any GPU; ``--layers/--width/--seq/--vocab`` shrink the model (the CPU
tests run it tiny). The job prints ``RESULT {json}`` (steps, last loss, max_memory_allocated) when it
ends without an error.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from oomdoctor.integrations import TrainerMemoryCallback


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="oomdoctor-memory")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (0: never)")
    p.add_argument("--window", default=None, help="record only these steps, e.g. 2:5")
    p.add_argument("--cap-gib", type=float, default=None)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--no-callback", action="store_true", help="the same job without oomdoctor")
    p.add_argument("--output-dir", default="/tmp/callback-trainer")
    return p.parse_args(argv)


def build(a: argparse.Namespace, callbacks: list) -> Trainer:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=a.heads, vocab_size=a.vocab, n_positions=a.seq)
    cuda = torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=a.output_dir, per_device_train_batch_size=a.batch, per_device_eval_batch_size=a.batch,
        max_steps=a.steps, learning_rate=1e-4, bf16=cuda, use_cpu=not cuda, logging_steps=1, report_to=[],
        save_strategy="no", eval_strategy="steps" if a.eval_steps else "no", eval_steps=a.eval_steps or None,
        dataloader_num_workers=0, seed=0, disable_tqdm=True)
    data = RandomTokens(a.batch * a.steps, a.seq, a.vocab)
    return Trainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=data,
                   eval_dataset=RandomTokens(2 * a.batch, a.seq, a.vocab, seed=1) if a.eval_steps else None,
                   callbacks=callbacks)


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    if a.cap_gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * 2**30 / total))
    callbacks = [] if a.no_callback else [TrainerMemoryCallback(a.out, steps=a.window)]  # oomdoctor
    trainer = build(a, callbacks)
    out = trainer.train()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    print("RESULT " + json.dumps({"steps": out.global_step, "loss": out.training_loss,
                                  "max_memory_allocated": peak}), flush=True)


if __name__ == "__main__":
    main()
