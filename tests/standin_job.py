"""A stand-in for a training job, for the tests of ``oomdoctor fit`` and ``oomdoctor verify`` on a machine without a
GPU. It behaves as a job whose memory grows with its micro-batch:

- ``--mb N`` above the limit: prints PyTorch's real CUDA out-of-memory message (the text of
  ``c10/cuda/CUDACachingAllocator.cpp``, raised as ``torch.OutOfMemoryError``) and exits 1; with ``--catch``, it
  catches it instead, says "skipping" and exits 0 (as a job that guards its step with ``except OutOfMemoryError``).
  Otherwise it stands for a job that steps its optimizer until the stop ``oomdoctor`` injects ends it after K
  steps: it writes the exit record the stop writes (``oomdoctor.capture.exits``, ``"stopped": true``) and exits 0.
- ``cuda``: stand for a process that used CUDA: every exit record it writes has ``memory_stats`` (``num_ooms``
  1 after an OOM, caught or not, else 0; ``reserved_bytes.all.peak`` from ``peaks``), as the injection's records
  have on a GPU; an OOM also writes the record the injection writes at exit (``"stopped": false``).
- the limit: ``STANDIN`` (JSON) ``limit``; ``fixes`` maps a setting to the limit it gives: an allocator option
  (``expandable_segments:True``) counts when ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF`` holds it, a
  ``NAME=value`` when the environment has it.
- ``snapshot``: a snapshot file (or directory of them) that stands for what the recorder would have written on a
  GPU: copied into the run's out directory when ``oomdoctor`` records the run and no fix applies (the first run).
- ``peaks``: setting (``""``: none applies) -> peak reserved bytes: written as the recorder's sidecar
  (``memory_stats`` ``reserved_bytes.all.peak``) when the run is recorded.
- ``sidecars``: setting -> a directory of a real run with that setting: its sidecars (``*.meta.json``, every
  rank's) are copied into the run's out directory when the run is recorded and the setting applies.
- ``--train``: import torch and step an SGD optimizer forever on the CPU (printing ``step N``): only the stop that
  ``oomdoctor`` injects ends it. ``--dist``: under ``torchrun``, a gloo process group and an all-reduce per step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {req:.2f} GiB. GPU 0 has a total capacity of "
       "79.19 GiB of which 312.00 MiB is free. Including non-PyTorch memory, this process has 78.87 GiB memory in "
       "use. Of the allocated memory 76.42 GiB is allocated by PyTorch, and 1.95 GiB is reserved by PyTorch but "
       "unallocated. If reserved but unallocated memory is large try setting "
       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
       "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


def applies(setting: str) -> bool:
    name, sep, value = setting.partition("=")
    if sep and ":" not in name:
        return os.environ.get(name) == value
    conf = ",".join(os.environ.get(v, "") for v in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"))
    return setting in conf.split(",")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1)
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--dist", action="store_true")
    ap.add_argument("--catch", action="store_true")
    args = ap.parse_args()
    spec = json.loads(os.environ.get("STANDIN", "{}"))
    fixed = [s for s in spec.get("fixes", {}) if applies(s)]
    limit = spec["fixes"][fixed[-1]] if fixed else spec.get("limit", 100)
    run_cfg = json.loads(os.environ.get("OOMDOCTOR_RUN_CONFIG", "{}"))
    if run_cfg.get("out") and run_cfg.get("record", True):
        out = run_cfg["out"]
        snap = spec.get("snapshot")
        if snap and not fixed:
            files = [os.path.join(snap, f) for f in sorted(os.listdir(snap))] if os.path.isdir(snap) else [snap]
            for f in files:
                if f.endswith((".pickle", ".meta.json")):
                    shutil.copy(f, out)
        peak = spec.get("peaks", {}).get(fixed[-1] if fixed else "")
        if peak is not None:
            name = "rank0_oom.meta.json" if args.mb > limit else "rank0.meta.json"
            with open(os.path.join(out, name), "w") as f:
                json.dump({"memory_stats": {"reserved_bytes.all.peak": peak}}, f)
        real = spec.get("sidecars", {}).get(fixed[-1]) if fixed else None
        if real:
            for f in sorted(os.listdir(real)):
                if f.endswith(".meta.json"):
                    shutil.copy(os.path.join(real, f), out)
    peak = spec.get("peaks", {}).get(fixed[-1] if fixed else "")
    if args.mb > limit:
        exit_record(run_cfg, spec, stopped=False, oom=True, peak=peak)
        if args.catch:
            print(f"micro-batch {args.mb} does not fit: skipping")
            return 0
        print("Traceback (most recent call last):\n  File \"train.py\", line 42, in <module>\n    loss.backward()",
              file=sys.stderr)
        print(OOM.format(req=0.25 * args.mb), file=sys.stderr)
        return 1
    if args.train:
        import torch
        if args.dist:
            import torch.distributed as dist
            dist.init_process_group("gloo")
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = 0
        while True:
            loss = model(torch.randn(args.mb, 8)).square().mean()
            loss.backward()
            if args.dist:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
            step += 1
            print(f"step {step}" + (f" (rank {dist.get_rank()})" if args.dist else ""), flush=True)
    print(f"ran micro-batch {args.mb}")
    if run_cfg.get("stop_after_steps"):  # the stop after K optimizer steps would have ended it here
        exit_record(run_cfg, spec, stopped=True, oom=False, peak=peak)
        print(f"oomdoctor: stopped after {run_cfg['stop_after_steps']} optimizer steps (stand-in)", file=sys.stderr)
    return 0


def exit_record(run_cfg: dict, spec: dict, *, stopped: bool, oom: bool, peak: int | None) -> None:
    """The exit record the injection writes (``oomdoctor.capture.exits``), where it would write one: at the stop,
    and at the exit of a process that used CUDA (``spec["cuda"]``)."""
    if not run_cfg.get("exits") or not (stopped or spec.get("cuda")):
        return
    try:
        from oomdoctor.capture.exits import exit_record as record
        from oomdoctor.capture.exits import write_exit_record
    except ImportError:
        sys.path.append(os.environ["OOMDOCTOR_PACKAGE_ROOT"])
        from oomdoctor.capture.exits import exit_record as record
        from oomdoctor.capture.exits import write_exit_record
    stats = {"num_ooms": int(oom), **({"reserved_bytes.all.peak": peak} if peak is not None else {})} \
        if spec.get("cuda") else None
    k = int(run_cfg.get("stop_after_steps") or 0)
    write_exit_record(run_cfg["exits"], record(stopped=stopped, steps=k if stopped else 0, steps_asked=k, rank=0,
                                               pid=os.getpid(), cuda=bool(spec.get("cuda")), memory_stats=stats))


if __name__ == "__main__":
    sys.exit(main())
