"""A Hugging Face Trainer job, as users write it: GPT-2 (random init), bf16, AdamW, DDP under torchrun.

Nothing in it knows about oomdoctor: the capture tests and the overhead benchmark run it plain and
under ``oomdoctor run`` and compare. Options let a test shape the job and inject faults:

    torchrun --nproc_per_node=2 scenarios/trainer_gpt2.py --steps 40 --gradient-checkpointing \
        --done DIR            # each rank writes DIR/done-rank{R}.json: steps trained, last loss
        --times FILE          # rank 0 writes the wall time at the end of every step (after a sync)
        --kill-rank 1 --kill-step 5        # that rank SIGKILLs itself at the end of that step
        --fault-step 3 --fault-cmd "CMD"   # rank 0 runs a shell command at the end of that step
        --eval-samples N [--eval-accumulation-steps K]   # after training, Trainer.evaluate() with
                              # compute_metrics over N samples (the logits are gathered on the GPU until
                              # every K steps, or the end, moves them to the CPU)
        --ground-truth FILE   # rank 0 writes what the job measures itself (scenarios/_truth.py): parameter,
                              # gradient and optimizer-state bytes of the live tensors,
                              # max_memory_allocated/reserved, and the out-of-memory error if one ended the job
        --fsdp                # FSDP2 through Trainer (fsdp_config version 2, one unit per GPT2Block)

GPT-2 124M: 12 layers, 768 wide, 12 heads, 50,257 vocabulary, dropout 0.1 (``GPT2Config`` defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time

import torch
from _truth import GroundTruth
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Harness(TrainerCallback):
    """Step times, fault injection and the 'done' record; rank from the environment (torchrun)."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.rank = int(os.environ.get("RANK", "0"))
        self.times: list[float] = []
        self.extra: dict = {}

    def on_step_end(self, args, state, control, **kw):
        a = self.a
        if a.times and self.rank == 0:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
        if a.kill_step is not None and state.global_step == a.kill_step and self.rank == a.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if a.fault_cmd and state.global_step == a.fault_step and self.rank == 0:
            subprocess.run(a.fault_cmd, shell=True, check=False)

    def on_train_end(self, args, state, control, **kw):
        if torch.cuda.is_available():
            self.extra["train_max_memory_allocated"] = torch.cuda.max_memory_allocated()
        if self.a.times and self.rank == 0:
            with open(self.a.times, "w") as f:
                json.dump({"step_end_s": self.times}, f)
        if self.a.done:
            losses = [h["loss"] for h in state.log_history if "loss" in h]
            with open(os.path.join(self.a.done, f"done-rank{self.rank}.json"), "w") as f:
                json.dump({"rank": self.rank, "global_step": state.global_step,
                           "last_loss": losses[-1] if losses else None}, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--use-reentrant", choices=("default", "true", "false"), default="default",
                   help="gradient_checkpointing_kwargs; 'default' passes none, as most users do")
    p.add_argument("--cpu", action="store_true", help="tiny dry run without a GPU")
    p.add_argument("--output-dir", default="/tmp/trainer-gpt2")
    p.add_argument("--done")
    p.add_argument("--times")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-step", type=int)
    p.add_argument("--fault-step", type=int)
    p.add_argument("--fault-cmd")
    p.add_argument("--ground-truth")
    p.add_argument("--eval-samples", type=int, default=0)
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--eval-accumulation-steps", type=int)
    p.add_argument("--fsdp", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=max(1, a.width // 64), n_positions=a.seq)
    model = GPT2LMHeadModel(cfg)
    data = RandomTokens(a.steps * a.batch * int(os.environ.get("WORLD_SIZE", "1")), a.seq, cfg.vocab_size)
    kwargs = {}
    if a.eval_accumulation_steps:
        kwargs["eval_accumulation_steps"] = a.eval_accumulation_steps
    if a.use_reentrant != "default":
        kwargs["gradient_checkpointing_kwargs"] = {"use_reentrant": a.use_reentrant == "true"}
    if a.fsdp:
        kwargs["fsdp"] = True
        kwargs["fsdp_config"] = {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}
    truth = GroundTruth(a.ground_truth, batch=a.batch, seq=a.seq, layers=a.layers, width=a.width,
                        vocab=cfg.vocab_size, eval_samples=a.eval_samples, eval_batch=a.eval_batch,
                        eval_accumulation_steps=a.eval_accumulation_steps, fsdp=a.fsdp,
                        gradient_checkpointing=a.gradient_checkpointing, framework="transformers.Trainer")
    if torch.cuda.is_available():
        truth.install()
    args = TrainingArguments(
        output_dir=a.output_dir, per_device_train_batch_size=a.batch, per_device_eval_batch_size=a.eval_batch, max_steps=a.steps, learning_rate=3e-4,
        bf16=not a.cpu, use_cpu=a.cpu, gradient_checkpointing=a.gradient_checkpointing, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0, seed=0, **kwargs)
    harness = Harness(a)
    evaluation = {}
    if a.eval_samples:
        evaluation = {"eval_dataset": RandomTokens(a.eval_samples, a.seq, cfg.vocab_size, seed=1),
                      "compute_metrics": token_accuracy}
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[harness], **evaluation)
    try:
        trainer.train()
        if a.eval_samples:
            harness.extra["eval_metrics"] = trainer.evaluate()
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        truth.write(**harness.extra)


def token_accuracy(p) -> dict:
    """``compute_metrics``: next-token accuracy from the logits, which makes Trainer keep every batch's."""
    preds = p.predictions.argmax(-1)
    return {"token_accuracy": float((preds[:, :-1] == p.label_ids[:, 1:]).mean())}


if __name__ == "__main__":
    main()
