"""Issue 54: jobs that hold more than one set of weights, each built as a small snapshot (frames as PyTorch records
them; the autograd engine's thread has none) and diagnosed end to end, from the trace alone and with the sidecar
``oomdoctor run`` now writes (every optimizer's records, every module's parameters and buffers). Facts only:
categories' bytes, reasons and makers.
"""

from __future__ import annotations

import json

from builder import Job, frames
from test_signal_classes import BACKWARD, INPUT, MAIN, SETUP, TORCH, ZERO_GRAD, analysed, model

MiB = 1 << 20
SITE = "/venv/lib/python3.12/site-packages"
OPT_STATE = frames((f"{TORCH}/optim/adam.py", 178, "_init_group"), (f"{TORCH}/optim/optimizer.py", 533, "wrapper"),
                   ("/w/train.py", 44, "main"), MAIN)
OPT_TMP = frames((f"{TORCH}/optim/adam.py", 400, "_multi_tensor_adam"), (f"{TORCH}/optim/optimizer.py", 533, "wrapper"),
                 ("/w/train.py", 44, "main"), MAIN)


def bd(a, k: int):
    return a.breakdown_at(k, "x")


def step(j: Job, params: list[tuple[int, int]], grads_of: list[int], state: bool, name: str = "AdamW",
         extra_grads: list[int] | None = None, keep: list | None = None, marks: dict | None = None):
    """One training step: a forward (activations), a backward (the engine's thread makes a gradient of each size in
    ``grads_of``, and ``extra_grads`` blocks it keeps), the optimizer step (its state at the first), zero_grad."""
    x = j.alloc(MiB, INPUT)
    acts = [j.alloc(8 * MiB, model(20 + i)) for i in range(3)]
    if keep is not None:
        for k in keep:
            j.b.free(k)  # the last step's kept blocks go when this forward replaced them
    grads = [j.alloc(s, BACKWARD) for s in grads_of]
    kept = [j.alloc(s, BACKWARD) for s in (extra_grads or [])]
    for t in acts:
        j.b.free(t)
    j.b.free(x)
    if marks is not None:
        marks.setdefault("optimizer_start", []).append(len(j.b.events) - 1)
    j.b.annotate(f"Optimizer.step#{name}.step", "START")
    if state:
        for _a, s in params:
            j.alloc(s, OPT_STATE)
            j.alloc(s, OPT_STATE)
    t = j.alloc(MiB, OPT_TMP)
    j.b.free(t)
    j.b.annotate(f"Optimizer.step#{name}.step", "END")
    if marks is not None:
        marks.setdefault("time_after_step", []).append(j.b.t)
    j.b.annotate(f"Optimizer.zero_grad#{name}.zero_grad", "START")
    for g in grads:
        j.b.free(g, fr=ZERO_GRAD)
    j.b.annotate(f"Optimizer.zero_grad#{name}.zero_grad", "END")
    if keep is not None:
        keep[:] = kept
    return grads


# --------------------------------------------------------------------------- LoRA: a leaf's .grad is no gradient

def lora_job(steps: int = 4):
    """A frozen base (four 64 MiB weights) and LoRA adapters (eight 256 KiB factors), AdamW on the adapters. The
    embeddings' output is made to require gradients (``enable_input_require_grads``): each backward the engine
    accumulates its .grad, a 64 MiB block (the size of a base weight), kept until the next forward replaces it."""
    j = Job()
    base = [(j.alloc(64 * MiB, SETUP), 64 * MiB) for _ in range(4)]
    adapters = [(j.alloc(256 << 10, SETUP), 256 << 10) for _ in range(8)]
    marks: dict = {}
    keep: list = []
    for i in range(steps):
        step(j, adapters, [s for _a, s in adapters], state=i == 0, extra_grads=[64 * MiB], keep=keep, marks=marks)
    return j, marks, base, adapters


def test_a_backward_block_kept_past_its_backward_is_never_a_gradient(tmp_path):
    j, m, base, adapters = lora_job()
    a = analysed(tmp_path, j.b)
    for i, k in enumerate(m["optimizer_start"][1:], start=1):
        b = bd(a, k)
        assert b.categories["gradients"] == 8 * (256 << 10), b.categories  # the adapters' gradients only
        assert b.categories["parameters"] == 8 * (256 << 10)
        # the leaf's .grad: never a gradient, however long it lives; a temporary of the backward where a later
        # pass frees it, else what the engine's thread kept to the trace's end (freed in the last pass or never):
        # a workspace by that rule
        assert b.categories["temporaries" if i < len(m["optimizer_start"]) - 2 else "workspaces"] == 64 * MiB, \
            b.categories
        # the frozen base, from the trace alone: frozen weights or buffers? unknown, and why
        assert b.categories["unknown"] == 4 * 64 * MiB and b.unknown_why == {"frozen_or_buffer": 4 * 64 * MiB}
        assert b.categories["weight_copy"] == 0


