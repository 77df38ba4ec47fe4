"""Issue 36: the job shapes where a frame name decided over a PyTorch signal, each built as a small snapshot
(:class:`builder.SnapBuilder`, frames as PyTorch records them) and diagnosed end to end (``analyze``, then the
report). Each test asserts facts (categories' bytes, pass counts, verdict kinds, evidence keys), never sentences.

The order of evidence every rule here follows: the sidecar's facts, then annotations (``Optimizer.step#``,
``Optimizer.zero_grad#``, ``ProfilerStep#``, ``nccl:*``), then the autograd engine's thread, then lifetimes
against the phases, and frame names last (exact functions, never substrings).
"""

from __future__ import annotations

import json

from builder import Job, SnapBuilder, frames

from oomdoctor import load
from oomdoctor.analysis import analyze

MiB = 1 << 20
GiB = 1 << 30
TORCH = "/venv/lib/python3.12/site-packages/torch"
MAIN = ("/w/train.py", 50, "<module>")
SETUP = frames((f"{TORCH}/nn/modules/module.py", 1370, "convert"), (f"{TORCH}/nn/modules/module.py", 965, "_apply"),
               ("/w/train.py", 5, "main"), MAIN)
INPUT = frames(("/w/train.py", 25, "main"), MAIN)
BACKWARD: list[dict] = []  # the autograd engine's thread: no Python frame
ZERO_GRAD = frames((f"{TORCH}/optim/optimizer.py", 990, "zero_grad"), ("/w/train.py", 45, "main"), MAIN)


def model(line: int) -> list[dict]:
    return frames(("/w/model.py", line, "forward"), (f"{TORCH}/nn/modules/module.py", 1790, "_call_impl"),
                  ("/w/train.py", 30, "main"), MAIN)


def compiled(line: int, where: str = "/w/train.py") -> list[dict]:
    """An allocation of Inductor's generated code (a compiled region), called from ``where``."""
    return frames(("/tmp/torchinductor_root/ab/cabc.py", line, "call"),
                  (f"{TORCH}/_inductor/output_code.py", 460, "__call__"),
                  (f"{TORCH}/_functorch/_aot_autograd/runtime_wrappers.py", 330, "runtime_wrapper"),
                  (f"{TORCH}/_dynamo/eval_frame.py", 650, "_fn"), (where, 40, "main"), MAIN)


def analysed(tmp_path, b: SnapBuilder, meta: dict | None = None, name: str = "rank0"):
    path = b.write(tmp_path / f"{name}.pickle")
    if meta is not None:
        (tmp_path / f"{name}.meta.json").write_text(json.dumps(meta))
    return analyze(load(path))


def report_of(a):
    from oomdoctor.report.pipeline import report_of as r
    return r([a])


def state_at(a, k: int) -> dict[str, int]:
    return a.breakdown_at(k, "x").categories


# --------------------------------------------------------------------------- 1. a compiled optimizer step

def compiled_step_job(steps: int = 3, forward=model, step_scope: bool = True):
    """``torch.compile(opt.step)``: Adam's state made at the first step and its temporaries, all by Inductor's
    code, inside ``Optimizer.step#AdamW.step``; gradients freed in ``Optimizer.zero_grad#``."""
    j = Job()
    marks: dict = {"optimizer_start": [], "after_step": []}
    for _ in range(2):
        j.alloc(64 * MiB, SETUP)
    batch = None
    for step in range(steps):
        new = j.alloc(MiB, INPUT)
        if batch is not None:
            j.b.free(batch)
        batch = new
        acts = [j.alloc(32 * MiB, forward(20 + i)) for i in range(3)]
        grads = [j.alloc(64 * MiB, BACKWARD) for _ in range(2)]
        marks.setdefault("grads_made", []).append(len(j.b.events) - 1)
        for x in acts:
            j.b.free(x)
        marks["optimizer_start"].append(len(j.b.events) - 1)
        if step_scope:
            j.b.annotate("Optimizer.step#AdamW.step", "START")
        if step == 0:
            marks["state"] = [j.alloc(64 * MiB, compiled(100 + i)) for i in range(4)]
        t = j.alloc(8 * MiB, compiled(200))
        j.b.free(t)
        if step_scope:
            j.b.annotate("Optimizer.step#AdamW.step", "END")
        marks["after_step"].append(len(j.b.events) - 1)
        j.b.annotate("Optimizer.zero_grad#AdamW.zero_grad", "START")
        for g in grads:
            j.b.free(g, fr=ZERO_GRAD)
        j.b.annotate("Optimizer.zero_grad#AdamW.zero_grad", "END")
    return j, marks


def test_compiled_optimizer_state_is_optimizer_state_and_the_passes_are_counted(tmp_path):
    j, m = compiled_step_job()
    a = analysed(tmp_path, j.b)
    assert a.phases.pass_starts.size == 3 and a.steps.updates == 3
    c = state_at(a, m["after_step"][2])
    assert c["optimizer_state"] == 4 * 64 * MiB and c["parameters"] == 128 * MiB and c["activations"] == 0
    assert state_at(a, m["optimizer_start"][1])["gradients"] == 128 * MiB


