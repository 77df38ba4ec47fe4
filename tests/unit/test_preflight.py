"""Preflight (issue 42): the tracer's bytes against hand derivations, the CUDA behaviour applied over fake CPU
tensors, a Hugging Face GPT-2 (2 layers, 128 wide, built from GPT2Config: no download) end to end through
``oomdoctor preflight``, ``diagnose`` and ``simulate``, and the largest micro-batch search."""

from __future__ import annotations

import json
import pickle

import pytest

torch = pytest.importorskip("torch")

from oomdoctor.cli.main import main  # noqa: E402
from oomdoctor.preflight.steps import trace_module  # noqa: E402
from oomdoctor.preflight.tracer import AllocationTracer, run_traced  # noqa: E402
from oomdoctor.report.preflight import Replayed, largest_micro_batch, margin_bytes  # noqa: E402


def _peak(events):
    cur = peak = 0
    for e in events:
        if e["action"] == "alloc":
            cur += e["size"]
            peak = max(peak, cur)
        elif e["action"] == "free_completed":
            cur -= e["size"]
    return peak, cur


# -- the tracer on a model small enough to derive by hand ------------------------------------------------

def _linear_step(model, opt, batch):
    loss = model(batch).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_linear_adamw_peak_equals_the_hand_derivation():
    """Linear(1024, 1024) + AdamW (foreach, as CUDA picks it), input 64 x 1024 fp32, 2 steps.

    P = 1024*1024*4 + 1024*4 = 4,198,400 bytes of parameters. The peak is inside the first optimizer
    step, when ``_multi_tensor_adam`` holds ``_foreach_sqrt(exp_avg_sq)``'s outputs (P) while
    parameters (P), gradients (P), ``exp_avg`` and ``exp_avg_sq`` (2P) live: 5P, plus the input
    (64*1024*4 = 262,144, held by the step's ``batch``), the loss (4) and two ``step`` counters (4 each)
    of the two parameters. The forward's output (262,144) died at ``.sum()`` (sum's backward keeps no
    tensor)."""
    rec = trace_module(lambda: torch.nn.Linear(1024, 1024), _linear_step, lambda: torch.randn(64, 1024),
                       optimizer_fn=lambda m: torch.optim.AdamW(m.parameters()), steps=2)
    P = 1024 * 1024 * 4 + 1024 * 4
    peak, end = _peak(rec.events)
    assert peak == 5 * P + 64 * 1024 * 4 + 4 + 2 * 4
    # at the end: parameters and optimizer state (2P + two counters); gradients set to None
    assert end == P + 2 * P + 2 * 4
    last = rec.tensors[-1]
    assert sum(n for _, n in last["parameters"]) == P
    assert sum(n for _, n in last["optimizer_state"]) == 2 * P + 2 * 4
    assert last["gradients"] == []  # noted after step_fn returned: zero_grad set them to None


def test_every_free_matches_an_alloc_and_backward_keeps_no_frames():
    """Allocations inside backward carry no Python frame (on CUDA they run on the autograd engine's
    thread); each free names a live allocation, with its size."""
    rec = trace_module(lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)),
                       _linear_step, lambda: torch.randn(4, 64), steps=1)
    live = {}
    for e in rec.events:
        if e["action"] == "alloc":
            assert e["addr"] not in live and e["size"] > 0 and e["stream"] == 0
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_requested":
            assert live.get(e["addr"]) == e["size"]
        elif e["action"] == "free_completed":
            assert live.pop(e["addr"]) == e["size"]
    assert rec.backward_events > 0
    assert sum(1 for e in rec.events if e["action"] == "alloc" and not e["frames"]) >= rec.backward_events
    times = [e["time_us"] for e in rec.events]
    assert times == sorted(times) and len(set(times)) == len(times)


# -- CUDA's behaviour over fake CPU tensors ------------------------------------------------------------------

def _sizes(fn):
    rec = run_traced(lambda tr: fn())
    return [e["size"] for e in rec.events if e["action"] == "alloc"]


def test_cuda_autocast_list_runs_pow_in_fp32():
    """CUDA autocast runs ``pow`` in fp32 (``autocast_mode.cpp`` fp32 list); CPU autocast would not. Under
    bf16 autocast a linear's output is bf16 (2 bytes/element) and pow's output fp32 (4)."""
    def fn():
        lin = torch.nn.Linear(256, 256)
        x = torch.randn(8, 256)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
            z = torch.pow(y, 3.0)
        assert y.dtype == torch.bfloat16 and z.dtype == torch.float32
        return z
    sizes = _sizes(fn)
    assert 8 * 256 * 2 in sizes and 8 * 256 * 4 in sizes


