"""One training job in three harnesses, for ``benchmarks/fit_vs_peers.py``: how each tool finds the largest
micro-batch that runs.

The job: GPT-2 124M (12 x 768, 12 heads, 50,257 vocabulary, random init, ``transformers.GPT2LMHeadModel``),
sequence 512, random tokens, AdamW (lr 3e-4), bf16 autocast over fp32 weights, per-device micro-batch B.

    python scenarios/fit_job.py --harness trainer --batch B [--steps N]     # Hugging Face Trainer
    python scenarios/fit_job.py --harness plain --batch B [--steps N]       # a plain PyTorch loop
    torchrun --nproc_per_node=2 scenarios/fit_job.py --harness plain --ddp --batch B   # the loop under DDP
    # the peers' searches, in one process (rank 0 writes --result FILE: tried sizes, answer, seconds):
    python scenarios/fit_job.py --harness trainer --auto-find --batch START --steps 2 --result F
        # Trainer(auto_find_batch_size=True): accelerate's find_executable_batch_size retries the
        # training loop with a smaller batch after each OOM (x0.9 in accelerate >= 1.x, halving before)
    python scenarios/fit_job.py --harness plain --auto-find --batch START --steps 2 --result F
        # the same decorator around the plain loop
    python scenarios/fit_job.py --harness lightning --binsearch --steps 2 --result F
        # Lightning Tuner.scale_batch_size(mode="binsearch", steps_per_trial=N, init_val=2): doubles until an
        # OOM, then bisects, then takes a margin off (5% by default in Lightning >= 2.5)

Without ``--auto-find``/``--binsearch`` the job trains ``--steps`` steps (default 1000: a "real" run that
``oomdoctor fit`` / ``verify`` stop after K steps themselves). ``--cpu``: a tiny model on the CPU (a dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def build(a: argparse.Namespace):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=max(1, a.width // 64), n_positions=a.seq)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg), cfg.vocab_size


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, (self.seq,), generator=g)
        return {"input_ids": ids, "labels": ids}


def write(a: argparse.Namespace, result: dict) -> None:
    if a.result and int(os.environ.get("RANK", "0")) == 0:
        with open(a.result, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result), flush=True)


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)


# ------------------------------------------------------------------------------------------------- trainer

def trainer(a: argparse.Namespace) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    model, vocab = build(a)
    tried: list[int] = []

    class Seen(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            tried.append(int(state.train_batch_size or args.per_device_train_batch_size))

    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(output_dir="/tmp/fit-job-trainer", per_device_train_batch_size=a.batch,
                             max_steps=a.steps, learning_rate=3e-4, bf16=not a.cpu, use_cpu=a.cpu, logging_steps=1,
                             save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
                             seed=0, auto_find_batch_size=a.auto_find)
    data = RandomTokens(max(a.steps, 2) * a.batch * world, a.seq, vocab)
    t0 = time.perf_counter()
    tr = Trainer(model=model, args=args, train_dataset=data, callbacks=[Seen()])
    tr.train()
    if a.auto_find:
        answer = int(tr.state.train_batch_size)
        write(a, {"tool": "transformers.Trainer(auto_find_batch_size=True)", "start": a.batch, "tried": tried,
                  "answer": answer, "trials": len(tried), "seconds": round(time.perf_counter() - t0, 2),
                  "outcomes": ["ran" if b <= answer else "oom" for b in tried]})


# --------------------------------------------------------------------------------------------------- plain

def plain(a: argparse.Namespace) -> None:
    dev = torch.device("cpu")
    rank = 0
    if a.ddp:
        import torch.distributed as dist
        dist.init_process_group("nccl" if not a.cpu else "gloo")
        rank = dist.get_rank()
    if not a.cpu:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    model, vocab = build(a)
    model.to(dev)
    net = model
    if a.ddp:
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=None if a.cpu else [dev.index])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator(device=dev).manual_seed(rank)

    def train(batch: int, steps: int) -> None:
        for _ in range(steps):
            ids = torch.randint(0, vocab, (batch, a.seq), device=dev, generator=g)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=not a.cpu):
                loss = net(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    if not a.auto_find:
        train(a.batch, a.steps)
        print(f"rank {rank}: {a.steps} steps at micro-batch {a.batch}", flush=True)
        return
    from accelerate.utils import find_executable_batch_size
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=a.batch)
    def search(batch_size: int) -> int:
        tried.append(batch_size)
        opt.zero_grad(set_to_none=True)
        train(batch_size, a.steps)
        return batch_size

    t0 = time.perf_counter()
    answer = search()
    write(a, {"tool": "accelerate.utils.find_executable_batch_size", "start": a.batch, "tried": tried,
              "answer": answer, "trials": len(tried), "seconds": round(time.perf_counter() - t0, 2),
              "outcomes": ["ran" if b <= answer else "oom" for b in tried]})


# ----------------------------------------------------------------------------------------------- lightning

def lightning(a: argparse.Namespace) -> None:
    import lightning as L
    from lightning.pytorch.tuner import Tuner

    tried: list[int] = []

    class Job(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.vocab = build(a)
            self.batch_size = a.batch

        def train_dataloader(self):
            return torch.utils.data.DataLoader(RandomTokens(1 << 20, a.seq, self.vocab), batch_size=self.batch_size)

        def training_step(self, batch, i):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    job = Job()
    outcomes: list[str] = []
    # each trial is one call of _try_loop_run (lightning/pytorch/tuner/batch_size_scaling.py): note its size and how
    # it ended (an OOM propagates out of it to the search, which lowers the size)
    from lightning.pytorch.tuner import batch_size_scaling as bss
    real_try = bss._try_loop_run

    def traced(trainer, params):
        tried.append(int(job.batch_size))
        try:
            real_try(trainer, params)
        except BaseException as e:
            outcomes.append("oom" if is_oom(e) else f"error: {type(e).__name__}")
            raise
        outcomes.append("ran")

    bss._try_loop_run = traced
    trainer = L.Trainer(accelerator="cpu" if a.cpu else "gpu", devices=1, precision="32" if a.cpu else "bf16-mixed",
                        max_steps=a.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    t0 = time.perf_counter()
    tuner = Tuner(trainer)
    import inspect
    extra = {"max_val": a.max_val} if "max_val" in inspect.signature(tuner.scale_batch_size).parameters else {}
    answer = tuner.scale_batch_size(job, mode="binsearch", steps_per_trial=a.steps, init_val=a.init_val,
                                    max_trials=25, **extra)
    found = max((b for b, o in zip(tried, outcomes) if o == "ran"), default=None)
    write(a, {"tool": "lightning Tuner.scale_batch_size(mode='binsearch')", "start": a.init_val, "tried": tried,
              "answer": answer, "largest_ran": found, "trials": len(tried),
              "seconds": round(time.perf_counter() - t0, 2), "outcomes": outcomes})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--harness", choices=("trainer", "plain", "lightning"), required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--auto-find", action="store_true")
    p.add_argument("--binsearch", action="store_true")
    p.add_argument("--init-val", type=int, default=2)
    p.add_argument("--max-val", type=int, default=8192, help="Lightning's largest batch tried (Lightning >= 2.5)")
    p.add_argument("--result")
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args()
    if a.cpu:
        a.layers, a.width, a.seq = 2, 64, min(a.seq, 32)
    {"trainer": trainer, "plain": plain, "lightning": lightning}[a.harness](a)


if __name__ == "__main__":
    main()
