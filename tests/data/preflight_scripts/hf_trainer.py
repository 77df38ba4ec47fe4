"""A Hugging Face Trainer script as the examples write it: a causal LM from a config (random weights), a
Dataset of token ids, TrainingArguments with bf16 and logging every step (Trainer's RandomSampler draws
randperm().tolist(); the loss filter reads isnan/isinf; the log reads tr_loss.item())."""
import argparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--model_type", default="gpt2")
p.add_argument("--batch", type=int, default=4)
p.add_argument("--seq", type=int, default=128)
p.add_argument("--gradient_checkpointing", action="store_true")
p.add_argument("--output_dir", default="/tmp/preflight_trainer_out")
a = p.parse_args()

cfg = AutoConfig.for_model(a.model_type, n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=a.seq)
model = AutoModelForCausalLM.from_config(cfg)


class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        ids = torch.randint(0, cfg.vocab_size, (a.seq,))
        return {"input_ids": ids, "labels": ids.clone()}


args = TrainingArguments(output_dir=a.output_dir, per_device_train_batch_size=a.batch, max_steps=20, bf16=True,
                         logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0,
                         gradient_checkpointing=a.gradient_checkpointing, use_cpu=False)
Trainer(model=model, args=args, train_dataset=Ids()).train()
