"""The recorder notes every optimizer and every model (issue 54), with real ``torch.optim`` optimizers and real
``torch.nn`` modules on this machine's CPU build of torch: PyTorch's own global optimizer step hook calls the
recorder (:data:`oomdoctor.capture.facts.HOST` stands for the GPU), and the snapshot is a small one built in code.

- each optimizer gets its own records at the end of its own first steps, whichever steps first (a GAN: AdamW and
  SGD with momentum; the discriminator first), and every dump merges all of them;
- the modules: every root module's trained and frozen parameters and registered buffers, by part, with its class
  path (a frozen teacher, a ``deepcopy`` EMA copy, MoCo's key encoder and queue);
- recording never changes what the job computes (bit for bit), and the sidecar loads back with its facts.
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from test_capture import FakeCuda, small_snapshot  # noqa: E402

from oomdoctor.capture.facts import FACT_STEPS, HOST, module_record, module_roots  # noqa: E402
from oomdoctor.capture.recorder import Recorder  # noqa: E402
from oomdoctor.trace import load  # noqa: E402


def storages(tensors) -> list[list[int]]:
    return sorted([t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()] for t in tensors)


@pytest.fixture
def recorder(tmp_path):
    """A recorder whose CUDA is a stand-in, noting host tensors, hooked into torch.optim's global post hook."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    cuda = FakeCuda(small_snapshot(tmp_path))
    rec = Recorder(str(tmp_path / "out"), on_oom=False, stack_steps="all")
    rec._torch = SimpleNamespace(cuda=cuda, nn=nn, __version__="2.11.0+cu130", version=SimpleNamespace(cuda="13.0"))
    rec.active = True
    rec.fact_device = HOST
    rec.markers.append({"step": 0, "time_us": 0})
    rec._enable(clear=False)
    handle = register_optimizer_step_post_hook(rec._optimizer_hook)
    rec._hook_handle = handle
    yield rec
    handle.remove()