def test_lora_with_the_sidecar_names_the_frozen_base_by_its_module(tmp_path):
    j, m, base, adapters = lora_job()
    t1 = m["time_after_step"][0]
    meta = {"rank": 0, "tensors": [{"step": 0, "time_us": t1, "optimizer": 0, "class": "torch.optim.adamw.AdamW",
                                    "parameters": [[a, s] for a, s in adapters], "gradients": [],
                                    "optimizer_state": []}],
            "modules": [{"step": 0, "time_us": t1, "roots": [{
                "class": "peft.peft_model.PeftModelForCausalLM", "parts": [["base_model", "peft.tuners.lora.LoraModel"]],
                "parameters": [[a, s, 0] for a, s in adapters], "gradients": [], "untouched": [],
                "frozen": [[a, s, 0] for a, s in base], "buffers": []}]}]}
    a = analysed(tmp_path, j.b, meta)
    b = bd(a, m["optimizer_start"][2])
    assert b.categories["weight_copy"] == 4 * 64 * MiB and b.categories["unknown"] == 0
    assert b.weight_copy_by == {"module peft.peft_model.PeftModelForCausalLM.base_model": 4 * 64 * MiB}
    assert b.categories["gradients"] == 8 * (256 << 10) and b.categories["parameters"] == 8 * (256 << 10)


def test_a_leaf_s_grad_freed_as_the_job_ends_beside_a_workspace_of_its_size_is_never_a_gradient(tmp_path):
    """As PEFT LoRA ran on an H200 (docs/corpus/models-lora, round 14): the backward thread's cuBLAS workspace (32 MiB
    on Hopper) has the size of the leaf's .grad (a 4 x 1024 x 2048 fp32 output) and is kept for good from the first
    backward; the last step's .grad goes after the optimizer's work, as the job ends. Neither makes that size a
    gradient's: before, both did, and every step's .grad was counted as gradients (+800%)."""
    j = Job()
    adapters = [(j.alloc(256 << 10, SETUP), 256 << 10) for _ in range(8)]
    for _ in range(4):  # the frozen base
        j.alloc(64 * MiB, SETUP)
    marks: dict = {}
    keep: list = []
    for i in range(4):
        step(j, adapters, [s for _a, s in adapters], state=i == 0, extra_grads=[32 * MiB] * (2 if i == 0 else 1),
             keep=keep, marks=marks)
        if i == 0:
            keep.pop()  # the workspace: never freed
    j.b.free(keep[0])  # the last .grad, after the optimizer's work
    a = analysed(tmp_path, j.b)
    for k in marks["optimizer_start"][1:]:
        b = bd(a, k)
        assert b.categories["gradients"] == 8 * (256 << 10), b.categories
        assert b.categories["parameters"] == 8 * (256 << 10), b.categories
        assert b.categories["temporaries"] + b.categories["workspaces"] == 2 * 32 * MiB, b.categories
    assert b.unknown_why == {"frozen_or_buffer": 4 * 64 * MiB}


