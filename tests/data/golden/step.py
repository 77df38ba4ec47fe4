"""A tiny training step for the golden preflight output (tests/unit/test_golden_words.py): traced on the CPU."""
import torch

model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    loss = model(torch.randn(32, 256, device="cuda")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