def gan(steps: int):
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 12))
    disc = nn.Sequential(nn.Linear(12, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_d = torch.optim.AdamW(disc.parameters(), lr=1e-3)
    opt_g = torch.optim.SGD(gen.parameters(), lr=1e-2, momentum=0.9)
    bce = nn.BCEWithLogitsLoss()
    for _ in range(steps):
        real, z = torch.randn(4, 12), torch.randn(4, 8)
        fake = gen(z)
        opt_d.zero_grad(set_to_none=True)
        (bce(disc(real), torch.ones(4, 1)) + bce(disc(fake.detach()), torch.zeros(4, 1))).backward()
        opt_d.step()
        opt_g.zero_grad(set_to_none=True)
        bce(disc(fake), torch.ones(4, 1)).backward()
        opt_g.step()
    return gen, disc, opt_g, opt_d


def test_every_optimizer_gets_its_own_records_whichever_steps_first(recorder):
    gen, disc, opt_g, opt_d = gan(steps=FACT_STEPS)  # the last records are of the final state
    recorder.stop()
    meta = json.loads(Path(str(recorder.written[0]).replace(".pickle", ".meta.json")).read_text())
    steps = [r for r in meta["tensors"] if "at" not in r]
    # the discriminator stepped first: index 0, AdamW; the generator is index 1, SGD; FACT_STEPS records each
    assert [(r["optimizer"], r["class"]) for r in steps] == [
        (0, "torch.optim.adamw.AdamW"), (1, "torch.optim.sgd.SGD")] * FACT_STEPS
    assert [r["step"] for r in steps] == [0, 1, 1, 2]  # the recorder's step count when noted (D's step advances it)
    assert all(r["time_us"] <= s["time_us"] for r, s in zip(steps, steps[1:]))
    d_rec, g_rec = steps[-2], steps[-1]
    assert d_rec["parameters"] == storages(disc.parameters())
    assert g_rec["parameters"] == storages(gen.parameters())
    # at the generator's step end the generator's gradients are its own (the discriminator's are noted with it)
    assert g_rec["gradients"] == storages(p.grad for p in gen.parameters())
    assert d_rec["optimizer_state"] == storages(v for st in opt_d.state.values() for v in st.values()
                                                if torch.is_tensor(v))  # exp_avg, exp_avg_sq, step
    assert g_rec["optimizer_state"] == storages(st["momentum_buffer"] for st in opt_g.state.values())
    dump = meta["tensors"][-1]
    assert dump["at"] == "dump" and dump["optimizers"] == 2
    assert dump["parameters"] == storages([*gen.parameters(), *disc.parameters()])
    assert dump["gradients"] == storages(p.grad for p in [*gen.parameters(), *disc.parameters()])


def test_the_models_are_noted_at_the_first_step_with_their_class_and_parts(recorder):
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(6, 10), nn.BatchNorm1d(10), nn.Linear(10, 3))
    teacher = nn.Sequential(nn.Linear(6, 20), nn.Linear(20, 3)).requires_grad_(False)
    ema = copy.deepcopy(student)  # an EMA copy: parameters that require gradients, in no optimizer
    opt = torch.optim.Adam(student.parameters())
    for _ in range(2):
        x = torch.randn(5, 6)
        nn.functional.mse_loss(student(x), teacher(x)).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), student.parameters()):
                e.lerp_(p, 0.1)
    recorder.stop()
    t = load(recorder.written[0])
    first, dump = t.meta["modules"]
    assert first["step"] == 0 and "at" not in first and dump["at"] == "dump"
    roots = {tuple(tuple(x[:2]) for x in r["parameters"] + r["untouched"] + r["frozen"]): r for r in first["roots"]}

    def root_of(module):
        key = tuple(tuple(s) for s in sorted(storages(module.parameters())))
        return next(r for k, r in roots.items() if tuple(sorted(k)) == key)

    s, te, em = root_of(student), root_of(teacher), root_of(ema)
    assert s["class"] == te["class"] == "torch.nn.modules.container.Sequential"
    assert s["parts"] == [["0", "torch.nn.modules.linear.Linear"], ["1", "torch.nn.modules.batchnorm.BatchNorm1d"],
                          ["2", "torch.nn.modules.linear.Linear"]]
    assert [x[:2] for x in te["frozen"]] == storages(teacher.parameters()) and te["parameters"] == []
    # the copy requires gradients but never had one: untouched; the student's have theirs, noted with them
    assert [x[:2] for x in em["untouched"]] == storages(ema.parameters()) and em["frozen"] == em["parameters"] == []
    assert sorted(x[1] for x in s["gradients"]) == sorted(x[1] for x in storages(student.parameters()))
    assert not {tuple(x[:2]) for x in s["gradients"]} & {tuple(x) for x in storages(student.parameters())}
    # BatchNorm's running statistics are buffers of part 1, in both the student and its copy
    bn = student[1]
    assert sorted(x[:2] for x in s["buffers"]) == storages([bn.running_mean, bn.running_var, bn.num_batches_tracked])
    assert {x[2] for x in s["buffers"]} == {1}
    assert {x[2] for x in s["parameters"]} == {0, 1, 2}
    # the dump notes the same roots again (still alive): the same storages; the student's gradients are gone
    # (zero_grad), so its parameters are untouched there
    def held(rec):
        return sorted(tuple(x) for r in rec["roots"] for k in ("parameters", "untouched", "frozen", "buffers")
                      for x in r[k])
    assert held(dump) == held(first)
    d_student = next(r for r in dump["roots"] if r["parts"] == s["parts"] and r["buffers"] == s["buffers"])
    assert d_student["parameters"] == d_student["gradients"] == [] and d_student["untouched"] == s["parameters"]


class MoCo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder_q = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
        self.encoder_k = copy.deepcopy(self.encoder_q)
        for p in self.encoder_k.parameters():
            p.requires_grad = False
        self.register_buffer("queue", torch.randn(4, 64))


def test_a_momentum_encoder_and_a_registered_queue_are_told_apart_by_part():
    moco = MoCo()
    [rec] = [r for r in module_record(module_roots([moco, moco.encoder_q, moco.encoder_k, *moco.encoder_q],
                                                   nn.Module), HOST)]
    assert rec["class"].endswith("test_capture_models.MoCo")
    assert rec["parts"] == [["encoder_q", "torch.nn.modules.container.Sequential"],
                            ["encoder_k", "torch.nn.modules.container.Sequential"]]
    assert {x[2] for x in rec["untouched"]} == {0} and {x[2] for x in rec["frozen"]} == {1}  # no backward yet
    assert rec["buffers"] == [[*storages([moco.queue])[0], -1]]  # the root's own buffer
    # a storage held by two roots is listed once, under the first
    other = nn.Sequential(moco.encoder_q)
    recs = module_record([moco, other], HOST)
    assert len(recs) == 1


