"""A trained vector scattered into a sparse delta weight every step (peft SHiRA's get_delta_weight: torch.sparse_coo_tensor
of fixed indices and the trained values), added to a dense weight; AdamW on the vector."""
import torch

torch.manual_seed(0)
dev = "cuda"
w = torch.nn.Parameter(torch.zeros(4096, device=dev))
idx = torch.randint(0, 512, (2, 4096), device=dev)
base = torch.randn(512, 512, device=dev)
opt = torch.optim.AdamW([w], lr=1e-3)
x = torch.randn(64, 512, device=dev)
for step in range(3):
    delta = torch.sparse_coo_tensor(idx, w * 2.0, (512, 512))
    y = x @ (base + delta).t()
    loss = y.square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(step, loss.item())