def test_attention_saves_the_logsumexp_not_the_score_matrix():
    """bf16 SDPA goes to flash attention as on CUDA: forward and backward never hold a b x h x s x s
    matrix; the log-sum-exp (b x h x s fp32) is saved."""
    b, h, s, d = 1, 2, 512, 64

    def fn():
        q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
    sizes = _sizes(fn)
    assert max(sizes) < b * h * s * s * 2
    assert b * h * s * 4 in sizes  # the log-sum-exp


def test_fake_tensors_use_no_memory():
    """A 4 GiB parameter under the tracer: recorded, never allocated."""
    rec = run_traced(lambda tr: torch.empty(1 << 30, dtype=torch.float32))
    assert [e["size"] for e in rec.events if e["action"] == "alloc"] == [4 << 30]


def test_tracer_starts_clean():
    t = AllocationTracer()
    assert t.record.events == [] and t.record.backward_events == 0


# -- Hugging Face end to end ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("pf")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4)
    cfg.to_json_file(str(d / "config.json"))
    with torch.device("meta"):
        n_params = sum(p.numel() for p in transformers.GPT2LMHeadModel(cfg).parameters())
        n_tensors = len(list(transformers.GPT2LMHeadModel(cfg).parameters()))
    snap = d / "pf.pickle"
    out = d / "pf.json"
    rc = main(["preflight", "--hf-config", str(d / "config.json"), "--micro-batch", "2", "--seq-len", "64",
               "--gpu", "H100-80GB", "--no-search", "--format", "json", "-o", str(snap)])
    return {"rc": rc, "snap": snap, "dir": d, "n_params": n_params, "n_tensors": n_tensors, "out": out}


