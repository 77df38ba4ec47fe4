"""What oomdoctor knows about the code in a stack: PyTorch's own roles and the training frameworks.

One table, read by the analyses (which phase of a step an allocation belongs to, which block is a
collective's buffer), by the detectors and the verdict (which knob to name), and meant for the planner's
terms too. Patterns match frames as ``(path fragment, function names)``: the fragment is looked for in
the frame's file name with ``\\`` turned into ``/`` (snapshots recorded on Windows), the names must
match exactly (``None``: any function of that file).

Roles (:data:`ROLE_PATTERNS`), with the PyTorch source each rests on:

- ``backward``: code that only runs while autograd computes gradients: ``torch/autograd/__init__.py``
  ``backward``/``grad``/``_make_grads``, ``torch/autograd/graph.py`` ``_engine_run_backward``,
  ``torch/_tensor.py`` ``backward``; activation checkpointing's recomputation
  (``torch/utils/checkpoint.py`` ``recompute_fn``/``unpack_hook``, reentrant ``CheckpointFunction.backward``);
  FSDP's and AOT autograd's backward hooks (function names containing ``backward``). The autograd
  engine runs CUDA backward ops on its own device threads, which carry no Python frames: with Python
  stacks an allocation without any frame is a backward one (``torch/csrc/autograd/engine.cpp``
  ``Engine::thread_init``); with C++ stacks the engine's frames say so.
- ``optimizer``: ``torch/optim`` (not the LR schedulers), ``torch/distributed/optim``,
  ``torch/nn/utils/clip_grad.py`` and the optimizer libraries.
- ``forward``: ``torch.nn`` modules and functionals, model libraries, compiled regions.
- ``evaluation``: evaluation and prediction loops of Trainer and Lightning and the usual method names.
- ``setup``: building, loading, moving and wrapping the model (``Module._apply``, ``from_pretrained``,
  DDP/FSDP construction).
- ``communication``: buffers of collectives: ``distributed_c10d.py``, FSDP's all-gather and
  reduce-scatter buffers, DDP's gradient buckets (``_ddp_init_helper``, ``Reducer`` rebuilds in
  ``_pre_forward``), functional collectives and DTensor redistribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

Pattern = tuple[str, tuple[str, ...] | None]


class Stacks(Protocol):
    """What :func:`running_files` reads of a :class:`~oomdoctor.trace.model.StackTable` (this layer is below the
    trace's): frames ``(file, line, name)``, and stacks of frame ids."""

    frames: list[tuple[str, int, str]]
    stacks: list[tuple[int, ...]]


def normalize_path(filename: str) -> str:
    """A frame's file name with Windows separators turned into ``/``."""
    return filename.replace("\\", "/")


def matches(filename: str, name: str, patterns: tuple[Pattern, ...]) -> bool:
    """Does the frame ``(filename, name)`` match one of ``patterns``? ``filename`` already normalized."""
    for frag, names in patterns:
        if frag in filename and (names is None or name in names):
            return True
    return False


BACKWARD: tuple[Pattern, ...] = (
    ("torch/autograd/__init__.py", ("backward", "grad", "_make_grads")),
    ("torch/autograd/graph.py", ("_engine_run_backward",)),
    ("torch/_tensor.py", ("backward",)),
    ("torch/utils/checkpoint.py", ("backward", "recompute_fn", "unpack_hook", "unpack", "_recomputation_hook")),
)
"""Frames that only exist while gradients are computed (anywhere in the stack)."""

BACKWARD_NAME_PATHS: tuple[str, ...] = ("torch/distributed/fsdp/", "torch/_functorch/", "deepspeed/",
                                        "torch/distributed/_composable/")
"""Files whose functions named ``*backward*`` are backward hooks (FSDP1/2 pre/post-backward, AOT autograd's
compiled backward, DeepSpeed's gradient hooks)."""

ENGINE_CPP: tuple[str, ...] = ("torch::autograd::Engine::", "torch::autograd::AccumulateGrad",
                               "Backward0::apply", "Backward1::apply", "torch::autograd::Node::operator()")
"""C++ frames (``stacks="all"``) of the autograd engine's threads."""

WORKSPACE_CPP: tuple[str, ...] = ("at::cuda::setWorkspaceForHandle", "at::cuda::getCUDABlasLtWorkspace",
                                  "at::cuda::getCurrentCUDABlasHandle",
                                  "at::cuda::getNewWorkspace", "at::cuda::(anonymous namespace)::getNewWorkspace",
                                  "at::native::(anonymous namespace)::Workspace::Workspace")
"""C++ functions (``stacks="all"``; qualified names as :func:`cpp_function` gives them, compared exactly) that
allocate a library's workspace through the caching allocator and nothing else: cuBLAS's per handle and stream
(``getCurrentCUDABlasHandle`` calls ``setWorkspaceForHandle``, which release builds may inline, so the getter is
the frame symbolized) and cuBLASLt's (``aten/src/ATen/cuda/CublasHandlePool.cpp``), cuDNN's per convolution
(``aten/src/ATen/native/cudnn/Conv_v7.cpp`` ``Workspace``)."""


def cpp_function(name: str) -> str:
    """The qualified name of a symbolized C++ frame, without its return type, argument list and ``const``:
    ``at::cuda::setWorkspaceForHandle(cublasContext*, c10::cuda::CUDAStream)`` ->
    ``at::cuda::setWorkspaceForHandle``; ``(anonymous namespace)`` and template arguments stay."""
    s = name.strip()
    if s.endswith(" const"):
        s = s[:-6]
    if s.endswith(")"):
        depth = 0
        for i in range(len(s) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(s[i], 0)
            if depth == 0:
                s = s[:i]
                break
    depth, cut = 0, 0
    for i, c in enumerate(s):  # a return type ends at a space outside <...> and (...)
        depth += {"<": 1, "(": 1, ">": -1, ")": -1}.get(c, 0)
        if c == " " and depth == 0:
            cut = i + 1
    return s[cut:]


OPTIMIZER: tuple[Pattern, ...] = (
    ("torch/optim/", None),
    ("torch/distributed/optim/", None),
    ("torch/nn/utils/clip_grad.py", None),
    ("torch/_foreach", None),
    ("bitsandbytes/optim/", None),
    ("apex/optimizers/", None),
    ("deepspeed/ops/adam/", None),
    ("deepspeed/ops/lamb/", None),
    ("transformer_engine/pytorch/optimizers/", None),
    ("torchao/optim/", None),
    ("transformers/optimization.py", ("step",)),
    ("schedulefree/", None),
    ("timm/optim/", None),
)
OPTIMIZER_EXCLUDED: tuple[str, ...] = ("torch/optim/lr_scheduler.py", "torch/optim/swa_utils.py")

SETUP: tuple[Pattern, ...] = (
    ("torch/nn/modules/module.py", ("_apply", "to", "cuda", "convert", "load_state_dict", "_load_from_state_dict",
                                    "register_parameter", "to_empty", "half", "bfloat16", "float", "type")),
    ("torch/nn/init.py", None),
    ("torch/nn/parameter.py", None),
    ("transformers/modeling_utils.py", ("from_pretrained", "_load_pretrained_model", "post_init", "_init_weights",
                                        "init_weights", "tie_weights", "to", "_move_missing_keys_from_meta_to_device",
                                        "load_state_dict")),
    ("accelerate/accelerator.py", ("prepare", "prepare_model", "_prepare_one", "_prepare_fsdp2")),
    ("torch/nn/parallel/distributed.py", ("__init__", "_ddp_init_helper", "_sync_module_states")),
    ("torch/distributed/utils.py", ("_sync_module_states", "_sync_params_and_buffers",
                                    "_verify_param_shape_across_processes")),
    ("torch/distributed/fsdp/_fully_shard/_fsdp_init.py", None),
    ("torch/distributed/fsdp/_fully_shard/_fully_shard.py", ("fully_shard",)),
    ("torch/distributed/fsdp/_init_utils.py", None),
    ("torch/distributed/fsdp/fully_sharded_data_parallel.py", ("__init__",)),
    ("lightning/pytorch/strategies/", ("setup", "_setup_model", "model_to_device", "setup_environment")),
    ("lightning/fabric/", ("setup", "setup_module", "_setup_module")),
    ("safetensors/", None),
)
"""Building, loading, moving and wrapping the model."""

SETUP_NAMES: tuple[str, ...] = ("reset_parameters", "_reset_parameters", "init_weights", "_init_weights",
                                "configure_model", "init_model", "build_model")

MODULE_FILE = "torch/nn/modules/module.py"
MODULE_CALL_NAMES: tuple[str, ...] = ("_call_impl", "_wrapped_call_impl", "inner", "__call__", "forward")
"""Functions of ``Module`` that run forward; its other functions (``_apply``, hooks' plumbing) are not."""

CONTAINER_FILE = "torch/nn/modules/container.py"
"""``Sequential``, ``ModuleList``, ``ModuleDict``: of their functions only :data:`MODULE_CALL_NAMES` run forward;
the others (``__init__``, ``extend``, ``append``, ``__iadd__``, ``update``) add modules the caller made, so a
tensor made inside one (``nn.ModuleList(Block() for _ in range(n))``) was made by that module's own code."""

FORWARD: tuple[Pattern, ...] = (
    ("torch/nn/modules/", None),
    ("torch/nn/functional.py", None),
    ("torch/nn/parallel/", None),
    ("torch/_dynamo/", None),
    ("torch/_inductor/", None),
    ("torch/_functorch/", None),
    ("torch/distributed/pipelining/", None),
    ("transformers/models/", None),
    ("transformers/modeling_", None),
    ("transformers/activations.py", None),
    ("transformers/pytorch_utils.py", None),
    ("transformers/integrations/", None),
    ("transformers/loss/", None),
    ("transformers/masking_utils.py", None),
    ("transformers/cache_utils.py", None),
    ("transformers/utils/generic.py", None),
    ("timm/models/", None),
    ("torchvision/models/", None),
    ("torchtitan/models/", None),
    ("megatron/core/transformer/", None),
    ("megatron/core/models/", None),
    ("flash_attn/", None),
    ("xformers/", None),
    ("liger_kernel/", None),
    ("accelerate/utils/operations.py", ("__call__", "convert_to_fp32", "_convert_to_fp32", "recursively_apply")),
)
FORWARD_NAMES: tuple[str, ...] = ("forward", "_call_impl", "_wrapped_call_impl", "training_step", "compute_loss",
                                  "loss_fn", "criterion", "closure")
"""Function names of forward code; ``closure`` is the function an optimizer's ``step(closure)`` calls to
run forward and backward (Lightning's automatic optimization), inner to the optimizer's frames."""

EVALUATION: tuple[Pattern, ...] = (
    ("transformers/trainer.py", ("evaluate", "evaluation_loop", "prediction_step", "predict", "prediction_loop",
                                 "_evaluate")),
    ("transformers/trainer_seq2seq.py", ("evaluate", "predict", "prediction_step")),
    ("transformers/trainer_pt_utils.py", ("nested_concat", "torch_pad_and_concatenate", "nested_numpify")),
    ("lightning/pytorch/loops/evaluation_loop.py", None),
    ("lightning/pytorch/loops/prediction_loop.py", None),
)
EVALUATION_NAMES: tuple[str, ...] = ("evaluate", "evaluation", "validate", "validation", "validation_step",
                                     "test_step", "predict_step", "eval_step", "evaluation_step", "run_eval",
                                     "eval_loop", "evaluate_model", "inference", "generate")

GENERATION: tuple[Pattern, ...] = (
    ("transformers/generation/", None),
)
"""Autoregressive generation (``generate()``): inference, or an RL rollout inside training."""

KV_CACHE: tuple[Pattern, ...] = (
    ("transformers/cache_utils.py", None),
)
"""Code that fills a KV cache: transformers' ``Cache`` classes (``DynamicLayer.update`` concatenates each
step's keys and values, ``StaticCache`` allocates them once). A name rule, said as such where it decides;
a cache written by hand is found by its lifetime instead (``analysis/accounting.py``)."""

COMPILED: tuple[Pattern, ...] = (
    ("torchinductor_", None),
    ("torch/_inductor/", None),
    ("torch/_functorch/_aot_autograd/", None),
    ("torch/_dynamo/convert_frame.py", None),
)
"""Code that only runs when ``torch.compile`` compiled something: Inductor's generated modules (under its
cache directory ``torchinductor_<user>``), Inductor and AOT autograd's runtime, Dynamo's frame conversion.
``torch/_dynamo/eval_frame.py`` alone is not: ``Optimizer.zero_grad`` runs through its
``_disable_dynamo`` wrapper in every eager job."""

COMMUNICATION: tuple[Pattern, ...] = (
    ("torch/distributed/distributed_c10d.py", None),
    ("torch/distributed/_functional_collectives.py", None),
    ("torch/distributed/tensor/_redistribute.py", None),
    ("torch/distributed/tensor/_collective_utils.py", None),
    ("torch/distributed/_symmetric_memory/", None),
    ("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", None),
    ("torch/distributed/fsdp/_fully_shard/_fsdp_param.py", ("alloc_all_gather_outputs", "init_all_gather_outputs",
                                                            "alloc_storage", "init_unsharded_param")),
    ("torch/distributed/fsdp/_flat_param.py", ("unshard", "_alloc_padded_unsharded_flat_param", "pre_unshard",
                                               "_use_low_precision_shard", "_all_gather_flat_param")),
    ("torch/distributed/fsdp/_runtime_utils.py", ("_get_reduce_scatter_tensors", "_unshard")),
    ("torch/nn/parallel/distributed.py", ("_ddp_init_helper", "_pre_forward")),
    ("deepspeed/comm/", None),
    ("megatron/core/tensor_parallel/mappings.py", None),
)
"""Buffers of collectives (all-gather, reduce-scatter, all-reduce buckets)."""

COMMUNICATION_SITE: tuple[Pattern, ...] = (
    ("deepspeed/runtime/zero/stage3.py", ("_setup_for_real_optimizer",)),
)
"""Collective buffers known by the innermost frame of their framework's file alone (a name rule): ZeRO-3
allocates its reduce buckets (``reduce_bucket_size`` elements) and the flat buffer its reduce-scatter
writes gradient partitions into for good in ``_setup_for_real_optimizer``, which also calls what makes
the fp32 master partitions (those are parameters)."""


@dataclass(frozen=True)
class Framework:
    """A training framework: how to recognise it in stacks (``detect``: path fragments) and the
    knobs oomdoctor names in its own words (``knobs``: topic -> advice)."""

    id: str
    name: str
    detect: tuple[str, ...]
    knobs: dict[str, str]


FRAMEWORKS: tuple[Framework, ...] = (
    Framework("hf-trainer", "Hugging Face Trainer", ("transformers/trainer.py",), {
        "eval-outputs": ("pass preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1) to Trainer so "
                         "that only what compute_metrics needs is kept (eval_accumulation_steps=N alone moves the "
                         "full logits to host RAM every N steps)"),
        "activations": ("TrainingArguments(gradient_checkpointing=True), or a smaller per_device_train_batch_size "
                        "with gradient_accumulation_steps to keep the global batch; auto_find_batch_size=True "
                        "halves the batch after an OOM"),
        "logits": ("TrainingArguments(use_liger_kernel=True) fuses the LM head with the cross-entropy so no "
                   "[tokens, vocabulary] fp32 logits are materialised"),
        "optimizer": "TrainingArguments(optim='adamw_torch_fused') or an 8-bit optimizer ('adamw_bnb_8bit')",
        "sharding": "fsdp=True with fsdp_config={'version': 2} shards parameters, gradients and optimizer state",
    }),
    Framework("lightning", "PyTorch Lightning", ("lightning/pytorch/", "pytorch_lightning/"), {
        "eval-outputs": ("do not keep whole outputs in validation_step: append outputs.detach().cpu() or only the "
                         "reduced metric (torchmetrics updates state per batch)"),
        "activations": ("a smaller batch_size with Trainer(accumulate_grad_batches=N); activation checkpointing "
                        "(FSDPStrategy(activation_checkpointing_policy={Block}))"),
        "logits": "compute the loss in chunks, or fuse LM head and cross-entropy (liger-kernel)",
        "optimizer": "precision='bf16-true' keeps weights and optimizer state in bf16",
        "sharding": "strategy=FSDPStrategy(...) or 'deepspeed_stage_2' shards optimizer state",
    }),
    Framework("accelerate", "Hugging Face accelerate", ("accelerate/accelerator.py",), {
        "activations": ("a smaller micro-batch with Accelerator(gradient_accumulation_steps=N); "
                        "model.gradient_checkpointing_enable() for transformers models"),
        "logits": ("mixed precision wraps forward in convert_outputs_to_fp32: the logits are copied to fp32; "
                   "compute the loss inside the model (labels=...) or in chunks"),
        "sharding": "an FSDP or DeepSpeed plugin (accelerate config) shards optimizer state",
    }),
    Framework("torchtitan", "torchtitan", ("torchtitan/",), {
        "activations": "--activation_checkpoint.mode selective|full, a smaller --training.local_batch_size",
        "sharding": "--parallelism.data_parallel_shard_degree",
    }),
    Framework("fsdp2", "FSDP2 (fully_shard)", ("torch/distributed/fsdp/_fully_shard/",), {
        "activations": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper around each "
                        "block before fully_shard, or torch.utils.checkpoint in its forward"),
        "sharding": ("fully_shard(block, reshard_after_forward=True) frees each block's unsharded parameters after its "
                     "forward; MixedPrecisionPolicy(param_dtype=torch.bfloat16) halves the all-gathered copies"),
        "optimizer": "CPUOffloadPolicy() moves sharded parameters, gradients and optimizer state to the host",
    }),
    Framework("fsdp1", "FSDP1 (FullyShardedDataParallel)", ("torch/distributed/fsdp/fully_sharded_data_parallel.py",
                                                             "torch/distributed/fsdp/_runtime_utils.py"), {
        "activations": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing("
                        "model, check_fn=lambda m: isinstance(m, Block))"),
        "sharding": ("FullyShardedDataParallel(limit_all_gathers=True) bounds the all-gathers in flight; "
                     "sharding_strategy=ShardingStrategy.FULL_SHARD reshards after forward"),
        "optimizer": "CPUOffload(offload_params=True) moves parameters, gradients and optimizer state to the host",
    }),
    Framework("ddp", "DistributedDataParallel", ("torch/nn/parallel/distributed.py",), {
        "buckets": "DDP(gradient_as_bucket_view=True) makes gradients views of the buckets (one copy instead of two)",
    }),
    Framework("compile", "torch.compile", tuple(frag for frag, _n in COMPILED), {
        "graphs": ("mode='reduce-overhead' keeps CUDA graph private pools for every input shape; mode='default' or "
                   "'max-autotune-no-cudagraphs' runs without them, and torch._inductor.config.triton.cudagraph_trees "
                   "can be turned off"),
        "activations": "torch._functorch.config.activation_memory_budget=0.5 lets the partitioner recompute activations",
    }),
    Framework("deepspeed", "DeepSpeed", ("deepspeed/",), {
        "activations": ("\"activation_checkpointing\": {\"partition_activations\": true} with "
                        "deepspeed.checkpointing.checkpoint in the model, or a smaller train_micro_batch_size_per_gpu "
                        "with gradient_accumulation_steps"),
        "sharding": ("\"zero_optimization\": {\"stage\": 3} partitions parameters too; \"offload_optimizer\": "
                     "{\"device\": \"cpu\"} and \"offload_param\" move them to the host"),
        "buckets": ("\"zero_optimization\": {\"reduce_bucket_size\": ..., \"allgather_bucket_size\": ...} bound the "
                    "communication buffers (ZeRO-3 allocates its reduce bucket for good)"),
    }),
    Framework("generate", "transformers generate()", ("transformers/generation/",), {
        "kv-cache": ("a smaller batch or max_new_tokens; cache_implementation='static' allocates the KV cache once "
                     "instead of concatenating it one token larger every step; cache_implementation='quantized' or "
                     "'offloaded' keeps it in int4/int2 or on the host"),
    }),
    Framework("pipelining", "torch.distributed.pipelining", ("torch/distributed/pipelining/",), {
        "in-flight": ("fewer micro-batches in flight: Schedule1F1B instead of ScheduleGPipe, an interleaved schedule "
                      "(ScheduleInterleaved1F1B) with more stages per rank, or activation checkpointing in the stage "
                      "modules"),
    }),
)

PIPELINE_KNOB = ("hold fewer micro-batches in flight: a 1F1B schedule holds at most one per later stage, GPipe all of "
                 "them; or an interleaved schedule, more pipeline stages, or activation checkpointing inside the stages")
"""What to change when a pipeline schedule's micro-batches in flight do not fit (Narayanan et al. 2021,
arXiv:2006.09503 §2; torch.distributed.pipelining's schedules)."""

GRAPH_KEPT_FIX = ("evaluate under torch.no_grad() or torch.inference_mode(), and sum losses as numbers "
                  "(val_loss += loss.item()) or detached tensors (loss.detach())")
"""The fix for a loop that keeps every batch's autograd graph through a Python sum (PyTorch FAQ, 'Don't
accumulate history across your training loop')."""


def framework(fid: str) -> Framework:
    """The table entry of ``fid``. Raises KeyError for an unknown id."""
    for f in FRAMEWORKS:
        if f.id == fid:
            return f
    raise KeyError(fid)


IMPORT_FRAME_FILES = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")
"""CPython's import machinery (``Lib/importlib/_bootstrap.py``, frozen into the interpreter): a stack through
these frames is a module being imported (its body runs, or the garbage collector frees something meanwhile),
not the module's code being used."""


def running_files(stacks: Stacks) -> set[str]:
    """The file names of the frames of ``stacks`` (a :class:`~oomdoctor.trace.model.StackTable`: ``frames`` of
    ``(file, line, name)`` and ``stacks`` of frame ids) that appear in at least one stack outside an import
    (:data:`IMPORT_FRAME_FILES`). An import of ``transformers.generation`` while ``torch.compile`` loads its
    dependencies is no ``generate()`` call."""
    importing = {i for i, (f, _line, _name) in enumerate(stacks.frames) if f in IMPORT_FRAME_FILES}
    used: set[int] = set()
    for st in stacks.stacks:
        if importing.isdisjoint(st):
            used.update(st)
    return {stacks.frames[i][0] for i in used}


def detect_frameworks(filenames: Iterable[str]) -> list[Framework]:
    """The frameworks whose files appear among ``filenames`` (frame file names), in table order."""
    names = [normalize_path(f) for f in filenames]
    return [fw for fw in FRAMEWORKS if any(any(d in n for d in fw.detect) for n in names)]
