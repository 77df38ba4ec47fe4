"""``framework="hf"``: the tensors a transformers model saves in eager PyTorch, per token, against the
blocks read at the peak of the corpus snapshots (docs/corpus/, docs/plan.md "Real training loops")."""

from __future__ import annotations

from dataclasses import replace

import pytest

from oomdoctor.cli.main import main
from oomdoctor.plan import hf
from oomdoctor.plan.estimate import estimate
from oomdoctor.plan.specs import PRESETS, ModelSpec, ParallelPlan, PlanError, TrainingSpec

GPT2 = PRESETS["gpt2"]
LLAMA = ModelSpec("llama-8x1024", 8, 1024, 2816, 16, 16, 32000, family="llama", activation="silu")
DDP_TRAINER = ParallelPlan(dp=2, dp_sharding="none", framework="hf", loop="trainer")


def test_gpt2_layer_under_each_precision_is_what_the_snapshots_hold():
    """Per token and layer, summed from the blocks alive at the peak (h 768, f 3072, 12 heads):
    Trainer DDP (autocast over fp32): 22h + 16f + 64 = 66,112; Trainer FSDP2 (bf16 weights, no
    autocast): 18h + 10f + 64 = 44,608; Lightning FSDP1 (bf16 weights and autocast, KV cache on):
    26h + 16f + 64 = 69,184."""
    ddp = hf.loop_settings(GPT2, DDP_TRAINER)
    assert (ddp.autocast, ddp.weight_bytes, ddp.use_cache) == (True, 4, False)
    assert hf.layer_bytes(GPT2, ddp, True) == (66_112, 0)
    fsdp2 = hf.loop_settings(GPT2, replace(DDP_TRAINER, dp_sharding="fsdp"))
    assert (fsdp2.autocast, fsdp2.weight_bytes) == (False, 2)
    assert hf.layer_bytes(GPT2, fsdp2, True) == (44_608, 0)
    lightning = hf.loop_settings(GPT2, replace(DDP_TRAINER, dp_sharding="fsdp", loop="lightning"))
    assert (lightning.autocast, lightning.weight_bytes, lightning.use_cache) == (True, 2, True)
    assert hf.layer_bytes(GPT2, lightning, True) == (69_184, 0)
    # without dropout the two 1-byte masks go
    assert hf.layer_bytes(GPT2, ddp, False) == (66_112 - 2 * 768, 0)


def test_llama_layer_casts_each_projection_and_caches_fp32_keys_forward_only():
    """accelerate DDP (autocast over fp32, cache on), h = kvd = 1024, f 2816, 16 heads: saved 30h + 4kvd +
    8f + 4a + 8 = 57,416; the fp32 K/V cache copies, 8kvd = 8,192, live only until the outputs are dropped."""
    st = hf.loop_settings(LLAMA, replace(DDP_TRAINER, loop="accelerate"))
    assert (st.use_cache, st.fp32_output_copy, st.ddp_output_clone) == (True, True, False)
    assert hf.layer_bytes(LLAMA, st, False) == (57_416, 8_192)
    # with bf16 weights (FSDP2) the projections share one input and the cache is what sdpa saves
    bf16 = hf.loop_settings(LLAMA, replace(DDP_TRAINER, loop="accelerate", dp_sharding="fsdp"))
    assert hf.layer_bytes(LLAMA, bf16, False) == (20 * 1024 + 4 * 1024 + 8 * 2816 + 64 + 8, 0)


def test_the_loss_region_peaks_where_the_loop_copies_the_logits():
    v = 50257
    st = hf.loop_settings(GPT2, DDP_TRAINER)
    moments = {m.name: m for m in hf.loss_moments(GPT2, st, v, 0, 4 * 768)}
    # Trainer's DDP: accelerate's fp32 copy, then DDP's clone of it: 4V + 4V beside the saved 4V
    after = moments["forward, after the model returns"]
    assert (after.activations, after.temporaries) == (4 * v, 8 * v)
    assert moments["backward, at log_softmax"].total == 12 * v
    assert moments["forward, at log_softmax"].total == 10 * v + 4 * 768
    no_clone = hf.loss_moments(GPT2, replace(st, ddp_output_clone=False), v, 0, 0)
    assert no_clone[1].total == 10 * v


@pytest.mark.parametrize("change, message", [
    ({"tp": 2}, r"tp\(2\) must be 1"), ({"pp": 2}, r"pp\(2\) must be 1"), ({"dp_sharding": "zero1"}, "not 'zero1'"),
    ({"recompute": "selective"}, "none or full"), ({"loop": "deepspeed"}, "unknown training loop"),
])
def test_what_hf_does_not_model_is_refused(change, message):
    train = TrainingSpec(seq_len=1024, global_batch=16, micro_batch=8)
    with pytest.raises(PlanError, match=message):
        plan = replace(DDP_TRAINER, **change)
        estimate(GPT2, train, replace(plan, dp=2 // (plan.tp * plan.pp)))


def test_unmodelled_families_are_refused():
    train = TrainingSpec(seq_len=1024, global_batch=16, micro_batch=8)
    with pytest.raises(PlanError, match="mixture-of-experts|'mixtral'"):
        estimate(PRESETS["mixtral-8x7b"], train, DDP_TRAINER)
    with pytest.raises(PlanError, match="'gpt_neox' is not modelled"):
        estimate(replace(GPT2, family="gpt_neox"), train, DDP_TRAINER)
    with pytest.raises(PlanError, match="activation 'relu'"):
        estimate(replace(GPT2, activation="relu"), train, DDP_TRAINER)


def test_the_issue_trainer_job_at_batch_8_and_the_categories_add_up():
    """The issue's job: Trainer GPT-2, DDP on 2 H200, bf16, seq 1024, micro-batch 8, measured
    max_memory_allocated 13,807,776,768 B (the torch framework said 9,791,924,736)."""
    e = estimate(GPT2, TrainingSpec(seq_len=1024, global_batch=16, micro_batch=8), DDP_TRAINER)
    s = e.stages[0]
    assert abs(s.allocated_bytes - 13_807_776_768) <= 0.005 * 13_807_776_768
    assert sum(s.categories.values()) == s.allocated_bytes
    assert s.categories["communication"] == s.categories["parameters"] == 497_759_232  # buckets, fp32 weights
    assert s.loss_moment == "forward, after the model returns"
    # gradient checkpointing keeps the block inputs (fp32) and, outside autocast, only the LM head's bf16 copy
    ck = estimate(GPT2, TrainingSpec(seq_len=1024, global_batch=16, micro_batch=8),
                  replace(DDP_TRAINER, recompute="full")).stages[0]
    assert ck.terms["activations"] == 12 * 4 * 768 * 8192
    assert ck.terms["autocast_weight_copies"] == 2 * 50257 * 768


def test_cli_hf_estimate_and_refusal(capsys):
    assert main(["plan", "estimate", "--model", "gpt2", "--framework", "hf", "--loop", "trainer", "--sharding", "none",
                 "--gpus", "2", "--gpu", "h200", "--seq", "1024", "--mbs", "8", "--gbs", "16"]) == 0
    out = capsys.readouterr().out
    assert "in diagnose's categories" in out and out.startswith("gpt2: fits: worst stage 0 needs")
    assert main(["plan", "estimate", "--model", "gpt2", "--framework", "hf", "--tp", "2", "--gpus", "2",
                 "--gbs", "16"]) == 2
    err = capsys.readouterr().err
    assert "tp(2) must be 1" in err and "Traceback" not in err
