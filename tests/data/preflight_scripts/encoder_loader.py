"""A classifier on nn.TransformerEncoder: a Dataset read by a DataLoader with worker processes and pinned
memory; torch.accelerator for the device; CUDA streams and events around the step, a CUDA graph of the
evaluation; boolean-mask selection of the non-padded tokens; accuracy with (pred == y).sum().item(); an
evaluation in eval mode under no_grad (the encoder's fast path)."""
import argparse

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=16)
p.add_argument("--seq", type=int, default=64)
p.add_argument("--workers", type=int, default=2)
a = p.parse_args()

device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randint(1, 1000, (a.seq,), generator=g)
        n = int(torch.randint(a.seq // 2, a.seq + 1, (1,), generator=g))
        x[n:] = 0  # padding
        return x, torch.randint(0, 10, (), generator=g)


class Classifier(nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.emb = nn.Embedding(1000, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        pad = x == 0
        h = self.enc(self.emb(x), src_key_padding_mask=pad)
        h, _ = self.attn(h, h, h, key_padding_mask=pad, need_weights=False)
        tokens = h[~pad]  # the non-padded tokens (a data-dependent shape)
        return self.head(h.mean(1)), tokens.norm(dim=-1).mean()


model = Classifier().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(Tokens(), batch_size=a.batch, shuffle=True, num_workers=a.workers,
                                     pin_memory=True, persistent_workers=a.workers > 0)
stream = torch.cuda.Stream() if device.type == "cuda" else None
start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if stream else (None, None)
correct = seen = 0
for step, (x, y) in enumerate(loader):
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    if start is not None:
        start.record()
    logits, reg = model(x)
    loss = nn.functional.cross_entropy(logits, y) + 0.01 * reg
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if end is not None:
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
    correct += (logits.argmax(-1) == y).sum().item()
    seen += y.numel()
    print(f"step {step} loss {loss.item():.3f} acc {correct / seen:.3f}")
    if step % 5 == 0:
        model.eval()
        with torch.no_grad():
            if stream is not None:
                with torch.cuda.stream(stream):
                    model(x)
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = model(x)
                g.replay()
        model.train()
