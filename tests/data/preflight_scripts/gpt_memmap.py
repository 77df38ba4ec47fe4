"""A minimal GPT trainer in the style of the small public ones: a numpy memmap of token ids sampled with
torch.randint on the host, pinned and moved per step; fp16 autocast with GradScaler (found_inf); loss.item()
logging; an evaluation of mean losses (.item() per batch) with early stopping on it; torch.backends flags."""
import argparse
import math
import os
import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--block", type=int, default=128)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--width", type=int, default=128)
p.add_argument("--dtype", default="float16")
p.add_argument("--iters", type=int, default=50)
p.add_argument("--patience", type=int, default=1)
p.add_argument("--fused", type=int, default=1)
a = p.parse_args()

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
torch.backends.cudnn.benchmark = True
device = "cuda" if torch.cuda.is_available() else "cpu"
vocab = 512
path = os.path.join(tempfile.gettempdir(), f"preflight_tokens_{os.getpid()}.bin")
np.random.randint(0, vocab, size=20_000, dtype=np.uint16).tofile(path)
data = np.memmap(path, dtype=np.uint16, mode="r")


def get_batch():
    ix = torch.randint(len(data) - a.block, (a.batch,))
    x = torch.stack([torch.from_numpy(data[i:i + a.block].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + a.block].astype(np.int64)) for i in ix])
    if device == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = 4

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, a.width), nn.Embedding(a.block, a.width)
        self.blocks = nn.ModuleList(Block(a.width) for _ in range(a.layers))
        self.ln, self.head = nn.LayerNorm(a.width), nn.Linear(a.width, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


model = GPT().to(device)
print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[a.dtype]
scaler = torch.amp.GradScaler("cuda", enabled=(a.dtype == "float16"))
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=bool(a.fused) and device == "cuda", foreach=False)
ctx = torch.autocast(device_type="cuda" if "cuda" in device else "cpu", dtype=ptdtype)


@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = torch.zeros(2)
    for k in range(2):
        x, y = get_batch()
        with ctx:
            _, loss = model(x, y)
        losses[k] = loss.item()
    model.train()
    return losses.mean()


best, bad = math.inf, 0
for it in range(a.iters):
    if it % 10 == 0 and it > 0:
        val = estimate_loss()
        if val < best:
            best, bad = val, 0
        else:
            bad += 1
            if bad > a.patience:
                print("early stop")
                break
    x, y = get_batch()
    with ctx:
        logits, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    print(f"iter {it}: loss {loss.item():.4f}")
os.remove(path)