def test_hf_preflight_answers(tiny_gpt2, capsys):
    assert tiny_gpt2["rc"] == 0
    # the JSON went to stdout in the fixture: read the sidecar and the snapshot instead
    meta = json.loads(tiny_gpt2["snap"].with_name("pf.meta.json").read_text())
    assert meta["preflight"]["job"]["micro_batch"] == 2 and meta["gpu_total_memory_bytes"] == 81559 * 2**20
    snap = pickle.loads(tiny_gpt2["snap"].read_bytes())
    # laid out by the allocator model: segments, and segment entries before the requests that made them
    assert snap["segments"] and {"alloc", "free_requested", "free_completed", "segment_alloc"} <= {
        e["action"] for e in snap["device_traces"][0]}
    for seg in snap["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    # byte facts: the tracer knows the parameters, gradients and optimizer state
    last = meta["tensors"][-1]
    P = tiny_gpt2["n_params"] * 4
    assert sum(n for _, n in last["parameters"]) == P  # fp32 master weights (autocast), tied lm_head once
    assert sum(n for _, n in last["gradients"]) == P
    # fused AdamW: exp_avg and exp_avg_sq in fp32, and one fp32 step counter per parameter on the GPU
    assert sum(n for _, n in last["optimizer_state"]) == 2 * P + 4 * tiny_gpt2["n_tensors"]


def test_hf_preflight_json_keys(tiny_gpt2, capsys):
    rc = main(["preflight", "--hf-config", str(tiny_gpt2["dir"] / "config.json"), "--micro-batch", "2",
               "--seq-len", "64", "--gpu-memory", "80GiB", "--no-search", "--format", "json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    for k in ("peak_allocated_bytes", "peak_reserved_bytes", "oom", "largest_micro_batch", "breakdown"):
        assert k in got
    assert got["oom"] is False and got["gpu_total_bytes"] == 80 * 2**30
    assert got["peak_requested_bytes"] <= got["peak_allocated_bytes"] <= got["peak_reserved_bytes"]
    assert got["breakdown"]["parameters"] == tiny_gpt2["n_params"] * 4
    assert sum(got["breakdown"].values()) == got["breakdown_at"]["allocated_bytes"]
    assert {s["config"] for s in got["settings"]} >= {"(defaults)", "expandable_segments:True"}


def test_traced_snapshot_loads_in_diagnose_and_simulate(tiny_gpt2, capsys):
    assert main(["diagnose", str(tiny_gpt2["snap"]), "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ranks"][0]["peak_allocated_bytes"] > 0
    assert d["ranks"][0]["peak_reserved_bytes"] >= d["ranks"][0]["peak_allocated_bytes"] > 0
    assert main(["simulate", str(tiny_gpt2["snap"]), "--format", "json"]) == 0
    s = json.loads(capsys.readouterr().out)
    # the snapshot was laid out by the same model: its self-replay reproduces it exactly
    assert s["results"][0]["matches_recorded"] is True
    assert s["results"][0]["peak_reserved_bytes"] == d["ranks"][0]["peak_reserved_bytes"]


def test_an_unreadable_config_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    rc = main(["preflight", "--hf-config", str(bad), "--micro-batch", "1", "--seq-len", "8", "--no-search"])
    err = capsys.readouterr().err
    assert rc == 2 and str(bad) in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_an_oversized_job_is_an_oom(tiny_gpt2, tmp_path, capsys):
    snap = tmp_path / "oom.pickle"
    rc = main(["preflight", "--hf-config", str(tiny_gpt2["dir"] / "config.json"), "--micro-batch", "2",
               "--seq-len", "64", "--gpu-memory", "800MiB", "--no-search", "--format", "json", "-o", str(snap)])
    got = json.loads(capsys.readouterr().out)
    assert rc == 0 and got["oom"] is True and got["oom_request_bytes"] > 0
    # the written snapshot ends in the OOM, as one dumped at the failure does, and diagnose sees it
    events = pickle.loads(snap.read_bytes())["device_traces"][0]
    assert events[-1]["action"] == "oom" and events[-1]["size"] >= got["oom_request_bytes"]
    assert json.loads(snap.with_name("oom.meta.json").read_text())["oom"]["alloc_bytes"] == events[-1]["size"]
    assert main(["diagnose", str(snap), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0]["oom"]


# -- the largest micro-batch -----------------------------------------------------------------------------------

def _linear_job(room, fixed, per_sample, overhead, calls):
    def at(n):
        calls.append(n)
        alloc = fixed + per_sample * n
        return Replayed(n, alloc, alloc, alloc + overhead, alloc + overhead > room, None, 0, 0.0)
    return at


@pytest.mark.parametrize("room,fixed,per,first,want", [
    # the room keeps margin_bytes(1000) = 35 free: 100 + 10 n + 5 <= 965 up to n = 86 (89 replays without OOM)
    (1000, 100, 10, 8, 86), (1000, 100, 10, 200, 86), (1000, 950, 10, 1, 1), (1000, 1000, 10, 3, None)])
def test_largest_micro_batch_is_traced_and_the_next_is_not(room, fixed, per, first, want):
    calls: list[int] = []
    at = _linear_job(room, fixed, per, 5, calls)
    got, seen = largest_micro_batch(at, at(first), room)
    assert margin_bytes(room) == 35
    assert got == want
    if want is not None:
        assert want in calls and want + 1 in calls  # both sides traced, never a fit above what replays
    assert len(calls) <= 2 + 6 + 1


def test_ddp_buckets_hold_every_parameter_once():
    from oomdoctor.preflight.steps import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, ddp_buckets

    params = [torch.empty(n, device="meta") for n in (768, 768, 2_359_296, 768, 7_077_888, 768, 768)]
    got = ddp_buckets(params)
    assert sum(got) == sum(p.numel() * 4 for p in params)
    assert got[0] <= DDP_FIRST_BUCKET_BYTES
    assert all(b >= DDP_BUCKET_BYTES for b in got[1:-1])


def test_ddp_adds_its_buckets_and_output_clones(tiny_gpt2, capsys):
    """DDP (one rank of 2): the gradient buckets (the parameters' bytes) live from the start, so the end
    state holds them beside the model; and NCCL's buffers are outside the allocator."""
    def run(*extra):
        assert main(["preflight", "--hf-config", str(tiny_gpt2["dir"] / "config.json"), "--micro-batch", "2",
                     "--seq-len", "64", "--no-search", "--format", "json", *extra]) == 0
        return json.loads(capsys.readouterr().out)
    single, ddp = run(), run("--ddp", "2")
    P = tiny_gpt2["n_params"] * 4
    assert ddp["peak_requested_bytes"] >= single["peak_requested_bytes"] + P
    assert ddp["outside_allocator_bytes"] == single["outside_allocator_bytes"] + 880 * 10**6
    assert ddp["job"]["world_size"] == 2


def test_python_api_answers_for_any_module():
    """``oomdoctor.preflight(model_fn, step_fn, batch_fn, gpu=...)``: the package is callable; the largest
    micro-batch is a traced size that replays with the margin free, and the next size was traced and does not."""
    import oomdoctor
    from oomdoctor.preflight.snapshot import CUDA_CONTEXT_BYTES

    def model_fn():
        return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512))

    def step_fn(model, opt, batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    a = oomdoctor.preflight(model_fn, step_fn, lambda n: torch.randn(n, 512), gpu=CUDA_CONTEXT_BYTES + (200 << 20),
                            micro_batch=64)
    assert a.oom is False and a.breakdown["parameters"] == (512 * 512 + 512) * 2 * 4
    n = a.largest_micro_batch
    assert n is not None and n > 64
    traced = {t["micro_batch"]: t for t in a.micro_batch_traces}
    limit = a.room_bytes - a.largest_micro_batch_margin_bytes  # the size that fits keeps the margin free
    assert a.largest_micro_batch_margin_bytes == margin_bytes(a.room_bytes) > 0
    assert not traced[n]["oom"] and traced[n]["peak_reserved_bytes"] <= limit
    assert traced[n + 1]["oom"] or traced[n + 1]["peak_reserved_bytes"] > limit


def _ops_traced(monkeypatch, job):
    """The aten ops the tracer saw while tracing ``job`` (a :class:`HfJob`)."""
    from oomdoctor.preflight.steps import trace_hf

    seen: list = []
    orig = AllocationTracer.__torch_dispatch__

    def spy(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return orig(self, func, types, args, kwargs)

    monkeypatch.setattr(AllocationTracer, "__torch_dispatch__", spy)
    rec = trace_hf(job)
    return seen, rec


def test_checkpoint_recomputation_runs_cudas_attention(tiny_gpt2, monkeypatch):
    """Gradient checkpointing (non-reentrant, transformers 5's default): the autograd engine recomputes the
    blocks without the caller's TorchFunctionMode, so without ``checkpoint_kwargs``'s ``context_fn`` the
    recomputation ran CPU's math attention (``bmm`` of the b x h x s x s scores, ``_safe_softmax``) and
    CPU's dropout (``bernoulli_``). With it, every attention is CUDA's fused kernel (flash, or cuDNN's on the
    default sm90 target; forward and recomputation) and no score matrix is built."""
    from oomdoctor.preflight.steps import HfJob

    aten = torch.ops.aten
    seen, rec = _ops_traced(monkeypatch, HfJob(str(tiny_gpt2["dir"] / "config.json"), 2, 64,
                                               gradient_checkpointing=True, steps=1))
    fused = (seen.count(aten._scaled_dot_product_flash_attention.default)
             + seen.count(aten._scaled_dot_product_cudnn_attention.default))  # cuDNN's on sm90 with torch 2.11+
    assert fused == 2 * 2  # 2 layers: the checkpointed forward and the recomputation
    assert aten._safe_softmax.default not in seen and aten.bernoulli_.float not in seen
    assert rec.backward_events > 0


def test_accelerate_loop_accumulates_without_an_output_clone(tmp_path):
    """accelerate's loop (``--loop accelerate --grad-accum 2``): two forward/backward passes per optimizer
    step, the second adding into the gradients of the first (one gradient per parameter, traced once), no
    clipping, AdamW at its defaults (foreach: two states per parameter and a step counter each)."""
    transformers = pytest.importorskip("transformers")
    from oomdoctor.preflight.steps import HfJob, trace_hf

    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4)
    f = tmp_path / "config.json"
    cfg.to_json_file(str(f))
    with torch.device("meta"):
        params = list(transformers.GPT2LMHeadModel(cfg).parameters())
    P = sum(p.numel() for p in params) * 4
    acc = trace_hf(HfJob(str(f), 2, 64, steps=1, world_size=2, loop="accelerate", grad_accum=2))
    one = trace_hf(HfJob(str(f), 2, 64, steps=1, world_size=2, loop="accelerate", grad_accum=1))
    last = acc.tensors[-1]
    assert sum(n for _, n in last["gradients"]) == P
    assert sum(n for _, n in last["optimizer_state"]) == 2 * P + 4 * len(params)
    # the markers: one step, two forward passes (train phases) before the optimizer's
    assert [m["phase"] for m in acc.phase_markers].count("train") == 1 + 2
    assert _peak(acc.events)[0] >= _peak(one.events)[0]


# -- a user's script: oomdoctor preflight -- python train.py ------------------------------------------------

_SCRIPT = '''
import argparse
import torch

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=64)
p.add_argument("--steps", type=int, default=100)
p.add_argument("--item", action="store_true")
a = p.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randn(1000, 1024)  # a host dataset: not the GPU's
loader = torch.utils.data.DataLoader(data, batch_size=a.batch)  # its iterator draws a seed (.item())
for step, x in zip(range(a.steps), loader):
    x = x.to(device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if a.item:
        print(loss.item())
'''


@pytest.fixture(scope="module")
def train_py(tmp_path_factory):
    f = tmp_path_factory.mktemp("script") / "train.py"
    f.write_text(_SCRIPT)
    return f


def test_a_script_is_traced_with_only_its_gpu_tensors(train_py, tmp_path, capsys):
    """``oomdoctor preflight -- python train.py``: the model built on the host and moved with ``.to("cuda")``,
    a host dataset batched by a ``DataLoader`` and moved per step, ``torch.autocast("cuda")``. Recorded: the parameters once (the
    host copies are not the GPU's), the gradients, AdamW's two states (its foreach ``step`` counters stay
    on the host, as on CUDA), and the host dataset (1000 x 1024 fp32) never; the script is stopped after
    ``--steps`` optimizer steps (it asks for 100)."""
    snap = tmp_path / "s.pickle"
    rc = main(["preflight", "--gpu", "H100-80GB", "--format", "json", "-o", str(snap), "--",
               "python", str(train_py), "--batch", "64"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["oom"] is False
    P = (1024 * 4096 + 4096 + 4096 * 1024 + 1024) * 4
    meta = json.loads(snap.with_name("s.meta.json").read_text())
    assert [t["step"] for t in meta["tensors"]] == [0, 1]
    last = meta["tensors"][-1]
    assert sum(n for _, n in last["parameters"]) == P
    assert sum(n for _, n in last["gradients"]) == P
    assert sum(n for _, n in last["optimizer_state"]) == 2 * P
    sizes = [e["size"] for e in pickle.loads(snap.read_bytes())["device_traces"][0] if e["action"] == "alloc"]
    assert 1000 * 1024 * 4 not in sizes
    assert sizes.count(64 * 1024 * 4) >= 2  # the batch moved in each step
    assert out["breakdown"]["parameters"] == P and out["job"]["script"][0] == str(train_py)
    # bf16 autocast applied (CUDA's): the first Linear's output is bf16, 64 x 4096 x 2 bytes
    assert 64 * 4096 * 2 in sizes


def test_a_script_reading_a_value_gets_a_stand_in_listed_with_its_line(train_py, capsys):
    """``loss.item()`` on the GPU has no value under fake tensors: the read gets a finite stand-in and the line is
    listed in ``invented_values`` (kind ``finite``, once per traced step), the trace unchanged by it."""
    rc = main(["preflight", "--no-search", "--format", "json", "--", "python", str(train_py), "--item"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    line = _SCRIPT.splitlines().index("        print(loss.item())") + 1
    assert out["invented_values"] == [{"file": str(train_py), "line": line, "kind": "finite", "read": "item",
                                       "count": 1}]  # the second step's read comes after the stop


def test_a_script_runs_on_a_cuda_build_of_torch_with_no_visible_device(train_py, tmp_path, capsys, monkeypatch):
    """A CUDA build of torch where no GPU is visible (a login node): ``torch.accelerator`` knows CUDA from the build,
    and any real stream query fails. AdamW's ``step`` asks the current stream whether a CUDA graph is being captured;
    the script is traced to its end, the same trace as on a CPU build."""
    def no_device(*a, **k):
        raise RuntimeError("CUDA error: no CUDA-capable device is detected")

    snap_cpu = tmp_path / "cpu.pickle"
    assert main(["preflight", "--no-search", "-o", str(snap_cpu), "--", "python", str(train_py)]) == 0
    monkeypatch.setattr(torch._C, "_accelerator_getAccelerator", lambda: torch.device("cuda"), raising=False)
    for name in ("_accelerator_getStream", "_cuda_isCurrentStreamCapturing", "_accelerator_synchronizeDevice",
                 "_accelerator_getDeviceIndex"):
        monkeypatch.setattr(torch._C, name, no_device, raising=False)
    capsys.readouterr()
    snap = tmp_path / "cuda-build.pickle"
    rc = main(["preflight", "--no-search", "-o", str(snap), "--", "python", str(train_py)])
    assert rc == 0, capsys.readouterr().err
    def allocs(p):
        return [e["size"] for e in pickle.loads(p.read_bytes())["device_traces"][0] if e["action"] == "alloc"]
    assert allocs(snap) == allocs(snap_cpu) and len(allocs(snap)) > 10


def test_a_missing_script_is_one_line_and_exit_2(tmp_path, capsys):
    rc = main(["preflight", "--", "python", str(tmp_path / "nope.py")])
    err = capsys.readouterr().err
    assert rc == 2 and "nope.py" in err and len(err.strip().splitlines()) == 1


_FSDP2 = '''
import os
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
if os.environ.get("WRAP") == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
else:
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(10):
    x = torch.randn(64, 1024, device="cuda")
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
'''


@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
def test_a_distributed_script_traces_rank_0_with_collectives_faked(wrap, tmp_path, monkeypatch, capsys):
    """``--nproc-per-node 2``: ``init_process_group("nccl")`` joins a fake process group as rank 0 of 2 and the
    output says so. FSDP2 (``fully_shard`` per Linear): parameters, gradients and AdamW state are this
    rank's shards, half of each, exactly. DDP (the stand-in): whole parameters and gradients, plus the
    gradient buckets (the parameters' bytes) listed in the sidecar."""
    f = tmp_path / "train.py"
    f.write_text(_FSDP2)
    monkeypatch.setenv("WRAP", wrap)
    snap = tmp_path / "s.pickle"
    rc = main(["preflight", "--nproc-per-node", "2", "--format", "json", "-o", str(snap), "--", "python", str(f)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["job"]["world_size"] == 2 and out["job"]["ranks_traced"] == [0]
    assert out["job"]["collectives"].startswith("faked")
    P = (1024 * 4096 + 4096 + 4096 * 1024 + 1024) * 4
    meta = json.loads(snap.with_name("s.meta.json").read_text())
    last = meta["tensors"][-1]
    share = P // 2 if wrap == "fsdp2" else P
    assert sum(n for _, n in last["parameters"]) == share
    assert sum(n for _, n in last["gradients"]) == share
    assert sum(n for _, n in last["optimizer_state"]) == 2 * share
    buckets = [k["bytes"] for k in meta["preflight"]["kernel_buffers"] if k["what"] == "ddp_gradient_bucket"]
    assert sum(buckets) == (P if wrap == "ddp" else 0)


def test_preflight_json_validates_against_its_schema(tiny_gpt2, train_py, capsys):
    """``oomdoctor schema preflight``: the --hf-config output and a script's validate; a field the schema does
    not know does not."""
    jsonschema = pytest.importorskip("jsonschema")
    from oomdoctor.render.schema import schema

    v = jsonschema.Draft202012Validator(schema("preflight"))
    opts = ["preflight", "--no-search", "--format", "json"]
    for argv in (opts + ["--hf-config", str(tiny_gpt2["dir"] / "config.json"), "--micro-batch", "2", "--seq-len", "64"],
                 opts + ["--", "python", str(train_py), "--batch", "8"]):
        assert main(argv) == 0
        doc = json.loads(capsys.readouterr().out)
        assert list(v.iter_errors(doc)) == []
    doc["surprise_bytes"] = 1
    assert any("surprise_bytes" in e.message for e in v.iter_errors(doc))


def test_cross_entropy_of_bf16_logits_runs_cudas_lists():
    """Under bf16 autocast, CUDA runs ``cross_entropy_loss`` unlisted: a bf16 log-softmax (a dtype is given) and
    ``nll_loss``'s fp32 copy of it; CPU's lists would cast the logits to fp32 and take an fp32 log-softmax (two fp32
    copies). Measured on an H200 on T5's loss: 263 MB bf16 then 526 MB fp32 for 32 x 128 x 32,128 logits."""
    n, v = 64, 1000

    def fn():
        lin = torch.nn.Linear(32, v)
        x, y = torch.randn(n, 32), torch.randint(0, v, (n,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(lin(x), y)
        loss.backward()
    sizes = _sizes(fn)
    assert sizes.count(n * v * 4) == 2  # nll_loss's fp32 copy; backward's gradient of the log-probabilities
    assert sizes.count(n * v * 2) >= 3  # the logits, the bf16 log-softmax, its gradient
