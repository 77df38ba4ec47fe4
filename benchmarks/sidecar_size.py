"""How large the sidecar grows with what the recorder notes (issue 54): every optimizer's storages at its first
steps and at the dump, and every module's parameters and buffers, per rank and for 512 ranks.

The recorder's own code writes each sidecar (``Recorder.metadata`` and the file writer it uses), for jobs built
as stand-ins with their real tensor counts, shard sizes and 48-bit addresses (a CUDA device's), so no GPU is needed:
the sidecar holds numbers, and its size depends only on how many storages there are and how many digits they
take. One rank's sidecar of each job is written to a temporary directory; its bytes x 512 is the job's total at
512 ranks (every rank writes its own, of the same shape). Also timed: the one pass over ``gc.get_objects()`` that
finds the root modules, in a process holding a given number of Python objects.

    python benchmarks/sidecar_size.py [--objects 5000000] [--json docs/sidecar_size.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from oomdoctor.capture.facts import FACT_STEPS, MODULE_KINDS, module_roots  # noqa: E402
from oomdoctor.capture.files import json_bytes, sidecar_json_bytes  # noqa: E402
from oomdoctor.capture.recorder import Recorder  # noqa: E402

RANKS = 512


class Storage:
    def __init__(self, ptr: int, n: int) -> None:
        self.ptr, self.n = ptr, n

    def data_ptr(self) -> int:
        return self.ptr

    def nbytes(self) -> int:
        return self.n


class Tensor:
    """A CUDA tensor as far as the recorder reads one (``is_cuda``, ``device``, ``untyped_storage``)."""

    is_cuda = True
    device = SimpleNamespace(index=0, type="cuda")

    def __init__(self, alloc, n: int, requires_grad: bool = True) -> None:
        self._s = Storage(alloc(n), n)
        self.requires_grad = requires_grad
        self.grad = None

    def untyped_storage(self) -> Storage:
        return self._s


class Module:
    """What :func:`oomdoctor.capture.facts.module_record` walks: the ``_modules`` / ``_parameters`` / ``_buffers``
    dicts of an ``nn.Module``."""

    def __init__(self) -> None:
        self._modules, self._parameters, self._buffers = {}, {}, {}


class Optimizer:
    def __init__(self, params, state_per_param: int) -> None:
        self.param_groups = [{"params": params}]
        self.state = {}
        self.per = state_per_param

    def fill(self, alloc) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = Tensor(alloc, p.untyped_storage().nbytes())
            self.state[p] = {f"s{i}": Tensor(alloc, p.untyped_storage().nbytes()) for i in range(self.per)}


def allocator():
    """48-bit device addresses, 512-byte aligned, as the caching allocator hands out (``0x7f...``)."""
    nxt = [0x7F0000000000 + random.Random(0).randrange(1 << 30) * 512]

    def alloc(n: int) -> int:
        ptr = nxt[0]
        nxt[0] += (n + 511) // 512 * 512
        return ptr
    return alloc


def transformer(alloc, layers: int, d: int, ffn: int, vocab: int, kv: int, shard: int, bytes_per: int,
                frozen: bool = False, lora: int = 0, experts: int = 1) -> tuple[Module, list[Tensor]]:
    """A decoder's module tree (embedding, per layer: attention q/k/v/o, ``experts`` MLPs of gate/up/down, two
    norms; final norm, head) with each parameter's local shard (``shard`` ranks); LoRA adapters (rank ``lora``)
    on q/k/v/o, trained, the rest frozen, when ``lora``. Returns the root and the trained parameters."""
    root, trained = Module(), []

    def param(mod: Module, name: str, numel: int, grad: bool) -> None:
        t = Tensor(alloc, max(1, numel // shard) * bytes_per, requires_grad=grad)
        mod._parameters[name] = t
        if grad:
            trained.append(t)

    emb, head, norm = Module(), Module(), Module()
    param(emb, "weight", vocab * d, not frozen)
    param(head, "weight", vocab * d, not frozen)
    param(norm, "weight", d, not frozen)
    layer_list = Module()
    for i in range(layers):
        blk = Module()
        for name, numel in (("q", d * d), ("k", kv * d), ("v", kv * d), ("o", d * d)):
            lin = Module()
            param(lin, "weight", numel, not frozen)
            if lora:
                a, b = Module(), Module()
                param(a, "weight", lora * d, True)
                param(b, "weight", lora * d, True)
                lin._modules.update(lora_A=a, lora_B=b)
            blk._modules[name] = lin
        for e in range(experts):
            mlp = Module()
            for name in ("gate", "up", "down"):
                lin = Module()
                param(lin, "weight", d * ffn, not frozen)
                mlp._modules[name] = lin
            blk._modules[f"mlp{e}"] = mlp
        for name in ("n1", "n2"):
            n = Module()
            param(n, "weight", d, not frozen)
            blk._modules[name] = n
        layer_list._modules[str(i)] = blk
    root._modules.update(embed=emb, layers=layer_list, norm=norm, head=head)
    rope = Module()
    rope._buffers["inv_freq"] = Tensor(alloc, d // 64 * 4, requires_grad=False)
    root._modules["rotary"] = rope
    return root, trained


JOBS = {
    "gpt2-124m-ddp": dict(layers=12, d=768, ffn=3072, vocab=50257, kv=768, shard=1, bytes_per=4),
    "llama3-8b-fsdp2": dict(layers=32, d=4096, ffn=14336, vocab=128256, kv=1024, shard=RANKS, bytes_per=4),
    "llama3-70b-fsdp2": dict(layers=80, d=8192, ffn=28672, vocab=128256, kv=1024, shard=RANKS, bytes_per=4),
    "llama3-70b-lora-r16": dict(layers=80, d=8192, ffn=28672, vocab=128256, kv=1024, shard=1, bytes_per=2,
                                frozen=True, lora=16),
    "moe-58x64-experts-ep": dict(layers=58, d=7168, ffn=2048, vocab=129280, kv=1024, shard=8, bytes_per=4, experts=64),
}


def job_sidecar(name: str, spec: dict, out_dir: str) -> dict:
    alloc = allocator()
    roots, optimizers = [], []
    root, trained = transformer(alloc, **spec)
    roots.append(root)
    optimizers.append(Optimizer(trained, 2))  # AdamW: exp_avg, exp_avg_sq (step on the host)
    return write(name, roots, optimizers, alloc, out_dir)


def gan_sidecar(out_dir: str) -> dict:
    alloc = allocator()
    gen, g = transformer(alloc, layers=8, d=1024, ffn=4096, vocab=1024, kv=1024, shard=1, bytes_per=4)
    disc, dd = transformer(alloc, layers=4, d=1024, ffn=4096, vocab=1024, kv=1024, shard=1, bytes_per=4)
    ema, _ = transformer(alloc, layers=8, d=1024, ffn=4096, vocab=1024, kv=1024, shard=1, bytes_per=4, frozen=True)
    return write("gan-2-optimizers-ema", [gen, disc, ema], [Optimizer(dd, 2), Optimizer(g, 2)], alloc, out_dir)


def write(name: str, roots: list, optimizers: list, alloc, out_dir: str) -> dict:
    """One rank's sidecar, by the recorder: FACT_STEPS steps of every optimizer, the modules at the first, a dump."""
    rec = Recorder(os.path.join(out_dir, name), on_oom=False, stack_steps="all")
    cuda = SimpleNamespace(current_device=lambda: 0, memory_stats=lambda d: {}, mem_get_info=lambda d: (0, 1 << 37),
                           get_device_properties=lambda d: SimpleNamespace(name="NVIDIA H200", total_memory=1 << 37),
                           get_per_process_memory_fraction=lambda d: 1.0, nccl=SimpleNamespace(version=lambda: (2, 28, 9)))
    rec._torch = SimpleNamespace(cuda=cuda, nn=SimpleNamespace(Module=Module), __version__="2.11.0+cu130",
                                 version=SimpleNamespace(cuda="13.0"))
    rec.active = True
    for opt in optimizers:
        opt.fill(alloc)
    for _ in range(FACT_STEPS):
        for opt in optimizers:
            rec._optimizer_hook(opt, (), {})
    meta = rec.metadata(None, "final", None, rec._dump_facts(), [], rec._dump_modules())
    data = sidecar_json_bytes(meta)  # what the recorder writes
    indented = json_bytes(meta)  # one number a line, as sidecars were written before
    # what the recorder wrote before issue 54: no modules, step records without optimizer and class, one number a line
    before = {k: v for k, v in meta.items() if k != "modules"}
    before["tensors"] = [{k: v for k, v in r.items() if k not in ("optimizer", "class", "optimizers")}
                         for r in meta["tensors"]]
    old_bytes = len(json_bytes(before))
    counts = {"storages_noted": sum(len(r[k]) for r in meta["tensors"] for k in ("parameters", "gradients",
                                                                                 "optimizer_state"))
              + sum(len(root[k]) for m in meta["modules"] for root in m["roots"] for k in MODULE_KINDS)}
    parts = {k: len(sidecar_json_bytes(meta[k])) for k in ("tensors", "modules")}
    return {"job": name, "optimizers": len(optimizers), "parameter_tensors": sum(
        len(o.param_groups[0]["params"]) for o in optimizers), **counts, "sidecar_bytes": len(data), "one_number_a_line_bytes": len(indented),
        "before_issue54_bytes": old_bytes,
        "tensors_bytes": parts["tensors"], "modules_bytes": parts["modules"], "ranks": RANKS,
        "total_bytes_512_ranks": len(data) * RANKS}


