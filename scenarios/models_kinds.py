"""Jobs that hold more than one set of weights (issue 54), each measuring its own ground truth, for the corpus.

Run each under ``oomdoctor run`` (no recording code here; ``benchmarks/device/round14_models.sh`` runs them all):

    oomdoctor run --out DIR -- python scenarios/models_kinds.py --kind gan --ground-truth DIR/ground_truth.json

Kinds (``docs/corpus/issue54_split.json`` says which half each run is in; the split was committed first):

- ``gan``: a generator and a discriminator (MLPs on 64 x 64 images), two AdamW optimizers; the discriminator steps
  first, then the generator, whose loss's backward also fills the discriminator's ``.grad``.
- ``ema``: diffusers' ``EMAModel`` over a small ``UNet2DModel`` (noise prediction, DDPM noise), built on the host,
  moved with ``.to(device)`` and stepped after every update (``--ema-impl standin`` or a missing diffusers: a
  stand-in written after diffusers 0.42.1's ``EMAModel``: ``shadow_params`` cloned on the host, ``to()`` moves
  them, ``step()`` updates them in place; ``ema_impl`` in the truth says which ran).
- ``moco``: MoCo v2: a query encoder, a key encoder made by ``copy.deepcopy`` and updated by EMA with no gradient,
  and a 512 MiB queue of keys registered as a buffer; SGD with momentum.
- ``lora``: PEFT LoRA (r=16, q/k/v/o) on a frozen fp32 Llama-shaped transformers model; the input embeddings made
  to require gradients (``enable_input_require_grads``, what PEFT's k-bit preparation and gradient checkpointing
  set up), so the engine accumulates a ``.grad`` of the embeddings' output, a batch-sized leaf that is no
  parameter's.
- ``distill``: a frozen bf16 teacher (twice the student's width) and a student trained on its logits (KL).
- ``qlora``: QLoRA-style: int8 frozen base weights (``nn.Parameter``, ``requires_grad=False``) with bf16 per-row
  scales (buffers), dequantized in forward, hand-written fp32 LoRA adapters, AdamW on the adapters only.
- ``rl-ref``: a policy LM with a value head and a reference model ``copy.deepcopy(policy)`` frozen; a
  policy-gradient loss with a KL penalty against the reference.
- ``buffers``: a model with large registered buffers: rotary cos/sin tables, a causal mask, BatchNorm statistics.

Every job writes ``ground_truth.json`` (:class:`_truth.EveryOptimizerTruth`): parameters, gradients and optimizer
state of every optimizer, and what it holds besides (``held``: frozen or copied weights, buffers, with the category
the accounting should give them). ``--cpu`` is a tiny dry run on the host that measures nothing.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from _truth import EveryOptimizerTruth

KINDS = ("gan", "ema", "moco", "lora", "distill", "qlora", "rl-ref", "buffers")
VOCAB = 32000


class Block(nn.Module):
    """A pre-norm decoder block (SDPA, causal) with a 4x MLP; ``rope``: rotary tables the model shares."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        return x.view(b, s, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.n1(x)
        q, k, v = self._split(self.wq(h)), self._split(self.wk(h)), self._split(self.wv(h))
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        if mask is not None:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).flatten(2))
        return x + self.down(F.gelu(self.up(self.n2(x))))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    s = x.shape[-2]
    x1, x2 = x.chunk(2, dim=-1)
    c, n = cos[:s].to(x.dtype), sin[:s].to(x.dtype)
    return torch.cat((x1 * c - x2 * n, x1 * n + x2 * c), dim=-1)


class LM(nn.Module):
    def __init__(self, d: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x)
        return self.norm(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(ids))


def _tensors(module: nn.Module, what: str = "parameters") -> list[torch.Tensor]:
    return list(module.parameters() if what == "parameters" else module.buffers())


# ---- the kinds ---------------------------------------------------------------------------------------------


