"""Issue 50, items 1-3: training scripts as people write them, traced unmodified (``tests/data/preflight_scripts``):
the host runs for real (numpy memmaps, host ``torch.randint``, DataLoader workers, timm's build-time ``.item()``,
Trainer's ``randperm().tolist()``), only the GPU is fake, and every value read from the GPU is a stand-in listed
with its line (``invented_values``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from oomdoctor.cli.main import main  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "data" / "preflight_scripts"


def _run(capsys, *argv, opts=()):
    rc = main(["preflight", "--format", "json", *opts, "--", "python", *argv])
    cap = capsys.readouterr()
    assert rc == 0, cap.err[-2000:]
    return json.loads(cap.out)


def _invented(out):
    return {(Path(v["file"]).name, v["kind"], v["read"]) for v in out["invented_values"]}


def test_a_minimal_gpt_trainer_with_a_memmap_loader_and_fp16_gradscaler(capsys, tmp_path):
    """Host ``torch.randint`` indices slicing a numpy memmap (real), fp16 autocast with GradScaler: its
    ``found_inf`` is 0 (the fused AdamW takes it as a tensor, the for-loop one reads it), so every optimizer step
    runs (3 traced); ``loss.item()`` is a finite stand-in, listed at its line."""
    for fused in ("1", "0"):
        snap = tmp_path / f"g{fused}.pickle"
        out = _run(capsys, str(SCRIPTS / "gpt_memmap.py"), "--fused", fused, opts=("--steps", "3", "-o", str(snap)))
        meta = json.loads(snap.with_name(f"g{fused}.meta.json").read_text())
        assert [t["step"] for t in meta["tensors"]] == [0, 1, 2]
        got = _invented(out)
        assert ("gpt_memmap.py", "finite", "item") in got  # loss.item() in the log line
        assert (("gpt_memmap.py", "false", "item") in got) == (fused == "0")  # scaler.step reads found_inf: 0
        assert out["breakdown"]["optimizer_state"] > 0 and not out["oom"]


def test_a_transformer_encoder_with_loader_workers_streams_and_a_mask(capsys):
    """DataLoader with 2 worker processes and pinned memory, ``torch.accelerator``, side streams, events and a
    CUDA graph (no-ops, said), ``h[~pad]`` traced at its upper bound, accuracy from ``.sum().item()`` (a count of
    a boolean tensor: its size)."""
    out = _run(capsys, str(SCRIPTS / "encoder_loader.py"), "--workers", "2")
    got = _invented(out)
    assert ("encoder_loader.py", "upper_bound", "mask index") in got
    assert ("encoder_loader.py", "upper_bound", "item") in got  # (pred == y).sum().item(): the batch size
    assert {"cuda_streams", "cuda_graph"} <= set(out["not_traced"])


@pytest.mark.parametrize("flag", ["", "--torchvision"])
def test_timm_and_torchvision_vits_build_on_the_host(flag, capsys):
    pytest.importorskip("timm")
    pytest.importorskip("torchvision")
    out = _run(capsys, str(SCRIPTS / "timm_vit.py"), *([flag] if flag else []))
    assert out["breakdown"]["parameters"] > 1 << 20 and not out["oom"]
    assert ("timm_vit.py", "finite", "item") in _invented(out)


def test_a_hugging_face_trainer_script(capsys, tmp_path):
    """Trainer's RandomSampler (``randperm().tolist()`` on the host, real) and its loss filter
    (``isnan(tr_loss_step) or isinf(...)``, False: listed at transformers' own line).

    The model state is the sidecar's: the peak (allocated) is where step 1's backward begins (the logits'
    gradient), after Trainer's ``zero_grad(set_to_none=True)`` freed step 0's ``.grad``s: the parameters are all
    there and no gradient is (a 4-byte scalar kept by the backward was counted as one before issue 54's rule, a
    gradient has a trained parameter's size); at each optimizer step every gradient the sidecar lists is alive and
    counted as one, in ``diagnose`` of the snapshot preflight wrote."""
    pytest.importorskip("transformers")
    snap = tmp_path / "t.pickle"
    out = _run(capsys, str(SCRIPTS / "hf_trainer.py"), opts=("-o", str(snap)))
    got = _invented(out)
    assert ("trainer.py", "false", "bool") in got
    meta = json.loads(snap.with_name("t.meta.json").read_text())
    params, grads = ({n for rec in meta["tensors"] for n in (sum(s for _, s in rec[kind]),)}
                     for kind in ("parameters", "gradients"))
    assert len(params) == len(grads) == 1 and params == grads  # every parameter trained, fp32 gradients
    (param_bytes,), (grad_bytes,) = params, grads
    peak = out["breakdown"]
    assert (out["breakdown_at"]["step"], out["breakdown_at"]["phase"]) == (1, "backward")
    assert (peak["parameters"], peak["gradients"]) == (param_bytes, 0)
    assert main(["diagnose", str(snap), "--format", "json", "-o", str(tmp_path / "d.json")]) == 0
    r = json.loads((tmp_path / "d.json").read_text())["ranks"][0]
    at_steps = [b["categories"]["gradients"] for b in r["breakdowns"] if b["at"] == "optimizer_start"]
    assert at_steps == [grad_bytes] * len(meta["tensors"])


@pytest.mark.parametrize("reentrant", [False, True])
def test_peft_lora_with_checkpointing(reentrant, capsys):
    """PEFT LoRA, gradient checkpointing non-reentrant (failed with CheckpointError before: the recomputation
    lacked CUDA's policies) and reentrant; AdamW over the adapters only."""
    pytest.importorskip("peft")
    out = _run(capsys, str(SCRIPTS / "peft_lora.py"), *(["--reentrant"] if reentrant else []))
    # the optimizer holds the adapters only (their parameters, as recorded) and AdamW's two states of each; the
    # frozen base weights are on the GPU too (the peak holds them), not the optimizer's: a weight copy named by its
    # module, from the sidecar's module record as the recorder notes it on a GPU (GPT-2 2 x 128: 541,184 fp32
    # weights; the adapters r=8 on c_attn and both c_proj: 22,528)
    bd = out["breakdown"]
    assert (bd["parameters"], bd["weight_copy"]) == (22528 * 4, 541184 * 4)
    assert bd["optimizer_state"] == 2 * bd["parameters"]  # step counters: host
    assert out["peak_allocated_bytes"] > 100 * bd["parameters"]


def test_torch_compile_is_traced_eager_and_said(capsys):
    out = _run(capsys, str(SCRIPTS / "compiled.py"))
    assert "torch_compile" in out["not_traced"] and out["breakdown"]["parameters"] > 0


def test_the_rank_asked_for_is_traced(tmp_path, capsys):
    """``--nproc-per-node 2 --rank 1``: the script sees RANK=1 and LOCAL_RANK=1 and the output says rank 1."""
    f = tmp_path / "ranked.py"
    f.write_text("import os, torch, torch.distributed as dist\n"
                 "dist.init_process_group('nccl')\n"
                 "assert dist.get_rank() == int(os.environ['RANK']) == int(os.environ['LOCAL_RANK']) == 1\n"
                 "m = torch.nn.Linear(64, 64).cuda()\n"
                 "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                 "for _ in range(3):\n"
                 "    m(torch.randn(8, 64, device='cuda')).sum().backward(); o.step()\n")
    out = _run(capsys, str(f), opts=("--nproc-per-node", "2", "--rank", "1"))
    assert out["job"]["ranks_traced"] == [1]
    assert main(["preflight", "--nproc-per-node", "2", "--rank", "2", "--", "python", str(f)]) == 2


def test_an_optimizer_built_before_the_model_moves_keeps_its_parameters(tmp_path, capsys):
    """Fabric's ``setup(model, optimizer)`` and accelerate's ``prepare`` move a model its optimizer already holds:
    on CUDA ``param.data = param.cuda()`` keeps each parameter the same object, so the optimizer steps the GPU's
    parameters and its state is on the GPU. Traced, the moved parameters must stay the optimizer's (before: new
    ``Parameter`` objects, the step ran on the host copies and no Adam state was traced)."""
    f = tmp_path / "optimizer_first.py"
    f.write_text("import torch\n"
                 "m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))\n"
                 "o = torch.optim.Adam(m.parameters(), lr=1e-3)\n"
                 "w = m[0].weight\n"
                 "m.to('cuda')\n"
                 "assert m[0].weight is w and o.param_groups[0]['params'][0] is w and w.is_cuda\n"
                 "for _ in range(3):\n"
                 "    m(torch.randn(32, 256, device='cuda')).sum().backward(); o.step(); o.zero_grad()\n")
    snap = tmp_path / "s.pickle"
    out = _run(capsys, str(f), opts=("-o", str(snap)))
    params = (256 * 1024 + 1024 + 1024 * 256 + 256) * 4
    assert out["breakdown"]["parameters"] == params
    meta = json.loads(snap.with_name("s.meta.json").read_text())
    last = meta["tensors"][-1]
    assert sum(n for _, n in last["parameters"]) == params
    assert sum(n for _, n in last["optimizer_state"]) >= 2 * params  # exp_avg and exp_avg_sq


def test_a_host_value_copied_to_the_gpu_is_known_and_a_write_forgets_it(tmp_path, capsys):
    """An all-ones attention mask copied from the host is known: ``mask.all()`` is True as on the GPU, and not a
    stand-in (before: False, and Hugging Face built the masks the GPU skips: the T5 miss). A value written through
    a view is forgotten: ``x[3] = 1`` on a zero tensor, ``x.sum()`` is no longer 0 (a stand-in, listed)."""
    f = tmp_path / "known.py"
    f.write_text("import torch\n"
                 "m = torch.nn.Linear(64, 64).cuda()\n"
                 "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                 "mask = torch.ones(8, 128, dtype=torch.long).to('cuda')\n"
                 "x = torch.zeros(16, device='cuda')\n"
                 "x[3] = 1\n"
                 "for _ in range(2):\n"
                 "    keep = [] if mask.all() else [torch.empty(1 << 26, device='cuda')]\n"
                 "    keep += [torch.empty(1 << 25, device='cuda')] if x.sum().item() == 0 else []\n"
                 "    m(torch.randn(8, 64, device='cuda')).sum().backward(); o.step()\n")
    out = _run(capsys, str(f))
    assert out["peak_allocated_bytes"] < 1 << 27  # neither 256 MiB nor 128 MiB block was made
    assert _invented(out) == {("known.py", "finite", "item")}  # x.sum(): a stand-in; mask.all(): exact


def test_small_known_tensors_are_computed_and_libraries_see_gpu_tensors(tmp_path, capsys):
    """Values known one by one (a host copy of token ids, a position ``arange``) are carried through ops: a
    data-dependent shape of them is exact (``nonzero`` of ``ids != -100``: 3 rows, not the upper bound), a packed-
    sequence check on positions is answered as the GPU answers it, ``tolist()`` returns the ids. transformers'
    ``is_tracing`` does not count the GPU's tensors as tracing while the script runs, and is restored after."""
    pytest.importorskip("transformers")
    import transformers.utils.import_utils as iu

    before = iu.is_fake_tensor
    f = tmp_path / "shadows.py"
    f.write_text("import torch\n"
                 "from transformers.utils.import_utils import is_tracing\n"
                 "m = torch.nn.Linear(64, 64).cuda()\n"
                 "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                 "ids = torch.tensor([[5, 7, -100, 9]]).to('cuda')\n"
                 "assert not is_tracing(ids)\n"
                 "assert ids.tolist() == [[5, 7, -100, 9]]\n"
                 "rows = (ids != -100).nonzero()\n"
                 "assert rows.shape == (3, 2), rows.shape\n"
                 "pos = torch.arange(128, device='cuda')[None]\n"
                 "packed = (torch.diff(pos, prepend=pos[:, :1] - 1) != 1).cumsum(-1)\n"
                 "assert bool((packed[:, -1] == 0).all())\n"
                 "assert torch.equal(ids, torch.tensor([[5, 7, -100, 9]], device='cuda'))\n"
                 "assert not torch.equal(ids, ids + 1)\n"
                 "for _ in range(2):\n"
                 "    m(torch.randn(8, 64, device='cuda')).sum().backward(); o.step()\n")
    out = _run(capsys, str(f))
    assert out["invented_values"] == []
    assert iu.is_fake_tensor is before


def test_a_tensor_parallel_script_sees_the_nodes_gpus_and_its_mesh_joins_the_fake_group(tmp_path, capsys):
    """``--nproc-per-node 2``: the node has 2 GPUs for ``torch.cuda`` and ``torch.accelerator`` (pytorch/examples'
    tensor-parallel example exits before any step with fewer), and ``init_device_mesh`` joins the fake process group
    (it calls ``init_process_group`` from ``distributed_c10d``: before, it waited for rank 1 in a TCP store). The
    shards are traced: ColwiseParallel halves the first layer, RowwiseParallel the second's weight."""
    f = tmp_path / "tp.py"
    f.write_text("import torch\n"
                 "from torch.distributed.device_mesh import init_device_mesh\n"
                 "from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel\n"
                 "assert torch.cuda.device_count() == 2 and torch.accelerator.device_count() == 2\n"
                 "assert torch.accelerator.is_available()\n"
                 "mesh = init_device_mesh('cuda', (2,))\n"
                 "m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).to('cuda')\n"
                 "m = parallelize_module(m, mesh, {'0': ColwiseParallel(), '2': RowwiseParallel()})\n"
                 "o = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=True)\n"
                 "for _ in range(3):\n"
                 "    m(torch.rand(8, 64, device='cuda')).sum().backward(); o.step(); o.zero_grad()\n")
    out = _run(capsys, str(f), opts=("--nproc-per-node", "2"))
    assert out["breakdown"]["parameters"] == ((128 * 64 + 128) + (64 * 128 + 64)) * 4


def test_what_runs_after_the_last_step_is_not_traced(tmp_path, capsys):
    """A framework that catches the stop (Lightning's ``_call_and_handle_interrupt`` catches BaseException and tears
    down: ``model.cpu()``) runs on after the K-th step: nothing it does is recorded (the trace ends at the step, as a
    snapshot dumped there), and moving the GPU's parameters to the host does not fail (before: "Couldn't swap")."""
    f = tmp_path / "teardown.py"
    f.write_text("import torch\n"
                 "m = torch.nn.Linear(256, 256).cuda()\n"
                 "o = torch.optim.Adam(m.parameters())\n"
                 "try:\n"
                 "    for _ in range(5):\n"
                 "        m(torch.randn(8, 256, device='cuda')).sum().backward(); o.step()\n"
                 "except BaseException:\n"
                 "    keep = torch.empty(1 << 28, device='cuda')\n"
                 "    m.cpu()\n"
                 "    raise\n")
    out = _run(capsys, str(f), opts=("--steps", "2"))
    assert out["peak_allocated_bytes"] < 1 << 28
    assert out["breakdown"]["optimizer_state"] > 0


def test_a_scripts_own_error_is_said_as_its_own(tmp_path, capsys):
    """A script that fails in its own code (minGPT's chargpt: a character missing from its table, KeyError at its
    line, on the GPU too) is refused with its line, named as the script's error, not a limit of tracing."""
    f = tmp_path / "own.py"
    f.write_text("import torch\n"
                 "m = torch.nn.Linear(8, 8).cuda()\n"
                 "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                 "m(torch.randn(2, 8, device='cuda')).sum().backward(); o.step()\n"
                 "table = {'a': 1}\n"
                 "x = table[',']\n")
    assert main(["preflight", "--steps", "3", "--", "python", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{f}:6: the script raised KeyError" in err and "not a limit of tracing" in err
    assert "after 1 optimizer step(s) traced" in err


def test_a_scripts_stacks_end_at_its_own_module_whoever_runs_preflight(capsys, tmp_path):
    """The snapshot's stacks are the job's as ``python train.py`` has them on a GPU: outermost the script's
    ``<module>``, never the frames of whoever called preflight (the CLI, click, or this test and pytest: with them
    the HF Trainer script's second step's gradients were read as workspaces under pytest only)."""
    script = tmp_path / "tiny.py"
    script.write_text("import torch\n"
                      "m = torch.nn.Linear(64, 64).cuda()\n"
                      "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for _ in range(2):\n"
                      "    m(torch.randn(8, 64, device='cuda')).sum().backward()\n"
                      "    opt.step()\n"
                      "    opt.zero_grad()\n")
    snap = tmp_path / "tiny.pickle"
    _run(capsys, str(script), opts=("-o", str(snap)))
    import pickle

    events = pickle.loads(snap.read_bytes())["device_traces"][0]
    outer = {(Path(e["frames"][-1]["filename"]).name, e["frames"][-1]["name"]) for e in events if e.get("frames")}
    assert outer == {("tiny.py", "<module>")}, outer


def test_a_module_moved_to_a_plain_device_index(capsys, tmp_path):
    """``model.to(self.gpu_id)`` with an int (pytorch/examples' DDP tutorial): C's ``_parse_to`` resolves an index
    to the current accelerator, which a CPU build has none of ("Cannot access accelerator device"); read as
    ``cuda:<index>``, as on a CUDA machine. The Linear's 1,088 bytes are the parameters. (A factory's or ``.to``'s
    ``device=0`` keyword is left as it was: accelerate's ``device_map="auto"`` probes each GPU with one, then loads
    in worker threads, where no mode runs.)"""
    script = tmp_path / "to_index.py"
    script.write_text("import torch\n"
                      "m = torch.nn.Linear(16, 16).to(0)\n"
                      "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for _ in range(2):\n"
                      "    m(torch.randn(4, 16).to(0)).sum().backward()\n"
                      "    opt.step()\n"
                      "    opt.zero_grad()\n")
    out = _run(capsys, str(script))
    assert out["breakdown"]["parameters"] == (16 * 16 + 16) * 4


def test_fsdp2_built_on_meta_then_to_empty(capsys, tmp_path):
    """FSDP2 as its example builds it: on the meta device, ``fully_shard`` per layer, then ``to_empty(device=
    "cuda")`` (pytorch/examples' FSDP2). The parameters are DTensors whose shards are fake: swapped as the shards are
    (before: "_apply(): Couldn't swap FSDPEmbedding.weight"). Rank 0 holds half of each parameter: (100 x 32 +
    32 x 32 + 32) x 4 B / 2 = 8,512 B, its gradients as much, AdamW's two states twice that."""
    script = tmp_path / "fsdp_empty.py"
    script.write_text("import os, torch, torch.distributed as dist\n"
                      "from torch.distributed.fsdp import fully_shard\n"
                      "dist.init_process_group('nccl')\n"
                      "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
                      "with torch.device('meta'):\n"
                      "    m = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 32))\n"
                      "for layer in m:\n"
                      "    fully_shard(layer)\n"
                      "fully_shard(m)\n"
                      "m.to_empty(device='cuda')\n"
                      "for p in m.parameters():\n"
                      "    torch.nn.init.ones_(p)\n"
                      "opt = torch.optim.AdamW(m.parameters(), lr=1e-3)\n"
                      "for _ in range(2):\n"
                      "    m(torch.randint(0, 100, (4, 8), device='cuda')).sum().backward()\n"
                      "    opt.step()\n"
                      "    opt.zero_grad()\n")
    bd = _run(capsys, str(script), opts=("--nproc-per-node", "2"))["breakdown"]
    assert (bd["parameters"], bd["optimizer_state"]) == (8512, 2 * 8512)
    # the peak is in the backward, where each layer's gathered parameters come back (FSDP2 frees them after
    # forward: AllocationTracer.resized): the embedding's sharded gradient is not made yet, the Linear's is
    assert bd["gradients"] == (32 * 32 + 32) * 4 // 2


def test_data_parallel_on_one_gpu(capsys, tmp_path):
    """``nn.DataParallel`` (pytorch/examples' imagenet ``main.py``): its forward scatters the inputs with
    ``torch._C._scatter``, which a CPU build lacks (before: AttributeError at the model's call). On one GPU the
    input goes to it whole; the Linear's 1,088 B are the parameters, and its gradients as much."""
    script = tmp_path / "dp.py"
    script.write_text("import torch\n"
                      "m = torch.nn.DataParallel(torch.nn.Linear(16, 16).cuda())\n"
                      "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for _ in range(2):\n"
                      "    m(torch.randn(4, 16).cuda(non_blocking=True)).sum().backward()\n"
                      "    opt.step()\n"
                      "    opt.zero_grad()\n")
    bd = _run(capsys, str(script))["breakdown"]
    assert (bd["parameters"], bd["gradients"]) == (1088, 1088)


def test_fail_on_oom_gates_a_predicted_out_of_memory(capsys, tmp_path):
    """``--fail-on-oom``: exit 1 and one line naming the request and the room when the traced step does not fit;
    exit 0 when it does, and without the flag whatever the prediction."""
    f = tmp_path / "big.py"
    f.write_text("import torch\nm = torch.nn.Linear(4096, 4096).cuda()\nopt = torch.optim.SGD(m.parameters())\n"
                 "for _ in range(2):\n    x = torch.randn(65536, 4096, device='cuda')\n"
                 "    m(x).sum().backward()\n    opt.step()\n    opt.zero_grad()\n")
    small = ["--gpu-memory", "2GiB"]
    assert main(["preflight", *small, "--fail-on-oom", "--", "python", str(f)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("oomdoctor: --fail-on-oom: the traced job runs out of memory")
    assert "did not fit in the allocator's room of" in err[0]
    assert main(["preflight", *small, "--", "python", str(f)]) == 0  # no gate asked
    capsys.readouterr()
    assert main(["preflight", "--gpu", "H200", "--fail-on-oom", "--", "python", str(f)]) == 0  # fits on an H200
    assert capsys.readouterr().err.strip() == ""


def test_an_oom_names_the_scripts_line_that_made_the_request(capsys, tmp_path):
    """A new user could not tell which request ran out of memory: the answer names the line of the job's own code
    that made it (``oom_site``: the innermost frame outside the Python installation), in JSON and in the text."""
    f = tmp_path / "big.py"
    f.write_text("import torch\nm = torch.nn.Linear(4096, 4096).cuda()\nopt = torch.optim.SGD(m.parameters())\n"
                 "for _ in range(2):\n"
                 "    x = torch.randn(65536, 4096, device='cuda')\n"
                 "    m(x).sum().backward()\n"
                 "    opt.step()\n")
    rc = main(["preflight", "--gpu-memory", "2GiB", "--format", "json", "--", "python", str(f)])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["oom"] is True and doc["schema_version"] == "2.2"
    assert doc["oom_site"]["file"] == str(f) and doc["oom_site"]["line"] in (5, 6)
    main(["preflight", "--gpu-memory", "2GiB", "--", "python", str(f)])
    out = capsys.readouterr().out
    assert f"made at {f}:{doc['oom_site']['line']}" in " ".join(out.split())


def _peak(capsys, script) -> int:
    assert main(["preflight", "--format", "json", "--no-search", "--", "python", str(script)]) == 0
    return json.loads(capsys.readouterr().out)["peak_allocated_bytes"]


@pytest.mark.parametrize("where", ["cpu", "cuda", None])
def test_torch_load_reads_on_the_host_and_places_on_the_gpu_what_it_would(capsys, tmp_path, where):
    """``torch.load`` runs on the real host: a checkpoint loaded to the host goes into a host model (before: meta
    tensors, "Cannot copy out of meta tensor" in ``load_state_dict``; torchvision's pretrained weights, the corpus's
    similarity and fast_neural_style scripts); ``map_location="cuda"`` makes fake GPU tensors, their bytes traced."""
    ckpt = tmp_path / "w.pt"
    torch.save({"w": torch.zeros(8192, 8192), "lin": torch.nn.Linear(64, 64).state_dict()}, ckpt)
    f = tmp_path / "load.py"
    loc = repr(where) if where else "None"
    f.write_text("import torch\n"
                 f"sd = torch.load({str(ckpt)!r}, map_location={loc})\n"
                 "m = torch.nn.Linear(64, 64)\nm.load_state_dict(sd['lin'])\nm = m.cuda()\n"
                 "opt = torch.optim.SGD(m.parameters())\n"
                 "for _ in range(2):\n    m(torch.randn(8, 64, device='cuda')).sum().backward()\n    opt.step()\n"
                 "assert sd['w'].is_cuda == (" + repr(where == "cuda") + ")\n")
    peak = _peak(capsys, f)
    big = 8192 * 8192 * 4  # 256 MiB; the rest of the job (cuBLAS's workspaces included) is under 100 MiB
    assert (peak >= big) is (where == "cuda")  # only the GPU's copy of the tensor is on the GPU


def test_a_single_process_group_of_ones_own_runs_on_the_fake_one(capsys, tmp_path):
    """A script that starts a process group of one by itself (DINO: ``init_process_group("nccl")``, rank 0 of 1, no
    launcher) runs on the fake process group: a CPU build of torch has no NCCL. No launcher variable is set."""
    f = tmp_path / "one.py"
    f.write_text("import os, torch, torch.distributed as dist\n"
                 "assert 'WORLD_SIZE' not in os.environ\n"
                 "dist.init_process_group(backend='nccl', init_method='env://', world_size=1, rank=0)\n"
                 "m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64).cuda(), device_ids=[0])\n"
                 "opt = torch.optim.SGD(m.parameters())\n"
                 "for _ in range(2):\n    loss = m(torch.randn(8, 64, device='cuda')).sum()\n"
                 "    dist.all_reduce(loss.detach().clone())\n    loss.backward()\n    opt.step()\n")
    assert _peak(capsys, f) > 0


def test_a_weight_normed_head_moves_to_the_gpu(capsys, tmp_path):
    """``nn.utils.weight_norm`` (DINO's head): the weight computed at construction keeps ``weight_v`` and
    ``weight_g`` referenced by its graph, so ``swap_tensors`` refuses them in ``.cuda()``; before, the parameters
    became meta tensors and the first forward failed ("its data is not allocated yet")."""
    f = tmp_path / "wn.py"
    f.write_text("import torch, torch.nn as nn\n"
                 "def head():\n    l = nn.utils.weight_norm(nn.Linear(64, 128, bias=False))\n"
                 "    l.weight_g.data.fill_(1)\n    return l\n"
                 "s, t = head().cuda(), head().cuda()\n"
                 "assert s.weight_v.is_cuda and s.weight_g.is_cuda\n"
                 "t.load_state_dict(s.state_dict())\n"
                 "opt = torch.optim.SGD(s.parameters())\n"
                 "for _ in range(2):\n    x = torch.randn(8, 64, device='cuda')\n"
                 "    (s(x).sum() + t(x).sum()).backward()\n    opt.step()\n")
    assert _peak(capsys, f) > 0


# H200 truths of the two scripts below (benchmarks/device/round16_truths.sh; raw in
# docs/device_runs/round16-truths.tar.xz): torch.cuda.max_memory_allocated / max_memory_reserved after 2 optimizer
# steps, read by the corpus's step hook, the scripts unchanged
SPARSE_DELTA_H200 = (69_731_328, 71_303_168)
FSDP2_RESET_1_H200 = (88_294_400, 109_051_904)


def test_a_sparse_delta_weights_gradient_is_traced_to_the_byte(capsys):
    """peft SHiRA's adapters: ``torch.sparse_coo_tensor`` of fixed indices and a trained vector, added to a dense
    weight. Its backward masks the dense gradient with the sparse tensor (``sparse_mask``), which the fake mode
    gave no values (before: "SparseCooTensorWithDimsAndTensorsBackward0 returned an invalid gradient at index 0 -
    got [0] but expected shape compatible with [4096]"). Traced, both peaks are the H200's."""
    out = _run(capsys, str(SCRIPTS / "sparse_delta.py"), opts=("--gpu", "H200"))
    assert (out["peak_allocated_bytes"], out["peak_reserved_bytes"]) == SPARSE_DELTA_H200


def test_fsdp2_reset_parameters_fills_the_shards_and_frees_the_gathered_parameters(capsys):
    """pytorch/examples' FSDP2 on one GPU (``torchrun --nproc-per-node 1``): built on meta, ``to_empty``, then
    ``reset_parameters()``, whose ``nn.init`` fills the DTensor shards at random (before: DTensor's generator path
    needed ``torch._C._cuda_getDevice``, then a CUDA generator a CPU build lacks). Three rules meet here, each
    measured on the H200's snapshot of this script:
    - the optimizer's in-place updates of DTensors copy nothing in (before: each DTensor argument was taken for a
      host tensor copied to the GPU: +10% allocated);
    - FSDP2 frees a gathered parameter's storage after forward (``resize_(0)``) and gives it back in backward:
      freed and allocated again, as on the GPU (before: kept to the step's end, +3.5%);
    - ``--nproc-per-node 1`` sets torchrun's variables (before: ``KeyError: 'LOCAL_RANK'``).
    Allocated is the H200's to the byte; reserved within 2%."""
    out = _run(capsys, str(SCRIPTS / "fsdp2_reset.py"), opts=("--gpu", "H200", "--nproc-per-node", "1"))
    assert out["peak_allocated_bytes"] == FSDP2_RESET_1_H200[0]
    assert abs(out["peak_reserved_bytes"] - FSDP2_RESET_1_H200[1]) <= 0.02 * FSDP2_RESET_1_H200[1]
    assert out["breakdown"]["communication"] == 0  # the gathered parameters freed after use, none at the peak
    two = _run(capsys, str(SCRIPTS / "fsdp2_reset.py"), opts=("--gpu", "H200", "--nproc-per-node", "2"))
    assert two["breakdown"]["parameters"] * 2 == out["breakdown"]["parameters"]  # rank 0 holds half of each


def test_a_storage_resized_in_place_is_freed_and_allocated_again():
    """:meth:`AllocationTracer.resized`: a GPU storage resized to 0 is a free, given bytes again an allocation of the
    new size; the host's storages are not the trace's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomdoctor.preflight.tracer import AllocationTracer

    tracer = AllocationTracer()
    with FakeTensorMode(), tracer:
        t = torch.empty(1024, dtype=torch.float32)
    st = t.untyped_storage()
    n = len(tracer.record.events)
    tracer.resized(st, 0)
    tracer.resized(st, 0)  # already empty: nothing
    tracer.resized(st, 8192)
    tracer.resized(torch.empty(16).untyped_storage(), 0)  # a storage never seen: nothing
    got = [(e["action"], e["size"]) for e in tracer.record.events[n:]]
    assert got == [("free_requested", 4096), ("free_completed", 4096), ("alloc", 8192)]
