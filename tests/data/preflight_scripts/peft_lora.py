"""PEFT LoRA on a causal LM with gradient checkpointing (non-reentrant by default here, reentrant with
--reentrant), a plain loop with bf16 autocast and AdamW over the adapters only."""
import argparse

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=4)
p.add_argument("--seq", type=int, default=128)
p.add_argument("--reentrant", action="store_true")
a = p.parse_args()

model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=a.seq))
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": a.reentrant})
model.enable_input_require_grads()
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"],
                                         lora_dropout=0.05, task_type="CAUSAL_LM"))
model.print_trainable_parameters()
model.cuda().train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
for step in range(50):
    ids = torch.randint(0, 1000, (a.batch, a.seq), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step % 10 == 0:
        print(step, loss.item())