def test_a_compiled_step_without_its_scope_counts_its_steps_from_zero_grad(tmp_path):
    # torch 2.11 records no Optimizer.step# around a torch.compile-d step() (new-kinds-compiled-step: 5 steps ran,
    # "one optimizer step" was said from the optimizer frames); zero_grad's scope is still there, once a step
    j, m = compiled_step_job(steps=5, step_scope=False)
    a = analysed(tmp_path, j.b)
    assert a.steps.source == "annotations" and a.steps.updates == 5 and len(a.steps) == 5


def test_compiled_forward_and_compiled_optimizer_step(tmp_path):
    """The model compiled too: its allocations carry the same Inductor frames, outside any optimizer window."""
    j, m = compiled_step_job(forward=lambda line: compiled(line, "/w/model.py"))
    a = analysed(tmp_path, j.b)
    assert a.phases.pass_starts.size == 3 and a.steps.updates == 3
    assert state_at(a, m["after_step"][2])["optimizer_state"] == 4 * 64 * MiB
    assert state_at(a, m["grads_made"][2])["activations"] == 3 * 32 * MiB


# --------------------------------------------------------------------------- 2. recording started after model.cuda()

def late_recorded_job(steps: int = 3, set_to_none: bool = True):
    """``_record_memory_history`` called after the model and the optimizer's state were on the GPU: their
    blocks carry no frames and no event. Each step: ``zero_grad()`` first (frees last step's gradients when
    ``set_to_none``), forward, backward (the engine's thread makes the gradients), ``step()``."""
    j = Job()
    for _ in range(2):  # the parameters, made before the recording began
        j.b.alloc(j.seg, j.off, 64 * MiB, fr=[], record=False)
        j.off += 64 * MiB
    marks: dict = {"optimizer_start": []}
    grads: list[int] = []
    for step in range(steps):
        j.b.annotate("Optimizer.zero_grad#AdamW.zero_grad", "START")
        if set_to_none:
            for g in grads:
                j.b.free(g, fr=ZERO_GRAD)
            grads = []
        j.b.annotate("Optimizer.zero_grad#AdamW.zero_grad", "END")
        x = j.alloc(MiB, INPUT)
        acts = [j.alloc(32 * MiB, model(20 + i)) for i in range(3)]
        if not grads:
            grads = [j.alloc(64 * MiB, BACKWARD) for _ in range(2)]
        tmp = j.alloc(16 * MiB, BACKWARD)
        j.b.free(tmp)
        for t in acts:
            j.b.free(t)
        j.b.free(x)
        marks["optimizer_start"].append(len(j.b.events) - 1)
        j.b.annotate("Optimizer.step#AdamW.step", "START")
        if step == 0:
            marks["state"] = [j.alloc(64 * MiB, OPT_STATE) for _ in range(4)]
        t = j.alloc(8 * MiB, OPT_TMP)
        j.b.free(t)
        j.b.annotate("Optimizer.step#AdamW.step", "END")
    return j, marks


OPT_STATE = frames((f"{TORCH}/optim/adam.py", 178, "_init_group"), (f"{TORCH}/optim/optimizer.py", 533, "wrapper"),
                   ("/w/train.py", 40, "main"), MAIN)
OPT_TMP = frames((f"{TORCH}/optim/adam.py", 400, "_multi_tensor_adam"),
                 (f"{TORCH}/optim/optimizer.py", 533, "wrapper"), ("/w/train.py", 40, "main"), MAIN)


def test_late_recorded_gradients_are_gradients_at_every_step(tmp_path):
    for set_to_none in (True, False):
        j, m = late_recorded_job(set_to_none=set_to_none)
        (tmp_path / str(set_to_none)).mkdir()
        a = analysed(tmp_path / str(set_to_none), j.b)
        assert a.steps.updates == 3
        got = [state_at(a, k)["gradients"] for k in m["optimizer_start"]]
        assert got == [128 * MiB] * 3, (set_to_none, got)
        assert [state_at(a, k)["workspaces"] for k in m["optimizer_start"]] == [0] * 3


# --------------------------------------------------------------------------- 3. an __init__ frame alone is no parameter

def init_frames(*where: tuple[str, int]) -> list[dict]:
    """Constructors of the job's own code (innermost first), called from the script."""
    return frames(*[(f, line, "__init__") for f, line in where], ("/w/train.py", 8, "main"), MAIN)


