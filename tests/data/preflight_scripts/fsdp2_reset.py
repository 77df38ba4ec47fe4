"""FSDP2 as pytorch/examples' FSDP2 example builds it: on the meta device, fully_shard per block, to_empty on the GPU,
then reset_parameters(), whose nn.init fills the DTensor shards at random; two AdamW steps. torchrun."""
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
torch.manual_seed(0)
with torch.device("meta"):
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 256), *[torch.nn.Linear(256, 256) for _ in range(4)],
                                torch.nn.Linear(256, 1000))
for layer in model:
    fully_shard(layer)
fully_shard(model)
model.to_empty(device="cuda")
for layer in model:
    layer.reset_parameters()  # kaiming_uniform_, uniform_, normal_ on the shards
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, 1000, (8, 64), device="cuda")
for _ in range(2):
    model(x).float().logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
