"""Preflight's speed on a 1B-parameter script (issue 50, item 7: under 2 minutes on 2 CPUs, the time said in the
output).

    taskset -c 0,1 python benchmarks/preflight_speed.py [--layers 22] [--width 2048] [--json OUT.json]
        [--src NAME=PATH ...] [--rounds 1]

With ``--src`` (repeatable), each named oomdoctor source tree (``PATH`` first on ``PYTHONPATH``: main's code and a
branch's, side by side) is run in turn, ``--rounds`` times, interleaved (A B A B ...) so that the machine's load
falls on both alike; each row says the load average before it.

Writes a training script (a GPT of ``layers`` blocks of ``width``: 12·width² parameters a block plus the embeddings,
1.2 B at the defaults; bf16 autocast, fused AdamW, micro-batch 4 × 1024; built on the host and moved with
``.to("cuda")``, as most scripts do, or under ``with torch.device("cuda")`` with ``--on-device``), runs ``oomdoctor
preflight --format json -- python script.py`` in a fresh process and prints its wall time, the trace time it says
(``trace_wall_s``), the events and the peaks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = '''
import sys, torch, torch.nn as nn, torch.nn.functional as F
L, D, ON = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
V, S, B = 32000, 1024, 4

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.up, self.down = nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D, bias=False)
    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, 16, d // 16).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.n2(x))))

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))

if ON:
    with torch.device("cuda"):
        model = GPT()
else:
    model = GPT().to("cuda")
print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
for step in range(10):
    ids = torch.randint(0, V, (B, S)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(step, loss.item())
'''


def _one(f: Path, a: argparse.Namespace, src: str | None) -> dict:
    env = {**os.environ}
    if src:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (src, env.get("PYTHONPATH", "")) if x)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "oomdoctor", "preflight", "--gpu", "H100-80GB", "--format", "json",
                        "--", "python", str(f), str(a.layers), str(a.width), "1" if a.on_device else "0"],
                       capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if p.returncode:
        return {"error": p.stderr[-2000:], "wall_s": round(wall, 1)}
    out = json.loads(p.stdout)
    params = a.layers * 12 * a.width**2 + 2 * 32000 * a.width
    return {"parameters": params, "layers": a.layers, "width": a.width, "built": "cuda device" if a.on_device else
            "host, then .to('cuda')", "wall_s": round(wall, 1), "trace_wall_s": out["trace_wall_s"],
            "events": out["events"], "peak_allocated_bytes": out["peak_allocated_bytes"],
            "peak_reserved_bytes": out["peak_reserved_bytes"], "cpus": len(os.sched_getaffinity(0)),
            "load_before": round(load, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--on-device", action="store_true")
    ap.add_argument("--src", action="append", default=[], help="NAME=PATH of an oomdoctor src tree (repeatable)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    trees = [tuple(s.split("=", 1)) for s in a.src] or [("installed", None)]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "gpt1b.py"
        f.write_text(SCRIPT)
        for r in range(a.rounds):
            for name, src in trees:
                row = {"tree": name, "src": src, "round": r, **_one(f, a, src)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if any("error" in r for r in rows):
        return 1
    if a.json:
        Path(a.json).write_text(json.dumps(rows[0] if len(rows) == 1 else rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