def gan(a, dev, truth) -> None:
    img, z_dim = (3 * 64 * 64, 128) if not a.cpu else (3 * 8 * 8, 16)
    width = 2048 if not a.cpu else 32
    gen = nn.Sequential(nn.Linear(z_dim, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                        nn.Linear(width, img), nn.Tanh()).to(dev)
    disc = nn.Sequential(nn.Linear(img, width // 2), nn.LeakyReLU(0.2), nn.Linear(width // 2, width // 2),
                         nn.LeakyReLU(0.2), nn.Linear(width // 2, 1)).to(dev)
    opt_d = torch.optim.AdamW(disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.AdamW(gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    for _ in range(a.steps):
        real = torch.rand(a.batch, img, device=dev) * 2 - 1
        z = torch.randn(a.batch, z_dim, device=dev)
        fake = gen(z)
        opt_d.zero_grad(set_to_none=True)
        loss_d = bce(disc(real), torch.ones(a.batch, 1, device=dev)) + \
            bce(disc(fake.detach()), torch.zeros(a.batch, 1, device=dev))
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad(set_to_none=True)
        loss_g = bce(disc(fake), torch.ones(a.batch, 1, device=dev))
        loss_g.backward()  # also fills the discriminator's .grad, kept until its next zero_grad
        opt_g.step()
    truth.note(generator_parameters_bytes=sum(p.numel() * p.element_size() for p in gen.parameters()),
               discriminator_parameters_bytes=sum(p.numel() * p.element_size() for p in disc.parameters()))


class StandInEMA:
    """diffusers 0.42.1 ``training_utils.EMAModel``'s memory behaviour (``__init__``, ``to``, ``step``), for a
    machine without diffusers: the shadow parameters are cloned where the parameters are, moved by ``to()``, and
    updated in place by ``step()`` with the same decay schedule (``get_decay`` with ``use_ema_warmup=False``)."""

    def __init__(self, parameters, decay: float = 0.9999) -> None:
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.decay, self.optimization_step = decay, 0

    def to(self, device=None, dtype=None, non_blocking: bool = False) -> None:
        self.shadow_params = [p.to(device=device, dtype=dtype, non_blocking=non_blocking) if p.is_floating_point()
                              else p.to(device=device, non_blocking=non_blocking) for p in self.shadow_params]

    @torch.no_grad()
    def step(self, parameters) -> None:
        self.optimization_step += 1
        step = max(0, self.optimization_step - 1)
        decay = 0.0 if step <= 0 else min((1 + step) / (10 + step), self.decay)
        for s, p in zip(self.shadow_params, parameters):
            if p.requires_grad:
                s.sub_((1 - decay) * (s - p))
            else:
                s.copy_(p)


class SmallUNetStandIn(nn.Module):
    """A small convolutional noise predictor (down, middle, up, skip), used with the stand-in EMA."""

    def __init__(self, ch: int = 64) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        self.down = nn.Sequential(nn.Conv2d(ch, 2 * ch, 3, stride=2, padding=1), nn.GroupNorm(8, 2 * ch), nn.SiLU(),
                                  nn.Conv2d(2 * ch, 4 * ch, 3, stride=2, padding=1), nn.GroupNorm(8, 4 * ch), nn.SiLU())
        self.mid = nn.Sequential(nn.Conv2d(4 * ch, 4 * ch, 3, padding=1), nn.GroupNorm(8, 4 * ch), nn.SiLU())
        self.up = nn.Sequential(nn.ConvTranspose2d(4 * ch, 2 * ch, 4, stride=2, padding=1), nn.SiLU(),
                                nn.ConvTranspose2d(2 * ch, ch, 4, stride=2, padding=1), nn.SiLU())
        self.out = nn.Conv2d(2 * ch, 3, 3, padding=1)
        self.t = nn.Linear(1, 4 * ch)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h0 = self.inp(x)
        h = self.mid(self.down(h0) + self.t(t.float()[:, None] / 1000)[:, :, None, None])
        return self.out(torch.cat((self.up(h), h0), dim=1))


def ema(a, dev, truth) -> None:
    impl = a.ema_impl
    unet = ema_cls = None
    if impl == "diffusers":
        try:
            import diffusers
            from diffusers import UNet2DModel
            from diffusers.training_utils import EMAModel as ema_cls

            chans = (128, 256, 256, 512) if not a.cpu else (32, 32, 32, 32)
            unet = UNet2DModel(sample_size=32 if not a.cpu else 8, in_channels=3, out_channels=3, layers_per_block=2,
                               block_out_channels=chans, norm_num_groups=32,
                               down_block_types=("DownBlock2D",) * 4, up_block_types=("UpBlock2D",) * 4)
            impl = f"diffusers {diffusers.__version__}"
        except Exception as e:  # noqa: BLE001 - diffusers missing or broken on this machine: the stand-in
            print(f"diffusers unavailable ({type(e).__name__}: {str(e)[:200]}): using the stand-in", flush=True)
            impl = "standin"
    if unet is None:
        unet, ema_cls = SmallUNetStandIn(128 if not a.cpu else 8), StandInEMA
        impl = "standin" if impl == "standin" else impl
    truth.note(ema_impl=impl)
    ema_model = ema_cls(unet.parameters())  # on the host, as diffusers' training scripts build it
    unet.to(dev)
    ema_model.to(dev)
    truth.hold("ema_shadow_params", ema_model.shadow_params, "weight_copy")
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4, weight_decay=1e-2)
    size = 32 if not a.cpu else 8
    for _ in range(a.steps):
        x0 = torch.rand(a.batch, 3, size, size, device=dev) * 2 - 1
        noise = torch.randn_like(x0)
        t = torch.randint(0, 1000, (a.batch,), device=dev)
        alpha = torch.cos(t.float() / 1000 * math.pi / 2)[:, None, None, None]
        noisy = alpha * x0 + (1 - alpha ** 2).sqrt() * noise
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = unet(noisy, t)
            pred = out.sample if hasattr(out, "sample") else out
        loss = F.mse_loss(pred.float(), noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema_model.step(unet.parameters())


class MoCo(nn.Module):
    """MoCo v2 (He et al. 2020; facebookresearch/moco ``builder.py``): the key encoder is a copy of the query
    encoder updated by momentum, never by gradients; the queue of keys is a registered buffer."""

    def __init__(self, dim: int, queue: int, width: int, inp: int) -> None:
        super().__init__()
        self.encoder_q = nn.Sequential(nn.Linear(inp, width), nn.BatchNorm1d(width), nn.ReLU(),
                                       nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, dim))
        self.encoder_k = copy.deepcopy(self.encoder_q)
        for p in self.encoder_k.parameters():
            p.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, queue), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))
        self.m, self.t = 0.999, 0.2

    @torch.no_grad()
    def _momentum_update(self) -> None:
        for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            pk.mul_(self.m).add_(pq.detach(), alpha=1 - self.m)

    @torch.no_grad()
    def _enqueue(self, keys: torch.Tensor) -> None:
        n, ptr = keys.shape[0], int(self.queue_ptr)
        self.queue[:, ptr:ptr + n] = keys.T
        self.queue_ptr[0] = (ptr + n) % self.queue.shape[1]

    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update()
            k = F.normalize(self.encoder_k(im_k), dim=1)
        pos = (q * k).sum(1, keepdim=True)
        neg = q @ self.queue.clone().detach()
        logits = torch.cat((pos, neg), dim=1) / self.t
        self._enqueue(k)
        return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))


