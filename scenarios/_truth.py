"""Ground truth a training job measures about itself, for the real-job corpus (docs/corpus/README.md).

Framework-agnostic: global optimizer hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook`` /
``..._post_hook``) see every ``torch.optim`` optimizer, whoever drives it (Trainer, Lightning,
accelerate, a plain loop). Bytes are counted per distinct storage on this rank's GPU, so views (FSDP1
``use_orig_params``, DDP bucket views) count once and DTensors (FSDP2) count their local shard:

- ``parameters_bytes``: the optimizer's parameters, at the first pre-step hook, with the module's own
  parameters when the job names its model (``GroundTruth.model``): a wrapper such as DeepSpeed steps a
  torch optimizer over fp32 master copies (the planner's ``master_weights``, counted as parameters
  there too) while the model computes with bf16 ones (ZeRO-3: their partitions, ``ds_tensor``);
  ``model_parameters_bytes`` and ``master_parameters_bytes`` give the two apart;
- ``gradients_bytes``: their ``.grad`` just before each ``step()`` (the largest seen);
- ``optimizer_state_bytes``: the optimizer's state tensors just after each ``step()`` (the largest);
- ``allocated_at_first_step_start_bytes``: ``torch.cuda.memory_allocated()`` at the first pre-step hook;
- an optimizer that is no ``torch.optim.Optimizer`` (a job's own class) is measured the same way
  when the job calls :meth:`GroundTruth.before_step` / :meth:`GroundTruth.after_step` around it;
- ``max_memory_allocated`` / ``max_memory_reserved``: ``torch.cuda`` peaks at the end (or at the OOM);
- ``oom``: the first line of the out-of-memory error that ended the job, if any;
- ``gpu_total_memory_bytes``, ``device_free_at_end_bytes`` (``cudaMemGetInfo``), versions.

Nothing here records memory history: the job runs under ``oomdoctor run`` for that.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch


def _storages(tensors, device: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        if isinstance(t, torch.Tensor) and t.is_cuda and t.device.index == device:
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


class GroundTruth:
    """Install with :meth:`install`; call :meth:`write` at the end (also from a ``finally``)."""

    def __init__(self, path: str | None, **config: Any) -> None:
        self.path = path
        self.rank = int(os.environ.get("RANK", "0"))
        self.truth: dict[str, Any] = {**config, "parameters_bytes": 0, "gradients_bytes": 0,
                                      "optimizer_state_bytes": 0, "optimizer_steps": 0, "oom": None}
        self.handles: list[Any] = []
        self.model: Any = None  # the module whose own parameters count too (a wrapper's bf16 copies)

    def install(self) -> GroundTruth:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
        return self

    def _device(self) -> int:
        return torch.cuda.current_device()

    def _pre(self, opt, args, kwargs) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        dev = self._device()
        master = _storages(params, dev)
        own: dict[int, int] = {}
        if self.model is not None:
            mp = list(self.model.parameters())
            own = _storages([getattr(p, "ds_tensor", p) for p in mp], dev)
            params += [p for p in mp if p.grad is not None]
        both = {**own, **master}
        if sum(both.values()) >= self.truth["parameters_bytes"]:
            self.truth["parameters_bytes"] = sum(both.values())
            self.truth["model_parameters_bytes"] = sum(own.values()) if self.model is not None else None
            self.truth["master_parameters_bytes"] = sum(v for k, v in master.items() if k not in own)
        grads = [p.grad for p in params if p.grad is not None]
        self.truth["gradients_bytes"] = max(self.truth["gradients_bytes"], sum(_storages(grads, dev).values()))
        self.truth.setdefault("allocated_at_first_step_start_bytes", torch.cuda.memory_allocated(dev))

    def before_step(self, opt) -> None:
        """For an optimizer the global hooks do not see: call just before its ``step()``."""
        self._pre(opt, (), {})

    def after_step(self, opt) -> None:
        """For an optimizer the global hooks do not see: call just after its ``step()``."""
        self._post(opt, (), {})

    def _post(self, opt, args, kwargs) -> None:
        state = [v for st in opt.state.values() if isinstance(st, dict) for v in st.values()]
        state = [v for v in state if isinstance(v, torch.Tensor)]
        self.truth["optimizer_state_bytes"] = max(self.truth["optimizer_state_bytes"],
                                                  sum(_storages(state, self._device()).values()))
        self.truth["optimizer_steps"] += 1

    def note(self, **values: Any) -> None:
        """Other facts the job measures about itself (a KV cache's bytes, a schedule), kept as given."""
        self.truth.update(values)

    def oom(self, e: BaseException) -> None:
        self.truth["oom"] = str(e).splitlines()[0][:400]

    def count_model(self, model) -> None:
        """A job without an optimizer (inference): its parameters are the module's."""
        self.truth["parameters_bytes"] = sum(_storages(model.parameters(), self._device()).values())

    def write(self, **extra: Any) -> None:
        """Rank 0 writes the JSON (with ``extra`` merged in); every rank does when the path holds
        ``{rank}`` (a pipeline's stages differ)."""
        every = self.path is not None and "{rank}" in self.path
        if not self.path or (self.rank != 0 and not every) or not torch.cuda.is_available():
            return
        dev = self._device()
        free, total = torch.cuda.mem_get_info(dev)
        versions = {"torch": torch.__version__}
        for name in ("transformers", "accelerate", "lightning", "deepspeed"):
            try:
                versions[name] = __import__(name).__version__
            except Exception:  # noqa: BLE001 - not installed
                pass
        self.truth.update(extra, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                          max_memory_allocated=torch.cuda.max_memory_allocated(dev),
                          max_memory_reserved=torch.cuda.max_memory_reserved(dev),
                          gpu_total_memory_bytes=int(total), device_free_at_end_bytes=int(free),
                          alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"),
                          **versions)
        with open(self.path.replace("{rank}", str(self.rank)), "w") as f:
            json.dump(self.truth, f, indent=1)


class EveryOptimizerTruth(GroundTruth):
    """:class:`GroundTruth` for a job with several optimizers (a GAN) or weights no optimizer steps (a frozen
    teacher, an EMA copy, a momentum encoder, a reference model, LoRA's frozen base), counted per distinct storage:

    - ``parameters_bytes``: the parameters of every optimizer seen so far, at each pre-step hook (the largest);
    - ``gradients_bytes``: the ``.grad`` of every seen optimizer's parameters at each pre-step hook (the largest: at a
      GAN's generator step the discriminator's gradients from the generator's loss are held too);
    - ``optimizer_state_bytes``: the state tensors of every seen optimizer at each post-step hook (the largest);
    - ``held``: what the job keeps besides them, noted by :meth:`hold` (``{name: {"bytes", "kind"}}``, ``kind``:
      ``weight_copy`` or ``buffers``, what the accounting should call it), and ``weight_copy_bytes`` /
      ``buffers_bytes``, their sums per kind.
    """

    def __init__(self, path: str | None, **config: Any) -> None:
        super().__init__(path, **config)
        self.optimizers: list[Any] = []
        self.truth["held"] = {}

    def _all(self, opt) -> list[Any]:
        if all(o is not opt for o in self.optimizers):
            self.optimizers.append(opt)
        return self.optimizers

    def _pre(self, opt, args, kwargs) -> None:
        dev = self._device()
        params = [p for o in self._all(opt) for g in o.param_groups for p in g["params"]]
        self.truth["parameters_bytes"] = max(self.truth["parameters_bytes"], sum(_storages(params, dev).values()))
        grads = [p.grad for p in params if p.grad is not None]
        self.truth["gradients_bytes"] = max(self.truth["gradients_bytes"], sum(_storages(grads, dev).values()))
        self.truth.setdefault("allocated_at_first_step_start_bytes", torch.cuda.memory_allocated(dev))

    def _post(self, opt, args, kwargs) -> None:
        state = [v for o in self._all(opt) for st in o.state.values() if isinstance(st, dict) for v in st.values()]
        state = [v for v in state if isinstance(v, torch.Tensor)]
        self.truth["optimizer_state_bytes"] = max(self.truth["optimizer_state_bytes"],
                                                  sum(_storages(state, self._device()).values()))
        self.truth["optimizer_steps"] += 1

    def hold(self, name: str, tensors, kind: str) -> None:
        """Note ``tensors`` (on this rank's GPU) as held by the job besides the model state, under ``name``."""
        n = sum(_storages(list(tensors), self._device()).values()) if torch.cuda.is_available() else 0
        self.truth["held"][name] = {"bytes": n, "kind": kind}
        for k in ("weight_copy", "buffers"):
            self.truth[f"{k}_bytes"] = sum(v["bytes"] for v in self.truth["held"].values() if v["kind"] == k)
