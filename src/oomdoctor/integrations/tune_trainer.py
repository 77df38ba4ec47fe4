"""``python -m oomdoctor.integrations.tune_trainer --hf-config PATH --seq-len N --micro-batch M --grad-accum G
[--checkpointing none|full|every-K] [--optimizer fused|foreach|for-loop|adamw8bit|sgd] [--dtype bf16|fp16|fp32]``:
the Hugging Face Trainer job that ``oomdoctor tune --hf-config`` traces (:func:`oomdoctor.preflight.steps.trace_hf`),
run for real on the GPU (under ``torchrun`` on several): a causal LM of that config with random weights, trained
on random tokens with ``transformers.Trainer``, until ``oomdoctor tune``'s injection stops it after its K optimizer
steps (it never stops by itself otherwise).

The configuration as Trainer takes it:

- ``--optimizer fused``: ``optim="adamw_torch_fused"``; ``foreach``: ``optim="adamw_torch"`` (AdamW's default on
  CUDA); ``for-loop``: ``optimizers=(torch.optim.AdamW(..., foreach=False), None)``; ``adamw8bit``:
  ``optim="adamw_bnb_8bit"``; ``sgd``: ``optim="sgd"``;
- ``--checkpointing full``: ``gradient_checkpointing=True`` with ``{"use_reentrant": False}``; ``every-K``: the same,
  then every K-th decoder layer only (what transformers' ``every_n_layers`` does, set here on train begin so that
  it runs on transformers releases without that argument).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any, cast


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m oomdoctor.integrations.tune_trainer")
    p.add_argument("--hf-config", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--checkpointing", default="none")
    p.add_argument("--optimizer", default="fused")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--max-steps", type=int, default=1_000_000)
    return p.parse_args(argv)


class RandomTokens:
    """A map-style dataset of random token ids (``input_ids`` and ``labels``), as long as asked (Trainer's sampler
    draws a permutation of it each epoch: 2**20 samples, more than any short run takes)."""

    def __init__(self, vocab: int, seq_len: int, length: int = 1 << 20) -> None:
        self.vocab, self.seq_len, self.length = vocab, seq_len, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        ids = torch.randint(0, self.vocab, (self.seq_len,))
        return {"input_ids": ids, "labels": ids}


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from ..preflight.steps import load_config

    cfg = load_config(a.hf_config)
    cfg.use_cache = False
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    with device:  # random weights made where they train (fp32, as Trainer keeps them)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    every = 0 if a.checkpointing == "none" else 1 if a.checkpointing == "full" else \
        int(a.checkpointing.removeprefix("every-"))
    optim = {"fused": "adamw_torch_fused", "foreach": "adamw_torch", "for-loop": "adamw_torch",
             "adamw8bit": "adamw_bnb_8bit", "sgd": "sgd"}[a.optimizer]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="oomdoctor-tune-"), per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=a.grad_accum, max_steps=a.max_steps, bf16=a.dtype == "bf16",
        fp16=a.dtype == "fp16", optim=optim, gradient_checkpointing=every > 0,
        gradient_checkpointing_kwargs={"use_reentrant": False} if every else None, report_to="none",
        save_strategy="no", logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    optimizers: tuple[Any, Any] = (None, None)
    if a.optimizer == "for-loop":
        optimizers = (torch.optim.AdamW(model.parameters(), lr=args.learning_rate, foreach=False), None)

    class EveryK(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if every > 1 and model is not None:
                from transformers.modeling_layers import GradientCheckpointingLayer

                layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
                for i, layer in enumerate(layers):
                    layer.gradient_checkpointing = i % every == 0

    # a map-style dataset (__len__, __getitem__) is what Trainer reads; its annotation names torch's and datasets'
    # classes only
    data = cast(Any, RandomTokens(int(cfg.vocab_size), a.seq_len))
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=optimizers, callbacks=[EveryK()])
    trainer.train()


if __name__ == "__main__":
    main()