def setup_then_train(extra: list[tuple[int, list[dict]]], steps: int = 2, train: bool = True):
    """Parameters made by the job's own module constructors (``nn.Parameter(torch.randn(..., device="cuda"))``)
    and ``extra`` blocks made at set-up, then ``steps`` training steps whose gradients have the parameters'
    shapes (or forward passes only when not ``train``)."""
    j = Job()
    params = [j.alloc(64 * MiB, init_frames(("/w/model.py", 12), ("/w/model.py", 40))) for _ in range(2)]
    for size, fr in extra:
        j.alloc(size, fr)
    marks: dict = {"end_of_step": []}
    for _ in range(steps):
        x = j.alloc(MiB, INPUT)
        acts = [j.alloc(32 * MiB, model(20 + i)) for i in range(3)]
        if train:
            j.b.annotate("Optimizer.zero_grad#AdamW.zero_grad", "END")
            grads = [j.alloc(64 * MiB, BACKWARD) for _ in range(2)]
        for t in acts:
            j.b.free(t)
        j.b.free(x)
        if train:
            j.b.annotate("Optimizer.step#AdamW.step", "START")
            t = j.alloc(8 * MiB, OPT_TMP)
            j.b.free(t)
            j.b.annotate("Optimizer.step#AdamW.step", "END")
            j.b.annotate("Optimizer.zero_grad#AdamW.zero_grad", "START")
            for g in grads:
                j.b.free(g, fr=ZERO_GRAD)
        marks["end_of_step"].append(len(j.b.events) - 1)
    return j, marks, params


def test_a_gpu_dataset_made_in_dataset_init_is_no_parameter(tmp_path):
    dataset = init_frames(("/w/data.py", 30))
    j, m, _ = setup_then_train([(200 * MiB, dataset)])
    a = analysed(tmp_path, j.b)
    c = state_at(a, m["end_of_step"][-1])
    assert c["parameters"] == 128 * MiB  # the model's own: their gradients have their shapes
    assert c["unknown"] == 200 * MiB


def test_a_static_kv_cache_made_in_a_module_init_is_no_parameter(tmp_path):
    cache = init_frames(("/w/model.py", 80), ("/w/model.py", 120))  # KVCache.__init__ in Attention.__init__
    j, m, _ = setup_then_train([(96 * MiB, cache), (96 * MiB, cache)], train=False)
    a = analysed(tmp_path, j.b)
    c = state_at(a, m["end_of_step"][-1])
    assert c["parameters"] == 0 and c["kv_cache"] + c["unknown"] == 2 * 96 * MiB + 128 * MiB


CONTAINER = f"{TORCH}/nn/modules/container.py"


def in_module_list(*inner: tuple[str, int, str]) -> list[dict]:
    """``nn.ModuleList(Block(...) for _ in range(n))`` in ``LM.__init__`` (gpt-fast): ``inner`` runs in
    ``Block.__init__``, which ``ModuleList.__init__`` calls through ``extend`` and ``__iadd__``."""
    return frames(*inner, ("/w/model.py", 50, "__init__"), ("/w/model.py", 82, "<genexpr>"),
                  (CONTAINER, 498, "extend"), (CONTAINER, 413, "__iadd__"), (CONTAINER, 364, "__init__"),
                  ("/w/model.py", 82, "__init__"), ("/w/train.py", 8, "main"), MAIN)


def test_a_static_kv_cache_made_beside_torch_nn_parameters_in_a_module_list_is_neither_parameters_nor_growth(
        tmp_path):
    """A model built under ``with torch.device("cuda")``: ``nn.Linear.__init__`` makes each weight on the GPU,
    and each block's ``__init__`` makes its static KV cache (``register_buffer(torch.zeros(...))``); then a
    prefill and 20 decode passes into the cache, each freeing what it made; the model is freed when the
    script's function returns. Memory does not grow."""
    j = Job()
    weight = in_module_list((f"{TORCH}/nn/modules/linear.py", 106, "__init__"))
    k_cache, v_cache = (in_module_list(("/w/model.py", line, "__init__")) for line in (56, 57))
    state = []
    for _ in range(6):
        state += [j.alloc(16 * MiB, weight) for _ in range(3)] + [j.alloc(48 * MiB, k_cache),
                                                                   j.alloc(48 * MiB, v_cache)]
    for step in range(21):
        x = j.alloc(MiB if step else 8 * MiB, INPUT)
        t = [j.alloc(4 * MiB, model(20 + i)) for i in range(3)]
        for y in t + [x]:
            j.b.free(y)
    last = len(j.b.events) - 1
    for y in state:
        j.b.free(y, fr=frames(("/w/train.py", 9, "main"), MAIN))
    a = analysed(tmp_path, j.b)
    c = state_at(a, last)
    assert c["parameters"] == 6 * 3 * 16 * MiB
    assert c["kv_cache"] + c["unknown"] == 6 * 2 * 48 * MiB and c["outputs"] == 0
    assert report_of(a).verdict.kind == "healthy"


# --------------------------------------------------------------------------- 4. a chunked loss is no pipeline

LOSS = frames((f"{TORCH}/nn/functional.py", 3400, "cross_entropy"), ("/w/train.py", 33, "chunked_loss"),
              ("/w/train.py", 30, "main"), MAIN)