def moco(a, dev, truth) -> None:
    dim, queue, width, inp = (128, 1 << 20, 2048, 3 * 32 * 32) if not a.cpu else (8, 64, 16, 12)
    model = MoCo(dim, queue, width, inp).to(dev)
    truth.hold("key_encoder", _tensors(model.encoder_k), "weight_copy")
    truth.hold("key_encoder_bn_statistics", _tensors(model.encoder_k, "buffers"), "buffers")
    truth.hold("query_encoder_bn_statistics", _tensors(model.encoder_q, "buffers"), "buffers")
    truth.hold("queue", [model.queue, model.queue_ptr], "buffers")
    opt = torch.optim.SGD(model.encoder_q.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    for _ in range(a.steps):
        x = torch.rand(a.batch, inp, device=dev)
        loss = model(x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def lora(a, dev, truth) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    d, layers = (2048, 4) if not a.cpu else (64, 2)
    cfg = LlamaConfig(hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers, num_attention_heads=16 if
                      not a.cpu else 4, num_key_value_heads=16 if not a.cpu else 4, vocab_size=VOCAB,
                      max_position_embeddings=a.seq)
    base = LlamaForCausalLM(cfg).to(dev)
    base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                   "o_proj"], lora_dropout=0.0))
    truth.hold("frozen_base", [p for p in model.parameters() if not p.requires_grad], "weight_copy")
    truth.hold("rotary_inv_freq", list(model.buffers()), "buffers")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for _ in range(a.steps):
        ids = torch.randint(0, VOCAB, (a.batch, a.seq), device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def distill(a, dev, truth) -> None:
    d, layers, heads = (768, 6, 12) if not a.cpu else (32, 1, 4)
    teacher = LM(2 * d, layers, heads).to(dev, torch.bfloat16).eval().requires_grad_(False)
    truth.hold("teacher", _tensors(teacher), "weight_copy")
    student = LM(d, layers, heads).to(dev)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    for _ in range(a.steps):
        ids = torch.randint(0, VOCAB, (a.batch, a.seq), device=dev)
        with torch.no_grad():
            t_logits = teacher(ids)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            s_logits = student(ids)
        loss = F.kl_div(F.log_softmax(s_logits.float(), -1), F.log_softmax(t_logits.float(), -1), log_target=True,
                        reduction="batchmean")
        del t_logits
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


class QLoRALinear(nn.Module):
    """A frozen int8 weight with bf16 per-row scales (QLoRA's frozen quantised base, 8-bit here) and trainable
    fp32 LoRA factors: ``y = x (q * s)^T + (alpha / r) x A^T B^T``."""

    def __init__(self, d_in: int, d_out: int, r: int = 16, alpha: int = 32) -> None:
        super().__init__()
        w = torch.randn(d_out, d_in) / math.sqrt(d_in)
        scale = w.abs().amax(dim=1) / 127
        self.qweight = nn.Parameter(torch.round(w / scale[:, None]).to(torch.int8), requires_grad=False)
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.lora_a = nn.Parameter(torch.randn(r, d_in) / math.sqrt(d_in))
        self.lora_b = nn.Parameter(torch.zeros(d_out, r))
        self.s = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.qweight.to(torch.bfloat16) * self.scale[:, None]
        return F.linear(x, w.to(x.dtype)) + F.linear(F.linear(x, self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype)) \
            * self.s


class QLoRAModel(nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d).to(torch.bfloat16).requires_grad_(False)
        self.layers = nn.ModuleList(nn.ModuleDict({"qkv": QLoRALinear(d, 3 * d), "o": QLoRALinear(d, d),
                                                   "up": QLoRALinear(d, 4 * d), "down": QLoRALinear(4 * d, d)})
                                    for _ in range(layers))
        self.head = nn.Linear(d, VOCAB, bias=False).to(torch.bfloat16).requires_grad_(False)
        self.heads = 16

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        b, s, d = x.shape
        for blk in self.layers:
            q, k, v = blk["qkv"](F.rms_norm(x, (d,))).view(b, s, 3, self.heads, d // self.heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + blk["o"](a.transpose(1, 2).flatten(2))
            x = x + blk["down"](F.gelu(blk["up"](F.rms_norm(x, (d,)))))
        return self.head(F.rms_norm(x, (d,)))


def qlora(a, dev, truth) -> None:
    d, layers = (2048, 6) if not a.cpu else (64, 1)
    model = QLoRAModel(d, layers).to(dev)
    truth.hold("frozen_base", [p for p in model.parameters() if not p.requires_grad], "weight_copy")
    truth.hold("scales", _tensors(model, "buffers"), "buffers")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for _ in range(a.steps):
        ids = torch.randint(0, VOCAB, (a.batch, a.seq), device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


class Policy(nn.Module):
    def __init__(self, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.lm = LM(d, layers, heads)
        self.value = nn.Linear(d, 1)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lm.hidden(ids)
        return self.lm.head(h), self.value(h).squeeze(-1)


def rl_ref(a, dev, truth) -> None:
    d, layers, heads = (1024, 6, 16) if not a.cpu else (32, 1, 4)
    policy = Policy(d, layers, heads).to(dev)
    ref = copy.deepcopy(policy.lm).eval().requires_grad_(False)  # the reference model: the policy at its start
    truth.hold("reference_model", _tensors(ref), "weight_copy")
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    for _ in range(a.steps):
        ids = torch.randint(0, VOCAB, (a.batch, a.seq), device=dev)
        reward = torch.randn(a.batch, device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits, values = policy(ids)
            with torch.no_grad():
                ref_logits = ref(ids)
        logp = F.log_softmax(logits.float(), -1)
        act = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        kl = (logp.exp() * (logp - F.log_softmax(ref_logits.float(), -1))).sum(-1).mean()
        adv = (reward[:, None] - values[:, :-1].float()).detach()
        loss = -(act * adv).mean() + 0.1 * kl + F.mse_loss(values[:, :-1].float(), reward[:, None].expand_as(adv))
        del ref_logits
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


class BufferedLM(nn.Module):
    """A decoder with large registered buffers: rotary cos/sin tables for 131,072 positions, a 8,192 x 8,192 causal
    mask (bool), and BatchNorm over the embeddings (running mean and variance, a step counter)."""

    def __init__(self, d: int, layers: int, heads: int, max_pos: int, mask: int) -> None:
        super().__init__()
        self.lm = LM(d, layers, heads)
        half = d // heads // 2
        inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        ang = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
        self.register_buffer("cos", ang.cos())
        self.register_buffer("sin", ang.sin())
        self.register_buffer("mask", torch.ones(mask, mask, dtype=torch.bool).tril())
        self.bn = nn.BatchNorm1d(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        x = self.bn(self.lm.tok(ids).transpose(1, 2)).transpose(1, 2)
        for b in self.lm.blocks:
            x = b(x, rope=(self.cos, self.sin), mask=self.mask[:s, :s])
        return self.lm.head(self.lm.norm(x))


def buffers(a, dev, truth) -> None:
    d, layers, heads, max_pos, mask = (1024, 6, 16, 131072, 8192) if not a.cpu else (32, 1, 4, 64, 64)
    model = BufferedLM(d, layers, heads, max_pos, mask).to(dev)
    truth.hold("registered_buffers", _tensors(model, "buffers"), "buffers")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(a.steps):
        ids = torch.randint(0, VOCAB, (a.batch, a.seq), device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


RUN = {"gan": gan, "ema": ema, "moco": moco, "lora": lora, "distill": distill, "qlora": qlora, "rl-ref": rl_ref,
       "buffers": buffers}
BATCH = {"gan": 256, "ema": 64, "moco": 256, "lora": 4, "distill": 8, "qlora": 4, "rl-ref": 8, "buffers": 4}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--batch", type=int, default=None, help="default: per kind (BATCH)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ema-impl", choices=("diffusers", "standin"), default="diffusers")
    p.add_argument("--ground-truth")
    p.add_argument("--cpu", action="store_true", help="a tiny dry run on the host; measures nothing")
    a = p.parse_args()
    a.batch = a.batch or BATCH[a.kind]
    if a.cpu:
        a.batch, a.seq, a.steps = 4, 16, 2
    dev = torch.device("cpu" if a.cpu else "cuda")
    torch.manual_seed(0)
    truth = EveryOptimizerTruth(None if a.cpu else a.ground_truth, kind=a.kind, batch=a.batch, seq=a.seq,
                                steps=a.steps, framework="plain")
    if a.cpu:
        truth._pre = truth._post = lambda *args: None
    truth.install()
    t0 = time.time()
    try:
        RUN[a.kind](a, dev, truth)
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        truth.note(seconds=round(time.time() - t0, 2), python=sys.version.split()[0],
                   peft=_version("peft"), diffusers=_version("diffusers"))
        if not a.cpu:
            truth.write()
            print(f"{a.kind}: truth written to {os.path.abspath(a.ground_truth)}", flush=True)


def _version(name: str) -> str | None:
    mod = sys.modules.get(name)
    return getattr(mod, "__version__", None) if mod is not None else None


if __name__ == "__main__":
    main()
