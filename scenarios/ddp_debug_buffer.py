"""DDP training where rank 0 keeps tensors "for debugging".

A 6-layer LM (d=768, 50,257 vocabulary) under DDP, AdamW, bf16 autocast, batch 4 x 1024, 12 steps.
``debug-buffer``: rank 0 appends ``logits.detach()`` to a list every third step;
``clean``: it does not.
Expected: ``rank-imbalance`` naming rank 0 on debug-buffer; nothing of the kind on clean.
"""

import torch
from _common import LM, lm_loss, parser, setup, teardown
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    a = parser(("debug-buffer", "clean"), __doc__).parse_args()
    rank, world, dev = setup()
    model = DDP(LM(50257, 768, 6, heads=12).to(dev), device_ids=[dev.index])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    debug = []
    for i in range(12):
        ids = torch.randint(0, 50257, (4, 1024), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids)
        lm_loss(logits, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if a.variant == "debug-buffer" and rank == 0 and i % 3 == 0:
            debug.append(logits.detach())
        del logits
    teardown()


if __name__ == "__main__":
    main()