def chunked_loss_job(chunks: int = 4, oom: bool = True, micro_batches: int = 1, loss: list[dict] = LOSS):
    """One micro-batch (or ``micro_batches`` run forward one after another before their backwards, GPipe on
    one GPU) whose loss is computed in ``chunks`` pieces: each piece's fp32 log-probabilities are saved for
    the one backward. Two steps, then a third's forward ends in an OOM no allocator setting helps."""
    j = Job(size=4 * GiB)
    for _ in range(2):
        j.alloc(64 * MiB, SETUP)
    for step in range(3):
        x = j.alloc(MiB, INPUT)
        saved = []
        for _mb in range(micro_batches):
            saved += [j.alloc(32 * MiB, model(20)), j.alloc(32 * MiB, model(21))]
            saved += [j.alloc(48 * MiB, loss) for _ in range(chunks)]
        if step == 2 and oom:
            j.b.oom(8 * GiB, device_free=0)
            break
        grads = [j.alloc(64 * MiB, BACKWARD) for _ in range(2)]
        for t in saved:
            j.b.free(t)
        j.b.free(x)
        j.b.annotate("Optimizer.step#AdamW.step", "START")
        t = j.alloc(8 * MiB, OPT_TMP)
        j.b.free(t)
        j.b.annotate("Optimizer.step#AdamW.step", "END")
        for g in grads:
            j.b.free(g, fr=ZERO_GRAD)
    return j


ROOM_META = {"rank": 0, "gpu_total_memory_bytes": 4 * GiB, "world_size": 1}


def test_a_chunked_loss_names_no_micro_batches_in_flight_and_no_pipeline(tmp_path):
    a = analysed(tmp_path, chunked_loss_job().b, ROOM_META)
    v = report_of(a).verdict
    assert v.kind == "capacity" and v.evidence["in_flight"] == 1
    assert "pipeline-in-flight" not in v.reasons and "pipeline-schedule" not in [x.id for x in v.to_do]


def test_gpipe_on_one_gpu_still_counts_its_micro_batches(tmp_path):
    """The same loss in one piece, four micro-batches' forwards before any backward: four in flight."""
    a = analysed(tmp_path, chunked_loss_job(chunks=1, micro_batches=4).b, ROOM_META)
    assert report_of(a).verdict.evidence["in_flight"] == 4


# --------------------------------------------------------------------------- 5. an attention softmax is no loss

SOFTMAX = frames((f"{TORCH}/nn/functional.py", 2100, "softmax"), (f"{TORCH}/nn/modules/activation.py", 1700, "forward"),
                 ("/venv/site-packages/megatron/core/fusions/fused_softmax.py", 210, "forward_torch_softmax"),
                 ("/venv/site-packages/megatron/core/fusions/fused_softmax.py", 160, "forward"),
                 ("/venv/site-packages/megatron/core/transformer/dot_product_attention.py", 190, "forward"),
                 (f"{TORCH}/nn/modules/module.py", 1790, "_call_impl"), ("/w/train.py", 30, "main"), MAIN)


def test_an_attention_softmax_gets_no_chunked_loss_advice(tmp_path):
    a = analysed(tmp_path, chunked_loss_job(loss=SOFTMAX).b, ROOM_META)
    v = report_of(a).verdict
    assert v.kind == "capacity" and "logits_bytes" not in v.evidence
    # the loss itself, at its exact function name, is the logits
    (tmp_path / "loss").mkdir()
    a = analysed(tmp_path / "loss", chunked_loss_job(loss=LOSS).b, ROOM_META)
    v = report_of(a).verdict
    assert v.kind == "capacity" and v.evidence["logits_bytes"] == 4 * 48 * MiB


# --------------------------------------------------------------------------- 7. sharding advice only where it is news

def wrapped(line: int, wrapper: tuple[str, int, str] | None) -> list[dict]:
    """A model frame called through ``wrapper`` (DDP's or FSDP's forward), or directly."""
    fr = [("/w/model.py", line, "forward"), (f"{TORCH}/nn/modules/module.py", 1790, "_call_impl")]
    if wrapper is not None:
        fr += [wrapper, (f"{TORCH}/nn/modules/module.py", 1790, "_call_impl")]
    return frames(*fr, ("/w/train.py", 30, "main"), MAIN)


DDP_FORWARD = (f"{TORCH}/nn/parallel/distributed.py", 1640, "forward")
FSDP_FORWARD = (f"{TORCH}/distributed/fsdp/fully_sharded_data_parallel.py", 850, "forward")


