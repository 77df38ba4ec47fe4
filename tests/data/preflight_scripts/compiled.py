"""torch.compile on the model and on a loss function, as recent training scripts do."""
import torch

model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
model = torch.compile(model)
loss_fn = torch.compile(lambda out: out.float().pow(2).mean())
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
for step in range(10):
    x = torch.randn(64, 512, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_fn(model(x))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
