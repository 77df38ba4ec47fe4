"""A ViT training script with knobs, for ``oomdoctor tune -- python benchmarks/tune_jobs/vit_train.py --bs {mb} --ga {ga}
--ac {ac}`` (benchmarks/device/round14_tune.sh): torchvision's ViT-B/16, random weights, random 224 x 224 images and
1000 labels, bf16 autocast, fused AdamW, ``--ga`` micro-batches per optimizer step; ``--ac full`` checkpoints every
encoder block (non-reentrant). Trains until stopped (``oomdoctor tune``'s runs stop it after their steps)."""

import argparse

import torch
import torch.nn.functional as F
import torchvision
from torch.utils.checkpoint import checkpoint

p = argparse.ArgumentParser()
p.add_argument("--bs", type=int, required=True)
p.add_argument("--ga", type=int, default=1)
p.add_argument("--ac", default="none", choices=["none", "full"])
p.add_argument("--model", default="vit_b_16")
p.add_argument("--image", type=int, default=224)
p.add_argument("--steps", type=int, default=1_000_000)
a = p.parse_args()

torch.manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: the driver's smoke test only


@torch.no_grad()
def normal_init(t, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
    """torch >= 2.12's trunc_normal_ reads a value (``if not mask.any()``), which preflight's fake tensors have none
    of: a normal init instead (the weights' values do not change the step's memory or speed)."""
    return t.normal_(mean, std)


torch.nn.init.trunc_normal_ = normal_init
model = getattr(torchvision.models, a.model)(weights=None, image_size=a.image).to(dev)
if a.ac == "full":
    for block in model.encoder.layers:
        f = block.forward
        block.forward = lambda x, f=f: checkpoint(f, x, use_reentrant=False)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
for step in range(a.steps):
    for _ in range(a.ga):
        x = torch.randn(a.bs, 3, a.image, a.image, device=dev)
        y = torch.randint(0, 1000, (a.bs,), device=dev)
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), y) / a.ga
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