def test_roots_never_read_an_attribute_of_an_object_that_is_no_module():
    class Proxy:
        @property
        def __class__(self):  # noqa: D401 - a proxy that lies about its class
            raise AssertionError("read")

    m = nn.Linear(2, 2)
    assert module_roots([Proxy(), m, 3, "x"], nn.Module) == [m]


def test_recording_never_changes_what_the_job_computes_against_no_recorder(tmp_path):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    plain = gan(steps=4)
    cuda = FakeCuda(small_snapshot(tmp_path))
    rec = Recorder(str(tmp_path / "out"), on_oom=False, stack_steps="all")
    rec._torch = SimpleNamespace(cuda=cuda, nn=nn, __version__="2.11.0+cu130", version=SimpleNamespace(cuda="13.0"))
    rec.active, rec.fact_device = True, HOST
    rec.markers.append({"step": 0, "time_us": 0})
    handle = register_optimizer_step_post_hook(rec._optimizer_hook)
    try:
        recorded = gan(steps=4)
    finally:
        handle.remove()
    assert len(rec.tensor_facts) == 2 * FACT_STEPS and rec.module_facts  # the hook did note them
    for a, b in zip([*plain[0].parameters(), *plain[1].parameters()],
                    [*recorded[0].parameters(), *recorded[1].parameters()]):
        assert torch.equal(a, b)
    for oa, ob in ((plain[3], recorded[3]), (plain[2], recorded[2])):
        for sa, sb in zip(oa.state.values(), ob.state.values()):
            assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_sidecar_whose_modules_are_malformed_loads_without_them(tmp_path):
    snap = small_snapshot(tmp_path)
    path = tmp_path / "rank0.pickle"
    path.write_bytes(pickle.dumps(snap))
    meta = {"format": "oomdoctor.sidecar/1", "rank": 0,
            "modules": [{"time_us": 1, "roots": [{"class": "x", "parameters": [[1, 2]]}]}]}
    (tmp_path / "rank0.meta.json").write_text(json.dumps(meta))
    t = load(str(path))
    assert "modules" not in t.meta and any("modules" in w for w in t.warnings)
    meta["modules"][0]["roots"][0]["parameters"] = [[1, 2, -1]]
    (tmp_path / "rank0.meta.json").write_text(json.dumps(meta))
    assert load(str(path)).meta["modules"][0]["roots"][0]["parameters"] == [[1, 2, -1]]


@pytest.mark.parametrize("value", [
    {"tensors": [{"parameters": [[140737488355328, 4096], [140737488359424, 512]], "time_us": 1}]},
    {"s": "a [\n 1,\n 2\n ] inside a string", "n": [[1, -2, 3]], "f": [1.5, 2], "e": [], "nested": [[[1, 2]]]},
])
def test_the_sidecar_puts_each_storage_on_one_line_and_keeps_the_value(value):
    from oomdoctor.capture.files import json_bytes, sidecar_json_bytes

    data = sidecar_json_bytes(value)
    assert json.loads(data) == value
    assert len(data) < len(json_bytes(value))
    assert b"[140737488355328, 4096]" in data or b"[1, -2, 3]" in data


def test_a_step_window_notes_each_optimizer_again_inside_it(tmp_path):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    cuda = FakeCuda(small_snapshot(tmp_path))
    rec = Recorder(str(tmp_path / "out"), steps="3:4", on_oom=False, stack_steps="all")
    rec._torch = SimpleNamespace(cuda=cuda, nn=nn, __version__="2.11.0+cu130", version=SimpleNamespace(cuda="13.0"))
    rec.active, rec.fact_device = True, HOST
    rec.markers.append({"step": 0, "time_us": 0})
    handle = register_optimizer_step_post_hook(rec._optimizer_hook)
    try:
        gan(steps=5)
    finally:
        handle.remove()
    # two records per optimizer at the first steps, and more once the window opened (when the discriminator's step
    # made the count 3): the generator's, then the discriminator's next (whose step closes the window)
    got = [(r["optimizer"], r["step"]) for r in rec.tensor_facts]
    assert got[:4] == [(0, 0), (1, 1), (0, 1), (1, 2)]
    assert got[4:6] == [(1, 3), (0, 3)]  # the count when noted: the discriminator notes before it advances
    before = [(o, st) for o, st in got if st < 3]
    assert len(before) == 4 and len(got) > 4


