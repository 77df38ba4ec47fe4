"""A step-to-step leak: accumulating the loss tensor keeps every step's autograd graph alive.

A 4-layer LM (d=1024, 32,000 vocabulary), AdamW, batch 4 x 1024, 10 steps, one process per GPU under
DDP. ``leak``: ``total = total + loss`` (the classic bug: each step's activations stay reachable);
``fixed``: ``total += loss.item()``.
Expected: ``memory-growth`` on leak (live memory grows every step); none on fixed.
"""

import torch
from _common import LM, lm_loss, parser, setup, teardown
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    a = parser(("leak", "fixed"), __doc__).parse_args()
    rank, world, dev = setup()
    model = DDP(LM(32000, 1024, 4).to(dev), device_ids=[dev.index])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    total = 0.0
    for _ in range(10):
        ids = torch.randint(0, 32000, (4, 1024), device=dev)
        loss = lm_loss(model(ids), ids)
        loss.backward(retain_graph=a.variant == "leak")
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = total + loss if a.variant == "leak" else total + loss.item()
        del loss
    print(f"rank {rank}: mean loss {float(total) / 10:.3f}", flush=True)
    teardown()


if __name__ == "__main__":
    main()