def capacity_job(wrapper):
    """Two steps with 1 GiB of Adam state, then a third step's forward runs out: no setting helps."""
    j = Job(size=4 * GiB)
    for _ in range(2):
        j.alloc(256 * MiB, SETUP)
    for step in range(3):
        x = j.alloc(MiB, INPUT)
        acts = [j.alloc(128 * MiB, wrapped(20 + i, wrapper)) for i in range(3)]
        if step == 2:
            j.b.oom(8 * GiB, device_free=0)
            break
        grads = [j.alloc(256 * MiB, BACKWARD) for _ in range(2)]
        for t in acts:
            j.b.free(t)
        j.b.free(x)
        j.b.annotate("Optimizer.step#AdamW.step", "START")
        if step == 0:
            [j.alloc(256 * MiB, OPT_STATE) for _ in range(4)]
        t = j.alloc(8 * MiB, OPT_TMP)
        j.b.free(t)
        j.b.annotate("Optimizer.step#AdamW.step", "END")
        for g in grads:
            j.b.free(g, fr=ZERO_GRAD)
    return j


def test_sharding_advice_only_for_data_parallel_jobs_that_do_not_shard(tmp_path):
    meta = {**ROOM_META, "world_size": 4}
    got = {}
    for name, wrapper in (("ddp", DDP_FORWARD), ("fsdp", FSDP_FORWARD), ("tp-only", None)):
        (tmp_path / name).mkdir()
        v = report_of(analysed(tmp_path / name, capacity_job(wrapper).b, meta)).verdict
        got[name] = (v.kind, v.evidence.get("sharding_frees_bytes"))
    assert got == {"ddp": ("capacity", GiB * 3 // 4), "fsdp": ("capacity", None),
                   "tp-only": ("capacity", None)}


# --------------------------------------------------------------------------- 9. pad or bucket only where shapes vary

def test_shapes_vary_only_where_a_model_stack_makes_new_sizes_from_pass_to_pass(tmp_path):
    from oomdoctor.detectors.context import TorchVersion
    from oomdoctor.detectors.fragmentation import _fixes, shapes_vary

    def job(lengths: list[int], cut: bool):
        j = Job()
        j.alloc(64 * MiB, SETUP)
        for n, length in enumerate(lengths):
            x = j.alloc(MiB, INPUT)
            layers = 2 if not (cut and n == len(lengths) - 1) else 1  # the last pass cut short by an OOM
            acts = [j.alloc(length * (i + 1) * MiB, model(20)) for i in range(layers)]
            grads = [j.alloc(64 * MiB, BACKWARD)]
            for t in acts + [x] + grads:
                j.b.free(t)
        return j

    got = []
    for name, lengths, cut in (("static", [8, 8, 8], True), ("varying", [8, 12, 8], False), ("one", [8], False)):
        (tmp_path / name).mkdir()
        got.append(shapes_vary(analysed(tmp_path / name, job(lengths, cut).b)))
    assert got == [False, True, False]
    pad = [f for f in _fixes(TorchVersion((2, 11), None, "2.11.0"), False, 0, False, True) if f.kind == "code"]
    assert len(pad) == 1 and not [f for f in _fixes(TorchVersion((2, 11), None, "2.11.0"), False, 0, False) if f.kind == "code"]


# --------------------------------------------------------------------------- 11. a 1F1B stage out of memory

def one_f_one_b_job(oom: bool):
    """One pipeline stage under 1F1B with 3 micro-batches a step: F0 F1 B0 F2 B1 B2, then the optimizer step.
    The third step runs out inside F1's forward, with F0's activations awaiting their backward."""
    j = Job(size=4 * GiB)
    for _ in range(2):
        j.alloc(16 * MiB, SETUP)
    marks: dict = {}

    def fwd(_mb):
        x = j.alloc(MiB, INPUT)
        return [x] + [j.alloc(32 * MiB, model(20 + i)) for i in range(3)]

    def bwd(acts, grads):
        if not grads:
            grads += [j.alloc(16 * MiB, BACKWARD) for _ in range(2)]
        t = j.alloc(8 * MiB, BACKWARD)
        j.b.free(t)
        for a in acts:
            j.b.free(a)

    for step in range(3):
        grads: list[int] = []
        f0 = fwd(0)
        if step == 2 and oom:
            j.b.alloc(j.seg, j.off, MiB, fr=INPUT)
            j.off += MiB
            j.alloc(32 * MiB, model(20))
            j.b.oom(8 * GiB, device_free=0)
            break
        f1 = fwd(1)
        bwd(f0, grads)
        f2 = fwd(2)
        bwd(f1, grads)
        bwd(f2, grads)
        j.b.annotate("Optimizer.step#AdamW.step", "START")
        t = j.alloc(8 * MiB, OPT_TMP)
        j.b.free(t)
        j.b.annotate("Optimizer.step#AdamW.step", "END")
        for g in grads:
            j.b.free(g, fr=ZERO_GRAD)
        marks.setdefault("ends", []).append(len(j.b.events) - 1)
    return j, marks


def test_a_1f1b_stage_out_of_memory_with_two_micro_batches_in_flight_is_capacity(tmp_path):
    j, _ = one_f_one_b_job(oom=True)
    a = analysed(tmp_path, j.b, ROOM_META)
    k = int(a.oom_events[-1])
    c = state_at(a, k)
    assert c["outputs"] == 0 and c["activations"] == 4 * 32 * MiB
    v = report_of(a).verdict
    assert v.kind == "capacity" and v.evidence["in_flight"] == 2


def test_a_1f1b_stage_out_of_memory_in_its_second_warm_up_forward_is_training_not_evaluation(tmp_path):
    """The stage ran out in F1, its second forward before the step's first backward (each step ran F0 F1 before
    B0): that is the step's warm-up, not a validation loop after training, so what fits is sized (issue 35: such a
    stage gave no answer, "inside an inference loop")."""
    from oomdoctor.analysis.phases import FORWARD_PHASE
    from oomdoctor.report.fits import device_room, fits

    j, _ = one_f_one_b_job(oom=True)
    a = analysed(tmp_path, j.b, ROOM_META)
    k = int(a.oom_events[-1])
    assert int(a.phases.phase[k]) == FORWARD_PHASE
    f = fits(a, device_room(a), 3)
    assert "cut-in-inference" not in f.notes


# --------------------------------------------------------------------------- 10. generate(): the cache's growth per token

GEN = [("/venv/site-packages/transformers/generation/utils.py", 2500, "_sample"),
       ("/venv/site-packages/transformers/generation/utils.py", 2200, "generate"), ("/w/gen.py", 20, "main"), MAIN]


def cache_update(layer: int) -> list[dict]:
    return frames(("/venv/site-packages/transformers/cache_utils.py", 120, "update"),
                  ("/venv/site-packages/transformers/models/llama/modeling_llama.py", 300 + layer, "forward"),
                  (f"{TORCH}/nn/modules/module.py", 1790, "_call_impl"), *GEN)


def test_an_oom_inside_generate_gives_the_caches_growth_per_token_as_data(tmp_path):
    """4 layers x (keys, values), 8 MiB each after the prefill, each re-made 1 MiB larger per token by
    torch.cat: 8 MiB per token; out of memory at the 11th token."""
    j = Job()
    j.alloc(256 * MiB, SETUP)
    cache = {}
    for layer in range(4):
        for kv in range(2):
            cache[layer, kv] = (j.alloc(8 * MiB, cache_update(2 * layer + kv)), 8)
    for token in range(11):
        x = j.alloc(MiB, frames(("/venv/site-packages/transformers/models/llama/modeling_llama.py", 200, "forward"),
                                (f"{TORCH}/nn/modules/module.py", 1790, "_call_impl"), *GEN))
        for layer in range(4):
            for kv in range(2):
                old, mib = cache[layer, kv]
                if token == 10 and (layer, kv) == (2, 0):
                    j.b.oom(64 * GiB, device_free=0)
                    break
                cache[layer, kv] = (j.alloc((mib + 1) * MiB, cache_update(2 * layer + kv)), mib + 1)
                j.b.free(old)
            else:
                continue
            break
        else:
            j.b.free(x)
            continue
        break
    a = analysed(tmp_path, j.b, ROOM_META)
    v = report_of(a).verdict
    assert v.evidence["kv_cache_growth_per_token_bytes"] == 8 * MiB


# --------------------------------------------------------------------------- 11. a last stage's cached outputs

def test_a_last_stage_that_keeps_its_outputs_until_step_ends_is_healthy_with_a_finding(snapshots):
    """torch.distributed.pipelining's last stage with return_outputs=True keeps every micro-batch's output
    until step() ends (recorded on a GPU, /work/shared/snapshots/pp-microbatch): memory does not grow from
    step to step, so the finding is listed under a healthy verdict."""
    from oomdoctor.report import build_report
    from oomdoctor.trace import load_ranks

    d = snapshots / "pp-microbatch"
    report = build_report(load_ranks([d / "return-outputs-rank0.pickle", d / "return-outputs-rank1.pickle"],
                                     skipped=[]))
    assert "pipeline-output-cache" in {f.id for f in report.findings}
    assert report.verdict.kind == "healthy"


# --------------------------------------------------------------------------- 9. DDP's buckets and cuBLAS's workspace

DDP = f"{TORCH}/nn/parallel/distributed.py"
DDP_INIT = frames((DDP, 1437, "_ddp_init_helper"), (DDP, 880, "__init__"), ("/w/train.py", 12, "main"), MAIN)
DDP_REBUILD = frames((DDP, 1775, "_pre_forward"), (DDP, 1890, "forward"), (f"{TORCH}/nn/modules/module.py", 1790,
                                                                             "_call_impl"), ("/w/train.py", 30, "main"),
                     MAIN)
BUCKETS = [MiB] + [25 * MiB] * 3  # DDP's bucket caps: bucket_cap_mb=25, the first bucket 1 MiB (_DEFAULT_FIRST_BUCKET_BYTES)


def ddp_job(steps: int = 4, workspace: list[dict] | None = None, workspace_sizes: tuple[int, ...] = ()):
    """A DDP rank that keeps nothing: parameters, the reducer's buckets made in ``_ddp_init_helper``, freed and
    made again in the order the gradients came by ``_rebuild_buckets`` in the second forward's ``_pre_forward``,
    alive to the end; each step a forward (3 activations), a backward (the engine's thread makes the gradients),
    ``Optimizer.step#`` and ``zero_grad``. ``workspace``: a stack that makes blocks of ``workspace_sizes`` once,
    at the first matmul of the first forward, never freed (cuBLAS's workspace for the handle)."""
    j = Job()
    marks: dict = {"end_of_step": []}
    for _ in range(2):
        j.alloc(64 * MiB, SETUP)
    old = [j.alloc(s, DDP_INIT) for s in BUCKETS]
    marks["buckets_born"] = len(j.b.events)
    for step in range(steps):
        x = j.alloc(MiB, INPUT)
        if step == 1:
            for o in old:
                j.b.free(o, fr=DDP_REBUILD)
            for s in BUCKETS:
                j.alloc(s, DDP_REBUILD)
        if step == 0 and workspace is not None:
            for s in workspace_sizes:
                j.alloc(s, workspace)
        acts = [j.alloc(MiB if i == 0 else 32 * MiB, model(20 + i)) for i in range(3)]
        j.b.annotate("Optimizer.zero_grad#AdamW.zero_grad", "END")
        grads = [j.alloc(64 * MiB, BACKWARD) for _ in range(2)]
        for t in acts:
            j.b.free(t)
        j.b.free(x)
        j.b.annotate("Optimizer.step#AdamW.step", "START")
        t = j.alloc(8 * MiB, OPT_TMP)
        j.b.free(t)
        j.b.annotate("Optimizer.step#AdamW.step", "END")
        j.b.annotate("Optimizer.zero_grad#AdamW.zero_grad", "START")
        for g in grads:
            j.b.free(g, fr=ZERO_GRAD)
        marks["end_of_step"].append(len(j.b.events) - 1)
    return j, marks


def test_ddp_buckets_are_communication_never_outputs_kept(tmp_path):
    """In the trace, and born before it (the ring buffer wrapped after the rebuild: the final segments keep the
    buckets' ``_pre_forward`` stack): communication; the rank keeps nothing, so no output is kept."""
    j, m = ddp_job()
    for name, drop in (("whole", 0), ("wrapped", m["end_of_step"][1] + 1)):
        (tmp_path / name).mkdir()
        b = j.b
        a = analyze(load(b.write(tmp_path / name / "rank0.pickle", drop_first=drop)))
        last = a.breakdown_at(a.device.num_events - 1, "x").categories
        assert last["communication"] == sum(BUCKETS), (name, str(last))
        assert last["outputs"] == 0 and last["unknown"] == 0, (name, last)
        assert report_of(a).verdict.kind == "healthy"


CUBLAS_CPP = [("", 0, "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long)"),
              ("??", 0, "at::cuda::getCurrentCUDABlasHandle()"),
              ("", 0, "void at::cuda::blas::gemm_internal_cublas_bfloat16_helper<c10::BFloat16>(char, char, long)"),
              ("Blas.cpp", 0, "at::native::(anonymous namespace)::addmm_out_cuda_impl(at::Tensor&, at::Tensor const&)")]


def test_a_cublas_workspace_is_a_workspace_or_unknown_never_outputs_kept(tmp_path):
    """cuBLAS's workspace (32 MiB) and cuBLASLt's (1 MiB), made at the first matmul and alive for good.
    With C++ stacks (``stacks="all"``; ``setWorkspaceForHandle`` inlined into ``getCurrentCUDABlasHandle``, as
    release builds symbolize it): workspaces. With Python stacks only, born before the trace (the ring buffer
    wrapped) from the forward's stack that makes 1 MiB activations too: never outputs (no output of that site is
    kept across passes in the trace); what no signal places is unknown."""
    sizes = (32 * MiB, MiB)
    j, m = ddp_job(workspace=frames(*CUBLAS_CPP, ("/w/model.py", 20, "forward"),
                                    (f"{TORCH}/nn/modules/module.py", 1790, "_call_impl"), ("/w/train.py", 30, "main"),
                                    MAIN), workspace_sizes=sizes)
    a = analysed(tmp_path, j.b)
    last = a.breakdown_at(a.device.num_events - 1, "x").categories
    assert last["workspaces"] == sum(sizes) and last["outputs"] == 0, str(last)
    j, m = ddp_job(workspace=model(20), workspace_sizes=sizes)
    (tmp_path / "py").mkdir()
    a = analyze(load(j.b.write(tmp_path / "py" / "rank0.pickle", drop_first=m["end_of_step"][1] + 1)))
    last = a.breakdown_at(a.device.num_events - 1, "x").categories
    assert last["outputs"] == 0, last
    assert last["workspaces"] + last["unknown"] == sum(sizes), last
    assert report_of(a).verdict.kind == "healthy"


# --------------------------------------------------------------------------- 8. an EMA copy of the weights

def ema_job(steps: int = 3, deepcopy: bool = False):
    """Training with an exponential moving average of the weights (timm's ModelEmaV3, scenarios/new_kinds.py):
    the model's parameters (64, 64 and 32 MiB, moved by ``Module._apply``), AdamW, then a copy of each weight
    made by the job's own code (``[p.detach().clone() for p in model.parameters()]``; with ``deepcopy``,
    ``copy.deepcopy(model)`` as ``torch.optim.swa_utils.AveragedModel`` does: ``Parameter.__deepcopy__``), alive
    to the end; each step a forward, a backward (the engine's thread makes one gradient per parameter),
    ``Optimizer.step#`` (Adam's state at the first), ``zero_grad``, then ``torch._foreach_lerp_`` in place (no
    allocation)."""
    j = Job()
    sizes = [64 * MiB, 64 * MiB, 32 * MiB]
    for s in sizes:
        j.alloc(s, SETUP)
    copy = (frames((f"{TORCH}/nn/parameter.py", 70, "__deepcopy__"), ("/usr/lib/python3.12/copy.py", 153, "deepcopy"),
                   ("/w/train.py", 14, "main"), MAIN) if deepcopy
            else frames(("/w/train.py", 14, "<listcomp>"), ("/w/train.py", 14, "main"), MAIN))
    for s in sizes:
        j.alloc(s, copy)
    marks: dict = {"end_of_step": [], "optimizer_start": []}
    for step in range(steps):
        x = j.alloc(MiB, INPUT)
        acts = [j.alloc(32 * MiB, model(20 + i)) for i in range(3)]
        grads = [j.alloc(s, BACKWARD) for s in sizes]
        for t in acts:
            j.b.free(t)
        j.b.free(x)
        marks["optimizer_start"].append(len(j.b.events) - 1)
        j.b.annotate("Optimizer.step#AdamW.step", "START")
        if step == 0:
            for s in sizes * 2:
                j.alloc(s, OPT_STATE)
        t = j.alloc(8 * MiB, OPT_TMP)
        j.b.free(t)
        j.b.annotate("Optimizer.step#AdamW.step", "END")
        j.b.annotate("Optimizer.zero_grad#AdamW.zero_grad", "START")
        for g in grads:
            j.b.free(g, fr=ZERO_GRAD)
        j.b.annotate("Optimizer.zero_grad#AdamW.zero_grad", "END")
        marks["end_of_step"].append(len(j.b.events) - 1)
    return j, marks


def test_an_ema_copy_of_the_weights_is_a_weight_copy_never_gradients_or_optimizer_state(tmp_path):
    for deepcopy in (False, True):
        j, m = ema_job(deepcopy=deepcopy)
        (tmp_path / str(deepcopy)).mkdir()
        a = analysed(tmp_path / str(deepcopy), j.b)
        for k in m["end_of_step"]:
            c = state_at(a, k)
            assert c["parameters"] == 160 * MiB and c["weight_copy"] == 160 * MiB, (deepcopy, str(c))
            assert c["unknown"] == 0
        c = state_at(a, m["optimizer_start"][2])
        assert c["gradients"] == 160 * MiB and c["optimizer_state"] == 320 * MiB, str(c)
        assert report_of(a).verdict.kind == "healthy"


# --------------------------------------------------------------------------- static-kv-large: unknown, and why

def test_unknown_bytes_say_why_no_signal_placed_them(tmp_path):
    """gpt-fast-style inference whose model and static cache were made before the trace (the ring buffer dropped
    their allocations; no stack of theirs survives: they are freed when the script's function returns, before the
    dump) and a block the trace made that no rule places (the loop's own code, alive to the end): unknown, with
    the reason of each byte, adding up to the line."""
    j = Job()
    for size in (64 * MiB, 64 * MiB, 96 * MiB):
        j.b.alloc(j.seg, j.off, size, fr=[], record=False)
        j.off += size
    before = list(j.b.segments[j.seg].blocks)
    kept = j.alloc(3 * MiB, INPUT)
    for _ in range(4):
        t = [j.alloc(4 * MiB, model(20 + i)) for i in range(3)]
        for y in t:
            j.b.free(y)
    last = len(j.b.events) - 1
    for addr in before:
        j.b.free(addr, fr=frames(("/w/gen.py", 9, "main"), MAIN))
    j.b.free(kept)
    a = analysed(tmp_path, j.b)
    bd = a.breakdown_at(last, "x")
    assert bd.categories["parameters"] == 0 and bd.categories["unknown"] == 224 * MiB + 3 * MiB
    assert bd.unknown_why == {"before_trace_no_stack": 224 * MiB, "in_trace": 3 * MiB}
    assert sum(bd.unknown_why.values()) == bd.categories["unknown"]
