"""Batched generation with transformers' ``generate()``: the KV cache (``DynamicCache``) fills as tokens are
produced, as in offline inference or an RL rollout.

Nothing in it knows about oomdoctor (run it under ``oomdoctor run``)::

    python scenarios/generate_kv.py --model mha --batch 256 [--ground-truth FILE]

- ``--model mha``: a Llama-shaped model (random init, bf16): 32 layers, 1024 wide, 16 heads, every head
  with its own keys and values: 128 KiB of cache per token; greedy decoding.
- ``--model gqa``: 16 layers, 2048 wide, 32 query heads sharing 8 key/value heads (grouped-query
  attention): 64 KiB per token; sampling.

A prompt of ``--prompt`` random tokens per sequence, exactly ``--new-tokens`` generated (no early stop).
The job counts its cache: ``kv_cache_bytes`` = batch x (prompt + new - 1) x layers x 2 x kv heads x head
size x 2 bytes, what ``DynamicCache`` holds after the last step.
"""

from __future__ import annotations

import argparse

import torch
from _truth import GroundTruth
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {"mha": dict(num_hidden_layers=32, hidden_size=1024, num_attention_heads=16, num_key_value_heads=16,
                      intermediate_size=2816),
          "gqa": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=5632)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=tuple(SHAPES), default="mha")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--ground-truth")
    p.add_argument("--cpu", action="store_true", help="tiny dry run without a GPU")
    a = p.parse_args()
    dev = torch.device("cpu" if a.cpu else "cuda")
    shape = dict(SHAPES[a.model])
    if a.cpu:
        shape.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    cfg = LlamaConfig(vocab_size=32000, max_position_embeddings=a.prompt + a.new_tokens, **shape)
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    head = cfg.hidden_size // cfg.num_attention_heads
    kv = a.batch * (a.prompt + a.new_tokens - 1) * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head * 2
    truth = GroundTruth(a.ground_truth, batch=a.batch, prompt=a.prompt, new_tokens=a.new_tokens, model=a.model,
                        kv_cache_bytes=kv, kv_bytes_per_token=kv // (a.batch * (a.prompt + a.new_tokens - 1)),
                        framework="transformers.generate")
    if not a.cpu:
        truth.count_model(model)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt), generator=torch.Generator().manual_seed(0)).to(dev)
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens,
                             min_new_tokens=a.new_tokens, do_sample=a.model == "gqa", top_k=50, pad_token_id=0)
        truth.note(generated_tokens=int(out.shape[1] - a.prompt))
    except torch.OutOfMemoryError as e:
        truth.oom(e)
        raise
    finally:
        truth.write()


if __name__ == "__main__":
    main()
