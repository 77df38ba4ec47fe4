"""Narrowing the crash of non-reentrant activation checkpointing under memory-history recording.

Each case runs in a fresh process (a lost Python exception leaves the interpreter in an odd state)
and prints one JSON line: the case, whether the code raised what it should have, and the exception
that reached Python instead. ``--matrix FILE`` runs every case and writes the lines to FILE.

    python scenarios/checkpoint_free_stacks.py --matrix results.jsonl

Cases:
  checkpoint:   the issue's reproducer (Linear+GELU+Dropout x4 under ``checkpoint(use_reentrant=False)``,
                bf16 autocast, 3 backward passes), with the recording's ``context``, dropout, reentrant,
                checkpoint's early stop and ``preserve_rng_state`` varied one at a time.
  pack-hook:    no checkpoint at all: a ``saved_tensors_hooks`` pack hook raises inside one op
                (dropout, gelu, linear) in the forward pass on the main thread; the caller catches it.
  pack-hook-backward, pack-hook-thread: the same hook raising inside a custom Function's backward
                (the autograd engine's device thread), or in a plain Python thread.
  python-raise: a Python function raises with a CUDA tensor as a local (freed while the exception
                propagates through Python frames, not C++ ones).
  empty-cache:  which stack a ``segment_free`` caused by ``torch.cuda.empty_cache()`` carries under
                each ``context`` (what the cache-flush detector can read).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


class Stop(Exception):
    pass


def record(torch, context: str | None) -> None:
    if context is not None:
        torch.cuda.memory._record_memory_history(max_entries=100000, context=context, stacks="python")


def case_checkpoint(torch, context, dropout=True, reentrant=False, early_stop=True, preserve_rng=True,
                    autocast=True) -> dict:
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    record(torch, context)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.GELU()] + ([torch.nn.Dropout(0.1)] if dropout else [])
    m = torch.nn.Sequential(*layers).cuda()
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    for _ in range(3):
        with set_checkpoint_early_stop(early_stop), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = checkpoint(m, x, use_reentrant=reentrant, preserve_rng_state=preserve_rng)
        y.float().sum().backward()
    torch.cuda.synchronize()
    return {"raised": None}


def case_pack_hook(torch, context, op="dropout") -> dict:
    import torch.nn.functional as F

    record(torch, context)
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    w = torch.randn(1024, 1024, device="cuda", requires_grad=True)

    def pack(t):
        raise Stop("raised in the pack hook")

    fn = {"dropout": lambda: F.dropout(x, 0.1, training=True), "gelu": lambda: F.gelu(x),
          "linear": lambda: F.linear(x, w)}[op]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
    except Stop:
        return {"raised": "Stop"}
    return {"raised": None}


def case_pack_hook_backward(torch, context, op="dropout") -> dict:
    """The pack hook raises inside an op that runs in a custom Function's backward, i.e. on the
    autograd engine's device thread, and the backward catches it (what checkpoint's early stop does)."""
    import torch.nn.functional as F

    record(torch, context)
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            def pack(t):
                raise Stop("raised in the pack hook")

            x = torch.randn(64, 1024, device="cuda", requires_grad=True)
            try:
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    F.dropout(x, 0.1, training=True) if op == "dropout" else F.gelu(x)
            except Stop:
                seen["raised"] = "Stop"
            except BaseException as e:  # noqa: BLE001
                seen["raised"] = f"{type(e).__name__}: {str(e)[:200]}"
            return g

    x = torch.randn(8, device="cuda", requires_grad=True)
    Probe.apply(x).sum().backward()
    return {"raised": seen.get("raised")}


def case_pack_hook_thread(torch, context, op="dropout") -> dict:
    """The same pack hook raising in a plain Python thread (not the engine's)."""
    import threading

    out = {}
    def body():
        try:
            out.update(case_pack_hook(torch, context, op))
        except BaseException as e:  # noqa: BLE001 - reported like the other cases
            out.update(raised=f"{type(e).__name__}: {str(e)[:200]}")

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out


def case_python_raise(torch, context) -> dict:
    record(torch, context)

    def f():
        t = torch.empty(1 << 20, device="cuda")  # noqa: F841 - freed while Stop propagates
        raise Stop("raised in Python")

    try:
        f()
    except Stop:
        return {"raised": "Stop"}
    return {"raised": None}


def case_empty_cache(torch, context) -> dict:
    record(torch, context)

    def make():
        return torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

    t = make()
    del t
    torch.cuda.empty_cache()
    snap = torch.cuda.memory._snapshot()
    ev = [e for e in snap["device_traces"][torch.cuda.current_device()] if e["action"] == "segment_free"]
    frees = [e for e in snap["device_traces"][torch.cuda.current_device()] if e["action"] == "free_requested"]
    names = lambda e: [f["name"] for f in e.get("frames", []) if f["filename"].endswith(".py")][:3]  # noqa: E731
    return {"raised": None, "segment_free_frames": [names(e) for e in ev],
            "free_requested_frames": [names(e) for e in frees]}


CASES = {
    "checkpoint": case_checkpoint, "pack-hook": case_pack_hook, "pack-hook-backward": case_pack_hook_backward,
    "pack-hook-thread": case_pack_hook_thread, "python-raise": case_python_raise,
    "empty-cache": case_empty_cache,
}

MATRIX = (
    [("checkpoint", {"context": c}) for c in ("all", "alloc", "state", None)]
    + [("checkpoint", {"context": "all", k: v}) for k, v in (("dropout", False), ("reentrant", True),
                                                              ("early_stop", False), ("preserve_rng", False),
                                                              ("autocast", False))]
    + [("pack-hook", {"context": c, "op": op}) for op in ("dropout", "gelu", "linear") for c in ("all", "alloc", None)]
    + [(n, {"context": c, "op": op}) for n in ("pack-hook-backward", "pack-hook-thread") for op in ("dropout", "gelu")
       for c in ("all", "alloc")]
    + [("python-raise", {"context": c}) for c in ("all", "alloc")]
    + [("empty-cache", {"context": c}) for c in ("all", "alloc")]
)


def run_one(name: str, kw: dict) -> dict:
    import torch

    out = {"case": name, **kw, "torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        out.update(CASES[name](torch, **kw))
        out["exception"] = None
    except BaseException as e:  # noqa: BLE001 - what reaches Python is the result
        out.update(raised=None, exception=f"{type(e).__name__}: {str(e)[:300]}")
    expected = "Stop" if name.startswith(("pack-hook", "python-raise")) else None
    out["ok"] = out["exception"] is None and out["raised"] == expected
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--matrix", help="run every case, one process each, and write JSON lines here")
    p.add_argument("--case", choices=sorted(CASES))
    p.add_argument("--kw", default="{}", help="the case's arguments as JSON")
    p.add_argument("--only", help="with --matrix: only the cases whose name starts with this")
    a = p.parse_args()
    if a.case:
        print(json.dumps(run_one(a.case, json.loads(a.kw))), flush=True)
        return
    with open(a.matrix, "w") as f:
        for name, kw in MATRIX:
            if a.only and not name.startswith(a.only):
                continue
            proc = subprocess.run([sys.executable, __file__, "--case", name, "--kw", json.dumps(kw)],
                                  capture_output=True, text=True, timeout=300)
            line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else json.dumps(
                {"case": name, **kw, "ok": False, "exception": f"process exited {proc.returncode}: "
                                                                f"{proc.stderr.strip()[-300:]}"})
            f.write(line + "\n")
            print(line, flush=True)


if __name__ == "__main__":
    main()
