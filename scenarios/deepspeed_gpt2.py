"""DeepSpeed ZeRO on one GPU, as DeepSpeed's getting-started page shows it: GPT-2 124M (random init), bf16,
DeepSpeed's own AdamW over torch's (``torch_adam``: no fused op to build), ``deepspeed.initialize`` /
``engine.backward`` / ``engine.step``.

Nothing in it knows about oomdoctor (run it under ``oomdoctor run``)::

    torchrun --nproc_per_node=1 scenarios/deepspeed_gpt2.py --stage 2 --batch 16 --steps 3 [--ground-truth FILE]

The optimizer DeepSpeed builds differs per stage (``deepspeed/runtime/engine.py``
``_do_optimizer_sanity_check``): stage 1 with bf16 weights and fp32 gradient accumulation is
``BF16_Optimizer``, stage 2 ``DeepSpeedZeroOptimizer``, stage 3 ``DeepSpeedZeroOptimizer_Stage3``
(parameters partitioned, gathered per module). Each steps a ``torch.optim.AdamW`` over fp32 master
copies, which the ground truth counts with the model's bf16 parameters (``scenarios/_truth.py``).
"""

from __future__ import annotations

import argparse
import os

import torch
from _truth import GroundTruth
from transformers import GPT2Config, GPT2LMHeadModel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--ground-truth")
    a = p.parse_args()
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(0)
    cfg = GPT2Config(n_positions=a.seq)
    model = GPT2LMHeadModel(cfg)
    config = {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": a.stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
    }
    truth = GroundTruth(a.ground_truth, batch=a.batch, seq=a.seq, stage=a.stage, vocab=cfg.vocab_size,
                        framework="deepspeed").install()
    engine, _opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    truth.model = engine.module
    truth.note(deepspeed_optimizer=type(engine.optimizer).__name__)
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(a.steps):
            ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g).to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        truth.write()


if __name__ == "__main__":
    main()