def test_a_module_record_noted_before_a_wrapped_window_names_the_state_born_before_it(tmp_path):
    """The modules are noted once, at the first optimizer step; a ring buffer that wraps drops that step
    (docs/corpus/models-lora-late, ``--max-entries 12000``). The record still names a block allocated when the trace
    begins at its address, of its size: the frozen base a copy by its module, the buffer a buffer; at another size
    (the address reused since) it names nothing and the trace's reason stays."""
    j = Job()
    base = [(j.alloc(64 * MiB, SETUP), 64 * MiB) for _ in range(4)]
    adapters = [(j.alloc(256 << 10, SETUP), 256 << 10) for _ in range(8)]
    buf = j.alloc(MiB, SETUP)  # a registered buffer (rotary tables, say)
    m: dict = {}
    keep: list = []
    for i in range(4):
        step(j, adapters, [s for _a, s in adapters], state=i == 0, extra_grads=[64 * MiB], keep=keep, marks=m)
    cut = m["optimizer_start"][1] + 1  # the window begins after the first step's start: that step's end is dropped
    t1 = m["time_after_step"][0]

    def meta(scale: int) -> dict:
        return {"rank": 0, "modules": [{"step": 0, "time_us": t1, "roots": [{
            "class": "peft.peft_model.PeftModelForCausalLM", "parts": [["base_model", "peft.tuners.lora.LoraModel"]],
            "parameters": [[a, s, 0] for a, s in adapters], "gradients": [[a, s, 0] for a, s in adapters],
            "untouched": [], "frozen": [[a, s // scale, 0] for a, s in base], "buffers": [[buf, MiB, 0]]}]}]}

    for scale, named in ((1, True), (2, False)):
        d = tmp_path / f"x{scale}"
        d.mkdir()
        path = j.b.write(d / "rank0.pickle", drop_first=cut)
        (d / "rank0.meta.json").write_text(json.dumps(meta(scale)))
        from oomdoctor import load
        from oomdoctor.analysis import analyze

        a = analyze(load(path))
        b = bd(a, m["optimizer_start"][3] - cut)
        assert b.categories["gradients"] == 8 * (256 << 10), b.categories  # the record's gradients say nothing here
        if named:
            assert b.categories["weight_copy"] == 4 * 64 * MiB, b.categories
            assert b.weight_copy_by == {"module peft.peft_model.PeftModelForCausalLM.base_model": 4 * 64 * MiB}
        else:
            assert b.categories["weight_copy"] == 0 and b.unknown_why.get("frozen_or_buffer", 0) >= 4 * 64 * MiB, (
                b.categories, b.unknown_why)
        assert b.categories["buffers"] == MiB and b.buffers_by == {
            "module peft.peft_model.PeftModelForCausalLM.base_model": MiB}


# --------------------------------------------------------------------------- a GAN: two optimizers

def gan_job(steps: int = 3):
    """A discriminator (three 8 MiB weights, AdamW, steps first) and a generator (three 16 MiB weights, AdamW). The
    generator's backward fills the discriminator's .grad in place (no allocation); each zero_grad frees its own."""
    j = Job()
    disc = [(j.alloc(8 * MiB, SETUP), 8 * MiB) for _ in range(3)]
    gen = [(j.alloc(16 * MiB, SETUP), 16 * MiB) for _ in range(3)]
    marks: dict = {"d": {}, "g": {}}
    for i in range(steps):
        step(j, disc, [s for _a, s in disc], state=i == 0, name="AdamW", marks=marks["d"])
        step(j, gen, [s for _a, s in gen], state=i == 0, name="AdamW", marks=marks["g"])
    return j, marks, disc, gen


def test_a_gan_s_two_models_are_both_parameters(tmp_path):
    j, m, disc, gen = gan_job()
    for name, meta in (("trace", None), ("sidecar", _gan_meta(m, disc, gen))):
        (tmp_path / name).mkdir()
        a = analysed(tmp_path / name, j.b, meta)
        for k in m["g"]["optimizer_start"][1:]:
            b = bd(a, k)
            assert b.categories["parameters"] == 72 * MiB, (name, b.categories)
            assert b.categories["gradients"] == 48 * MiB, (name, b.categories)
            assert b.categories["optimizer_state"] == 144 * MiB, (name, b.categories)
            assert b.categories["weight_copy"] == b.categories["unknown"] == 0, (name, b.categories)


def _gan_meta(m, disc, gen) -> dict:
    recs = []
    for i, (who, params) in enumerate((("d", disc), ("g", gen))):
        for s in (0, 1):
            recs.append({"step": s, "time_us": m[who]["time_after_step"][s], "optimizer": i,
                         "class": "torch.optim.adamw.AdamW", "parameters": [[a, n] for a, n in params],
                         "gradients": [], "optimizer_state": []})
    recs.sort(key=lambda r: r["time_us"])
    return {"rank": 0, "tensors": recs}


# --------------------------------------------------------------------------- MoCo: a momentum encoder and a queue

def moco_job(steps: int = 3):
    """MoCo: the query encoder (four 4 MiB weights, SGD with momentum), the key encoder (``copy.deepcopy`` in the
    module's ``__init__``, moved with it: four 4 MiB blocks no gradient reaches), and a 512 MiB queue registered as a
    buffer, moved with the module; the key encoder is updated in place (no allocation)."""
    j = Job()
    q = [(j.alloc(4 * MiB, SETUP), 4 * MiB) for _ in range(4)]
    k = [(j.alloc(4 * MiB, SETUP), 4 * MiB) for _ in range(4)]
    queue = j.alloc(512 * MiB, SETUP)
    marks: dict = {}
    for i in range(steps):
        step(j, [(a, s // 2) for a, s in q], [s for _a, s in q], state=i == 0, name="SGD", marks=marks)
    return j, marks, q, k, queue


def test_a_momentum_encoder_is_a_weight_copy_and_a_queue_never_one(tmp_path):
    j, m, q, k, queue = moco_job()
    a = analysed(tmp_path, j.b)
    b = bd(a, m["optimizer_start"][2])
    # the key encoder copies every trained weight: a weight copy; the queue, of a size no gradient has: unknown
    assert b.categories["weight_copy"] == 16 * MiB and b.categories["parameters"] == 16 * MiB, b.categories
    assert b.categories["unknown"] == 512 * MiB and b.unknown_why == {"frozen_or_buffer": 512 * MiB}
    assert b.categories["outputs"] == 0 and b.categories["gradients"] == 16 * MiB


def test_moco_with_the_sidecar_names_the_key_encoder_and_the_queue(tmp_path):
    j, m, q, k, queue = moco_job()
    t1 = m["time_after_step"][0]
    meta = {"rank": 0, "modules": [{"step": 0, "time_us": t1, "roots": [{
        "class": "moco.builder.MoCo", "parts": [["encoder_q", "torchvision.models.resnet.ResNet"],
                                                ["encoder_k", "torchvision.models.resnet.ResNet"]],
        "parameters": [[a, s, 0] for a, s in q], "gradients": [], "untouched": [],
        "frozen": [[a, s, 1] for a, s in k], "buffers": [[queue, 512 * MiB, -1]]}]}]}
    a = analysed(tmp_path, j.b, meta)
    b = bd(a, m["optimizer_start"][2])
    assert b.categories["buffers"] == 512 * MiB and b.buffers_by == {"module moco.builder.MoCo": 512 * MiB}
    assert b.weight_copy_by == {"module moco.builder.MoCo.encoder_k": 16 * MiB}
    assert b.categories["unknown"] == 0 and b.categories["parameters"] == 16 * MiB


# --------------------------------------------------------------------------- diffusers' EMAModel

EMA_TO = frames((f"{SITE}/diffusers/training_utils.py", 611, "<listcomp>"),
                (f"{SITE}/diffusers/training_utils.py", 610, "to"), ("/w/train_unet.py", 80, "main"), MAIN)
EMA_STEP = frames((f"{SITE}/diffusers/training_utils.py", 470, "step"), ("/w/train_unet.py", 120, "main"), MAIN)


def test_an_ema_helper_s_shadow_parameters_are_weight_copies_named_by_its_frame(tmp_path):
    """diffusers' ``EMAModel`` built on the host, moved with ``.to(device)`` (one line making every shadow parameter),
    then ``step()`` after each update: ``s.sub_((1 - decay) * (s - p))`` makes and frees a temporary per parameter."""
    j = Job()
    params = [(j.alloc(s, SETUP), s) for s in (32 * MiB, 32 * MiB, 16 * MiB)]
    for _a, s in params:
        j.alloc(s, EMA_TO)
    marks: dict = {}
    for i in range(3):
        step(j, params, [s for _a, s in params], state=i == 0, marks=marks)
        for _a, s in params:
            t = j.alloc(s, EMA_STEP)
            j.b.free(t)
    a = analysed(tmp_path, j.b)
    for k in marks["optimizer_start"]:
        b = bd(a, k)
        assert b.categories["weight_copy"] == 80 * MiB and b.categories["parameters"] == 80 * MiB, b.categories
        assert b.categories["gradients"] == 80 * MiB  # never the EMA's bytes again
        assert b.weight_copy_by == {"diffusers/training_utils.py:611 <listcomp>": 80 * MiB}


# --------------------------------------------------------------------------- an older recorder, a wrapped buffer

def test_adam_state_made_before_a_wrapped_window_is_never_read_as_gradients(tmp_path):
    """The ring buffer dropped the set-up and the first step (Adam's state made there), and no stack survives
    (``--stacks none``): the state is unknown or optimizer state, never gradients."""
    j = Job()
    params = [(j.alloc(s, []), s) for s in (32 * MiB, 32 * MiB, 16 * MiB)]
    marks: dict = {}
    cut = None
    for i in range(4):
        if i == 1:
            cut = len(j.b.events)
        step(j, params, [s for _a, s in params], state=i == 0, marks=marks)
    for e in j.b.events:
        e["frames"] = []
    for s in j.b.segments.values():
        for blk in s.blocks.values():
            blk.frames = []
    path = j.b.write(tmp_path / "rank0.pickle", drop_first=cut)
    from oomdoctor import load
    from oomdoctor.analysis import analyze

    a = analyze(load(path))
    b = a.breakdown_at(marks["optimizer_start"][3] - cut, "x")
    assert b.categories["gradients"] == 80 * MiB, b.categories
    assert b.categories["optimizer_state"] + b.categories["unknown"] + b.categories["parameters"] == 240 * MiB
    assert b.categories["parameters"] <= 80 * MiB


# --------------------------------------------------------------------------- BYOL: a target made in the first forward

DEEPCOPY_IN_FORWARD = frames((f"{TORCH}/nn/parameter.py", 70, "__deepcopy__"),
                             ("/usr/lib/python3.12/copy.py", 153, "deepcopy"),
                             ("/w/byol.py", 40, "_get_target_encoder"), ("/w/byol.py", 60, "forward"),
                             (f"{TORCH}/nn/modules/module.py", 1790, "_call_impl"), ("/w/train.py", 30, "main"), MAIN)


def test_a_target_encoder_made_in_the_first_forward_is_a_weight_copy_never_outputs(tmp_path):
    """BYOL (lucidrains' byol-pytorch): the target encoder is ``copy.deepcopy(online_encoder)`` made lazily inside the
    first forward, kept for good and updated by EMA in place; before issue 54 it read as outputs kept."""
    j = Job()
    online = [(j.alloc(4 * MiB, SETUP), 4 * MiB) for _ in range(4)]
    marks: dict = {}
    for i in range(3):
        x = j.alloc(MiB, INPUT)
        if i == 0:
            for _a, s in online:
                j.alloc(s, DEEPCOPY_IN_FORWARD)
        acts = [j.alloc(8 * MiB, model(20 + n)) for n in range(2)]
        grads = [j.alloc(s, BACKWARD) for _a, s in online]
        for t in acts:
            j.b.free(t)
        j.b.free(x)
        marks.setdefault("optimizer_start", []).append(len(j.b.events) - 1)
        j.b.annotate("Optimizer.step#LARS.step", "START")
        if i == 0:
            for _a, s in online:
                j.alloc(s, OPT_STATE)
        j.b.annotate("Optimizer.step#LARS.step", "END")
        j.b.annotate("Optimizer.zero_grad#LARS.zero_grad", "START")
        for g in grads:
            j.b.free(g, fr=ZERO_GRAD)
        j.b.annotate("Optimizer.zero_grad#LARS.zero_grad", "END")
    a = analysed(tmp_path, j.b)
    for k in marks["optimizer_start"]:
        b = bd(a, k)
        assert b.categories["outputs"] == 0, b.categories
        assert b.categories["weight_copy"] == 16 * MiB and b.categories["parameters"] == 16 * MiB, b.categories
        assert b.weight_copy_by == {"copy.deepcopy": 16 * MiB}


def test_untouched_parameters_are_copies_only_where_the_optimizers_step_the_modules_own(tmp_path):
    """The sidecar's ``untouched`` parameters (require gradients, had none at the step's end, no optimizer steps
    them): a ``deepcopy`` EMA where the optimizer steps the model's own parameters; where it steps tensors no module
    holds (DeepSpeed's fp32 master copies, its engine having moved every bf16 gradient into its partition) they are
    the model's parameters, left to the trace."""
    j = Job()
    params = [(j.alloc(s, SETUP), s) for s in (32 * MiB, 16 * MiB)]
    copy = [(j.alloc(s, SETUP), s) for s in (32 * MiB, 16 * MiB)]
    marks: dict = {}
    for i in range(3):
        step(j, params, [s for _a, s in params], state=i == 0, marks=marks)
    t1 = marks["time_after_step"][0]

    def meta(optimizer_params):
        return {"rank": 0, "tensors": [{"step": 0, "time_us": t1, "optimizer": 0, "class": "torch.optim.adamw.AdamW",
                                        "parameters": [[a, s] for a, s in optimizer_params], "gradients": [],
                                        "optimizer_state": []}],
                "modules": [{"step": 0, "time_us": t1, "roots": [
                    {"class": "train.Net", "parts": [], "parameters": [], "gradients": [], "frozen": [], "buffers": [],
                     "untouched": [[a, s, -1] for a, s in params]},
                    {"class": "train.Net", "parts": [], "parameters": [], "gradients": [], "frozen": [], "buffers": [],
                     "untouched": [[a, s, -1] for a, s in copy]}]}]}

    (tmp_path / "ema").mkdir()
    b = bd(analysed(tmp_path / "ema", j.b, meta(params)), marks["optimizer_start"][2])
    assert b.categories["weight_copy"] == 48 * MiB and b.weight_copy_by == {"module train.Net": 48 * MiB}
    assert b.categories["parameters"] == 48 * MiB
    masters = [(0x1000 + i, s) for i, (_a, s) in enumerate(params)]  # tensors no module holds
    (tmp_path / "ds").mkdir()
    b = bd(analysed(tmp_path / "ds", j.b, meta(masters)), marks["optimizer_start"][2])
    assert b.weight_copy_by.get("module train.Net", 0) == 0


def test_a_gradient_the_next_backward_replaces_is_of_a_trained_size(tmp_path):
    """FSDP1 with ``use_orig_params`` (Lightning's FSDP strategy): the optimizer's state is per original parameter
    (two 3 MiB and one 2 MiB here), but the gradient is one shard of the flat parameter (8 MiB), made in a backward,
    alive at the step, and replaced by the next backward's: of a trained size all the same, never a temporary
    (lightning-fsdp-gpt2-b96 lost 68% of its gradients to that before)."""
    j = Job()
    flat = j.alloc(8 * MiB, SETUP)
    small = j.alloc(2 * MiB, SETUP)  # a second flat parameter holding one original parameter: state of its size
    originals = [(flat, 3 * MiB), (flat + 3 * MiB, 3 * MiB), (flat + 6 * MiB, 2 * MiB), (small, 2 * MiB)]
    marks: dict = {}
    grads: list = []
    for i in range(4):
        x = j.alloc(MiB, INPUT)
        acts = [j.alloc(8 * MiB, model(20 + n)) for n in range(2)]
        new = [j.alloc(8 * MiB, BACKWARD), j.alloc(2 * MiB, BACKWARD)]
        for g in grads:
            j.b.free(g)  # the backward replaced the last step's gradient shards
        grads = new
        for t in acts:
            j.b.free(t)
        j.b.free(x)
        marks.setdefault("optimizer_start", []).append(len(j.b.events) - 1)
        j.b.annotate("Optimizer.step#AdamW.step", "START")
        if i == 0:
            for _a, s in originals:
                j.alloc(s, OPT_STATE)
                j.alloc(s, OPT_STATE)
        j.b.annotate("Optimizer.step#AdamW.step", "END")
    a = analysed(tmp_path, j.b)
    for k in marks["optimizer_start"][1:]:
        assert bd(a, k).categories["gradients"] == 10 * MiB, bd(a, k).categories


def test_a_reference_model_without_the_policy_s_value_head_is_still_a_copy(tmp_path):
    """RL with a reference model: ``copy.deepcopy(policy.lm)`` moved with the module (construction), while the
    policy trains its LM (two 32 MiB weights) and a value head (a 4 KiB weight the copy lacks): the extras hold
    all but 0.006% of one step's gradient bytes (WHOLE_COPY), a copy; two BatchNorm statistics beside their
    weights hold far less: unknown, copy_or_buffer."""
    from oomdoctor.analysis.accounting import WHOLE_COPY

    j = Job()
    lm = [(j.alloc(32 * MiB, SETUP), 32 * MiB) for _ in range(2)]
    head = (j.alloc(4096, SETUP), 4096)
    for _ in range(2):
        j.alloc(32 * MiB, SETUP)  # the reference model's copy of the LM's two weights
    marks: dict = {}
    for i in range(3):
        step(j, lm + [head], [32 * MiB, 32 * MiB, 4096], state=i == 0, marks=marks)
    b = bd(analysed(tmp_path, j.b), marks["optimizer_start"][2])
    assert b.categories["weight_copy"] == 64 * MiB and b.categories["unknown"] == 0, b.categories
    assert (64 * MiB) / (64 * MiB + 4096) >= WHOLE_COPY