def gc_pass(objects: int) -> dict:
    """Time :func:`module_roots` over ``gc.get_objects()`` with ``objects`` extra Python objects alive."""
    import torch

    ballast = [[i] for i in range(objects)]  # lists: tracked by the collector (a dict of atomic values is not)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(700)])
    t0 = time.perf_counter()
    objs = gc.get_objects()
    roots = module_roots(objs, torch.nn.Module)
    n = len(objs)
    del objs
    took = time.perf_counter() - t0
    assert any(r is model for r in roots)
    del ballast
    return {"gc_objects": n, "module_roots_s": round(took, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=5_000_000)
    p.add_argument("--json")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in JOBS.items():
            rows.append(job_sidecar(name, spec, tmp))
        rows.append(gan_sidecar(tmp))
    print("| job | optimizers | trained tensors | storages noted | sidecar, one rank | of which tensors / modules | "
          f"{RANKS} ranks | one number a line | before issue 54 (no modules, one number a line) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['job']} | {r['optimizers']} | {r['parameter_tensors']:,} | {r['storages_noted']:,} | "
              f"{r['sidecar_bytes'] / 1e6:.2f} MB | {r['tensors_bytes'] / 1e6:.2f} / {r['modules_bytes'] / 1e6:.2f} MB | "
              f"{r['total_bytes_512_ranks'] / 1e9:.2f} GB | {r['one_number_a_line_bytes'] / 1e6:.2f} MB | "
              f"{r['before_issue54_bytes'] / 1e6:.2f} MB |")
    g = gc_pass(a.objects)
    print(f"\nthe gc pass: {g['gc_objects']:,} objects, module_roots {g['module_roots_s']} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"jobs": rows, "gc_pass": g, "python": sys.version.split()[0]}, f, indent=1)


if __name__ == "__main__":
    main()
