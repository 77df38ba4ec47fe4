"""Jobs of the kinds issue 36 names, recorded the way their users record them: a plain
``torch.cuda.memory._record_memory_history(max_entries=100000)`` call and ``_dump_snapshot`` at the end, no
oomdoctor in the job (``--record late`` starts recording after set-up, as a call placed after ``model.cuda()``
does). Each job measures its own ground truth (``scenarios/_truth.py``) and notes the bytes of what it holds
besides the model (a dataset, a cache, an EMA copy, a teacher).

    python scenarios/new_kinds.py --kind ema --size small --snapshot OUT.pickle --ground-truth GT.json

Kinds (``--size small|large`` changes the model's width and depth, so each kind has two runs):

- ``compiled-step``: AdamW whose ``step()`` is ``torch.compile``-d, as PyTorch's recipe "Compiling the optimizer"
  does; a decoder LM, bf16 autocast.
- ``late-record``: GPT-2 (transformers) and AdamW built and moved to the GPU before recording starts.
- ``gpu-dataset``: the whole token dataset moved to the GPU in ``Dataset.__init__``; batches are slices of it.
- ``chunked-loss``: the LM head and cross-entropy computed in 4 chunks of the sequence, each upcast to fp32 alone
  (torchtune's ``CEWithChunkedOutputLoss``), one backward: one micro-batch, no pipeline. (The first version
  checkpointed each chunk with ``use_reentrant=False``; under ``_record_memory_history`` on torch 2.11 its backward
  failed with ``SystemError: run_backward returned NULL without setting an exception``.)
- ``static-kv``: gpt-fast-style inference: a KV cache made in each attention module's ``__init__``
  (``register_buffer``), a prefill, then one token at a time under ``torch.no_grad()``.
- ``ema``: training with an exponential moving average of the weights (a second copy, updated after each step).
- ``teacher``: distillation: a frozen bf16 teacher on the GPU, a student trained on its logits (KL divergence).
- ``fsdp2-tp``: 4 GPUs as a 2 x 2 mesh: tensor parallel inside a pair (DTensor ``parallelize_module``), FSDP2
  ``fully_shard`` across pairs; run it under ``torchrun --nproc_per_node=4``; one snapshot per rank
  (``{rank}`` in ``--snapshot``).

``--cpu`` is a tiny dry run without a GPU (no recording), to check the script.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from _truth import GroundTruth

KINDS = ("compiled-step", "late-record", "gpu-dataset", "chunked-loss", "static-kv", "ema", "teacher", "fsdp2-tp")
SIZES = {"small": dict(d=768, layers=6, heads=12), "large": dict(d=1280, layers=10, heads=20)}
VOCAB = 32000


class Block(nn.Module):
    """A pre-norm decoder block with its own attention (SDPA, causal) and a 4x MLP."""

    def __init__(self, d: int, heads: int, kv_cache: tuple[int, int] | None = None):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)
        if kv_cache is not None:  # gpt-fast: the cache is made with the module, on its device
            batch, max_seq = kv_cache
            shape = (batch, heads, max_seq, d // heads)
            self.register_buffer("k_cache", torch.zeros(shape, dtype=torch.bfloat16), persistent=False)
            self.register_buffer("v_cache", torch.zeros(shape, dtype=torch.bfloat16), persistent=False)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        return x.view(b, s, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, pos: int | None = None) -> torch.Tensor:
        h = self.n1(x)
        q, k, v = self._split(self.wq(h)), self._split(self.wk(h)), self._split(self.wv(h))
        if pos is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = x.shape[1]
            self.k_cache[:, :, pos:pos + s] = k
            self.v_cache[:, :, pos:pos + s] = v
            k, v = self.k_cache[:, :, :pos + s], self.v_cache[:, :, :pos + s]
            a = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1)
        x = x + self.wo(a.transpose(1, 2).flatten(2))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class LM(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, kv_cache: tuple[int, int] | None = None):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv_cache) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def hidden(self, ids: torch.Tensor, pos: int | None = None) -> torch.Tensor:
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x, pos)
        return self.norm(x)

    def forward(self, ids: torch.Tensor, pos: int | None = None) -> torch.Tensor:
        return self.head(self.hidden(ids, pos))


def _bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in tensors}.values())


class GPUTokens(torch.utils.data.Dataset):
    """A token dataset that lives on the GPU: moved there once, in ``__init__``."""

    def __init__(self, n: int, seq: int, device: torch.device):
        g = torch.Generator().manual_seed(1)
        self.data = torch.randint(0, VOCAB, (n, seq), generator=g).to(device)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i):
        return self.data[i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--size", choices=tuple(SIZES), default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--record", choices=("start", "late", "none"), default="start",
                   help="start: before the model is built; late: after set-up; none: not here (oomdoctor run)")
    p.add_argument("--snapshot")
    p.add_argument("--ground-truth")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--keep-logits-rank", type=int, default=None,
                   help="fsdp2-tp: this rank keeps every step's logits (a debug list, the fault of issue 39: one "
                        "data-parallel replica holding extra tensors, growing step after step)")
    a = p.parse_args()
    if a.kind == "late-record":
        a.record = "late"
    cpu = a.cpu
    rank = int(os.environ.get("RANK", "0"))
    record = (not cpu) and a.record != "none"
    if record and a.record == "start":
        torch.cuda.memory._record_memory_history(max_entries=100000)
    shape = dict(SIZES[a.size])
    if cpu:
        shape = dict(d=64, layers=2, heads=4)
        a.batch, a.seq, a.steps = 2, 32, 2
    if a.kind == "fsdp2-tp":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        torch.distributed.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu" if cpu else "cuda")
    amp = torch.autocast("cpu" if cpu else "cuda", dtype=torch.bfloat16)
    torch.manual_seed(0)
    truth = GroundTruth(None if cpu else a.ground_truth, kind=a.kind, size=a.size, batch=a.batch, seq=a.seq,
                        steps=a.steps, record=a.record, framework="plain", **shape)
    if cpu:  # the dry run measures nothing
        truth._pre = truth._post = lambda *args: None
    if a.kind != "compiled-step":  # Dynamo would trace into global hooks: that job measures around its step
        truth.install()
    g = torch.Generator().manual_seed(0)
    t0 = time.time()

    def tokens(batch: int, seq: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (batch, seq), generator=g).to(dev)

    try:
        if a.kind == "static-kv":
            _static_kv(a, shape, dev, truth, record, tokens)
        elif a.kind == "teacher":
            _teacher(a, shape, dev, amp, truth, record, tokens)
        elif a.kind == "fsdp2-tp":
            _fsdp2_tp(a, shape, dev, amp, truth, record, tokens)
        else:
            _train(a, shape, dev, amp, truth, record, tokens)
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        truth.note(seconds=round(time.time() - t0, 2))
        if not cpu:
            truth.write()
        if record and a.snapshot:
            torch.cuda.memory._dump_snapshot(a.snapshot.replace("{rank}", str(rank)))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def _train(a, shape, dev, amp, truth, record, tokens) -> None:
    if a.kind == "late-record":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_embd=shape["d"], n_layer=shape["layers"], n_head=shape["heads"], vocab_size=VOCAB,
                         n_positions=a.seq)
        model = GPT2LMHeadModel(cfg).to(dev)
    else:
        model = LM(**shape).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = None
    if a.kind == "gpu-dataset":
        data = GPUTokens(a.batch * a.steps if a.cpu else 65536, a.seq, dev)  # 512 MiB of int64 at seq 1024
        truth.note(dataset_bytes=_bytes([data.data]))
    ema = None
    if a.kind == "ema":
        ema = [p.detach().clone() for p in model.parameters()]
        truth.note(ema_bytes=_bytes(ema))
    step_fn = opt.step
    if a.kind == "compiled-step":
        compiled = torch.compile(opt.step, fullgraph=False)

        def step_fn():
            truth.before_step(opt)
            compiled()
            truth.after_step(opt)
    if record and a.record == "late":
        torch.cuda.memory._record_memory_history(max_entries=100000)
    for i in range(a.steps):
        if data is not None:
            ids = data.data[i * a.batch:(i + 1) * a.batch]
        else:
            ids = tokens(a.batch, a.seq)
        with amp:
            if a.kind == "late-record":
                loss = model(input_ids=ids, labels=ids).loss
            elif a.kind == "chunked-loss":  # torchtune's CEWithChunkedOutputLoss: 4 chunks, each upcast alone
                h = model.hidden(ids)
                loss = sum(_chunk_loss(model.head, hc, ic) for hc, ic in zip(h.chunk(4, dim=1), ids.chunk(4, dim=1)))
                loss = loss / 4
            else:
                logits = model(ids)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
        loss.backward()
        step_fn()
        opt.zero_grad(set_to_none=True)
        if ema is not None:
            with torch.no_grad():
                torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 0.001)


def _chunk_loss(head: nn.Module, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h).flatten(0, 1).float(), ids.flatten())


def _teacher(a, shape, dev, amp, truth, record, tokens) -> None:
    big = dict(d=shape["d"] * 2, layers=shape["layers"], heads=shape["heads"])
    teacher = LM(**big).to(dev, torch.bfloat16).eval().requires_grad_(False)
    truth.note(teacher_bytes=_bytes(list(teacher.parameters())))
    student = LM(**shape).to(dev)
    truth.model = None
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    for _ in range(a.steps):
        ids = tokens(a.batch, a.seq)
        with torch.no_grad():
            t_logits = teacher(ids)
        with amp:
            s_logits = student(ids)
        loss = F.kl_div(F.log_softmax(s_logits.float(), -1), F.log_softmax(t_logits.float(), -1),
                        log_target=True, reduction="batchmean")
        del t_logits
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _static_kv(a, shape, dev, truth, record, tokens) -> None:
    batch, prompt, new = a.batch * 4, a.seq, 256 if not a.cpu else 4
    with torch.device(dev):
        model = LM(**shape, kv_cache=(batch, prompt + new)).to(torch.bfloat16).eval()
    truth.count_model(model) if not a.cpu else None
    truth.note(kv_cache_bytes=_bytes([b for n, b in model.named_buffers() if "cache" in n]),
               batch=batch, prompt=prompt, new_tokens=new, framework="gpt-fast-style")
    with torch.no_grad():
        ids = tokens(batch, prompt)
        logits = model(ids, pos=0)
        nxt = logits[:, -1:].argmax(-1)
        for i in range(new - 1):
            logits = model(nxt, pos=prompt + i)
            nxt = logits[:, -1:].argmax(-1)


def _fsdp2_tp(a, shape, dev, amp, truth, record, tokens) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    model = LM(**shape).to(dev)
    for blk in model.blocks:
        blk.heads //= 2  # each TP rank holds half the heads
        parallelize_module(blk, mesh["tp"], {"wq": ColwiseParallel(), "wk": ColwiseParallel(),
                                            "wv": ColwiseParallel(), "wo": RowwiseParallel(),
                                            "up": ColwiseParallel(), "down": RowwiseParallel()})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    truth.model = model
    dp_rank = mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(dp_rank)
    kept: list[torch.Tensor] = []
    faulty = a.keep_logits_rank is not None and a.keep_logits_rank == torch.distributed.get_rank()
    for _ in range(a.steps):
        ids = torch.randint(0, VOCAB, (a.batch, a.seq), generator=gen).to(dev)
        logits = model(ids)
        if faulty:
            kept.append(logits.detach())
            truth.note(kept_logits_bytes=_bytes(kept))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