def snapshot_of(tensors) -> dict:
    """A snapshot whose blocks are the storages of ``tensors`` where they are (one segment each, allocated at times
    1, 2, ... before anything the recorder notes): what the allocator's final state would hold of them on a GPU."""
    seen, segs, events = {}, [], []
    for t in tensors:
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
    for i, (ptr, n) in enumerate(sorted(seen.items())):
        size = n  # exact: the host's allocator packs small storages closer than the CUDA allocator's 512 bytes
        segs.append({"device": 0, "address": ptr, "total_size": size, "allocated_size": size, "active_size": size,
                     "requested_size": n, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                     "is_expandable": False, "frames": [],
                     "blocks": [{"address": ptr, "size": size, "requested_size": n, "state": "active_allocated",
                                 "frames": []}]})
        events += [{"action": "segment_alloc", "addr": ptr, "size": size, "stream": 0, "time_us": 2 * i + 1,
                    "frames": []},
                   {"action": "alloc", "addr": ptr, "size": n, "stream": 0, "time_us": 2 * i + 2, "frames": []}]
    return {"segments": segs, "device_traces": [events], "allocator_settings": {}, "external_annotations": []}


def test_what_the_recorder_notes_places_every_model_in_the_diagnosis(recorder):
    """End to end on this machine's CPU: a GAN (AdamW, SGD with momentum), a frozen teacher, a ``deepcopy`` EMA of
    the generator and a model with a registered buffer, trained under the recorder's hook; the snapshot holds
    their storages where they live; the sidecar's dump records place each one."""
    teacher = nn.Sequential(nn.Linear(12, 64), nn.Linear(64, 12)).requires_grad_(False)
    ema = copy.deepcopy(teacher).requires_grad_(True)  # requires gradients, never gets one, in no optimizer
    banked = MoCo()
    gen, disc, opt_g, opt_d = gan(steps=2)  # the models above exist at its first step, where they are found
    for p in [*gen.parameters(), *disc.parameters()]:  # the gradients of the last step are still there
        assert p.grad is not None
    state = [v for o in (opt_g, opt_d) for st in o.state.values() for v in st.values() if torch.is_tensor(v)]
    trained = [*gen.parameters(), *disc.parameters()]
    grads = [p.grad for p in trained]
    recorder._torch.cuda.snap = snapshot_of([*trained, *grads, *state, *teacher.parameters(), *ema.parameters(),
                                             *banked.parameters(), *banked.buffers()])
    recorder.stop()
    from oomdoctor.analysis import analyze

    a = analyze(load(recorder.written[0]))
    b = a.breakdown_at(a.num_events - 1, "end")

    def nbytes(ts):
        return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in ts}.values())

    c = b.categories
    assert c["parameters"] == nbytes(trained) and c["gradients"] == nbytes(grads)
    assert c["optimizer_state"] == nbytes(state)
    # the frozen teacher, the copy that never gets a gradient, MoCo's key encoder (frozen) and, here, its query
    # encoder too (it requires gradients, never had one, and no optimizer steps it), each named by its module
    assert c["weight_copy"] == nbytes([*teacher.parameters(), *ema.parameters(), *banked.parameters()])
    assert b.weight_copy_by["module test_capture_models.MoCo.encoder_k"] == nbytes(banked.encoder_k.parameters())
    assert b.weight_copy_by["module test_capture_models.MoCo.encoder_q"] == nbytes(banked.encoder_q.parameters())
    seq = "module torch.nn.modules.container.Sequential"  # the teacher and its copy, by child: .0 and .1
    assert {k: v for k, v in b.weight_copy_by.items() if k.startswith(seq)} == {
        f"{seq}.0": 2 * nbytes(teacher[0].parameters()), f"{seq}.1": 2 * nbytes(teacher[1].parameters())}
    assert c["buffers"] == nbytes([banked.queue]) and list(b.buffers_by) == ["module test_capture_models.MoCo"]
    assert c["unknown"] == 0 and all(acc == "recorded" for acc in b.sources.values())
