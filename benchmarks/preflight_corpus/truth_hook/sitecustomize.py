"""The GPU truth of a public training script, read without changing the script (issue 50 item 5).

Put this folder first on ``PYTHONPATH`` and set ``OOMTRUTH_OUT`` (a file: one JSON line is appended per
process), ``OOMTRUTH_NAME`` (the corpus entry) and ``OOMTRUTH_STEPS`` (K, default 2). Python imports
``sitecustomize`` at start-up (``site`` module docs), so every process of the job, ``torchrun``'s ranks too,
registers a **global optimizer step post-hook** (``torch.optim.optimizer.register_optimizer_step_post_hook``,
the hook ``oomdoctor preflight`` counts steps with): after the K-th ``step()`` of any ``torch.optim`` optimizer
it reads ``torch.cuda.max_memory_allocated()`` / ``max_memory_reserved()`` (bytes, since the process started:
the same window ``preflight --steps K`` traces), appends them as one JSON line and ends the process
(``os._exit(0)``: no evaluation, checkpoint or shutdown after the measured steps).

A step skipped by fp16's ``GradScaler`` (an inf/NaN gradient) calls no ``optimizer.step()``: it is not counted
(``scaler_skipped`` says how many were), so the K counted steps are K real updates, as preflight traces them.
A process that ends before its K-th step appends a line with ``"completed": false`` (``atexit``).

Nothing here runs unless ``OOMTRUTH_OUT`` is set; with it set, nothing changes what the job computes.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time

_OUT = os.environ.get("OOMTRUTH_OUT")


def _install() -> None:
    t0 = time.time()
    state = {"steps": 0, "written": False, "scaler_calls": 0, "per_step": []}
    k = int(os.environ.get("OOMTRUTH_STEPS", "2"))
    name = os.environ.get("OOMTRUTH_NAME", os.path.basename(sys.argv[0] if sys.argv else "?"))

    import torch

    def cuda_numbers() -> dict:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return {"cuda": False}
        return {"cuda": True, "device": torch.cuda.get_device_name(), "max_allocated": torch.cuda.max_memory_allocated(),
                "max_reserved": torch.cuda.max_memory_reserved(), "allocated": torch.cuda.memory_allocated(),
                "reserved": torch.cuda.memory_reserved(),
                "num_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
                "num_ooms": torch.cuda.memory_stats().get("num_ooms", 0)}

    def write(completed: bool, why: str) -> None:
        if state["written"]:
            return
        state["written"] = True
        row = {"name": name, "completed": completed, "why": why, "steps": state["steps"], "k": k,
               "rank": int(os.environ.get("RANK", "0")), "world_size": int(os.environ.get("WORLD_SIZE", "1")),
               "pid": os.getpid(), "wall_s": round(time.time() - t0, 2), "torch": torch.__version__,
               "scaler_calls": state["scaler_calls"],
               "scaler_skipped": max(0, state["scaler_calls"] - state["steps"]) if state["scaler_calls"] else 0,
               "per_step": state["per_step"], **cuda_numbers()}
        line = json.dumps(row) + "\n"
        fd = os.open(_OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def post(opt, args, kwargs) -> None:  # noqa: ANN001 - torch's hook signature
        state["steps"] += 1
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["per_step"].append([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()])
        if state["steps"] >= k:
            write(True, f"after optimizer step {k}")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(post)
    try:  # count GradScaler.step calls (skipped steps call no optimizer.step)
        from torch.amp import grad_scaler

        orig = grad_scaler.GradScaler.step

        def step(self, optimizer, *a, **kw):  # noqa: ANN001, ANN002, ANN003
            state["scaler_calls"] += 1
            return orig(self, optimizer, *a, **kw)

        grad_scaler.GradScaler.step = step
    except Exception:  # noqa: BLE001 - an older torch: the count is left out, nothing else changes
        pass
    atexit.register(lambda: write(False, "the process ended before its K-th optimizer step"))


if _OUT:
    try:
        _install()
    except Exception as e:  # noqa: BLE001 - never break the job: say so on stderr
        print(f"oomtruth: hook not installed: {type(e).__name__}: {e}", file=sys.stderr)
