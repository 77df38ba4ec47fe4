"""A T5 Trainer job (issue 50, item 4: the one preflight predicted 27% low): T5ForConditionalGeneration from a
config (random weights), a Dataset of token ids for inputs and labels, TrainingArguments as the job had them
(bf16 or fp16, AdamW, logging every step). The same script runs on the GPU (benchmarks/device/round14_t5.sh)."""
import argparse

import torch
from transformers import T5Config, T5ForConditionalGeneration, Trainer, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=4)
p.add_argument("--src", type=int, default=128)
p.add_argument("--tgt", type=int, default=64)
p.add_argument("--d_model", type=int, default=128)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--d_ff", type=int, default=512)
p.add_argument("--vocab", type=int, default=32128)
p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
p.add_argument("--steps", type=int, default=4)
p.add_argument("--output_dir", default="/tmp/preflight_t5_out")
a = p.parse_args()

cfg = T5Config(vocab_size=a.vocab, d_model=a.d_model, d_kv=a.d_model // a.heads, d_ff=a.d_ff, num_layers=a.layers,
               num_decoder_layers=a.layers, num_heads=a.heads, feed_forward_proj="relu", dropout_rate=0.1,
               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
model = T5ForConditionalGeneration(cfg)


class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        return {"input_ids": torch.randint(1, a.vocab, (a.src,)), "attention_mask": torch.ones(a.src, dtype=torch.long),
                "labels": torch.randint(1, a.vocab, (a.tgt,))}


args = TrainingArguments(output_dir=a.output_dir, per_device_train_batch_size=a.batch, max_steps=a.steps,
                         bf16=a.dtype == "bf16", fp16=a.dtype == "fp16", logging_steps=1, save_strategy="no",
                         report_to=[], dataloader_num_workers=0)
Trainer(model=model, args=args, train_dataset=Pairs()).train()
