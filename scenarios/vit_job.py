"""A ViT-B/16 image-classification training job, for ``benchmarks/device/round14_fit.sh`` (issue 49 item 6: the
ViT-B case that ``oomdoctor fit`` started at 1 guessed 600 where about 2,135 was the edge).

The job: torchvision's ``vit_b_16`` (86M parameters, random init; timm's ``vit_base_patch16_224`` where
torchvision is missing), 224 x 224 synthetic images made on the GPU each step (random pixels, random labels of
1,000 classes: no data loader, no disk), cross-entropy, AdamW (lr 1e-4), bf16 autocast over fp32 weights,
micro-batch B on one GPU.

    python scenarios/vit_job.py --batch B [--steps N] [--cap-gib G]         # trains N steps (default 1000)
    python scenarios/vit_job.py --auto-find --batch START --steps 2 --result F [--cap-gib G]
        # accelerate's find_executable_batch_size around the same loop: retries with the batch x 0.9 after each
        # OOM, in this one process; writes F (tried sizes, the answer, seconds)
    python scenarios/vit_job.py --catch-oom --batch B ...                    # a job that catches its OOM:
        # `except torch.OutOfMemoryError` around the loop, prints "skipping" and exits 0 (tests/gpu)

``--cap-gib G``: ``torch.cuda.set_per_process_memory_fraction(G GiB / the GPU's memory)`` before the first
allocation. The caching allocator then refuses to hold more than G GiB, as a G GiB GPU's would (less the CUDA
context, which lives outside the allocator and is not counted against the cap). It is a way to reach the edge in
seconds-long trials: the job, its memory per image and every allocation are the real ones; only the room is
smaller. Without it the edge on an H200 (139.8 GiB) is in the thousands.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    try:
        from torchvision.models import vit_b_16
        return vit_b_16(weights=None)
    except ImportError:
        import timm
        return timm.create_model("vit_base_patch16_224", pretrained=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--cap-gib", type=float, default=None)
    p.add_argument("--auto-find", action="store_true")
    p.add_argument("--catch-oom", action="store_true")
    p.add_argument("--result")
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    if a.cap_gib:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(a.cap_gib * 2**30 / total, 1.0), dev)
    net = model().to(dev)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator(device=dev).manual_seed(0)

    def train(batch: int, steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(batch, 3, 224, 224, device=dev, generator=g)
            y = torch.randint(0, 1000, (batch,), device=dev, generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    if a.auto_find:
        from accelerate.utils import find_executable_batch_size
        tried: list[int] = []

        @find_executable_batch_size(starting_batch_size=a.batch)
        def search(batch_size: int) -> int:
            tried.append(batch_size)
            opt.zero_grad(set_to_none=True)
            train(batch_size, a.steps)
            return batch_size

        t0 = time.perf_counter()
        answer = search()
        result = {"tool": "accelerate.utils.find_executable_batch_size", "start": a.batch, "tried": tried,
                  "answer": answer, "trials": len(tried), "seconds": round(time.perf_counter() - t0, 2),
                  "outcomes": ["ran" if b <= answer else "oom" for b in tried], "cap_gib": a.cap_gib}
        if a.result:
            with open(a.result, "w") as f:
                json.dump(result, f, indent=1)
        print(json.dumps(result), flush=True)
        return
    try:
        train(a.batch, a.steps)
    except torch.OutOfMemoryError:
        if not a.catch_oom:
            raise
        print(f"micro-batch {a.batch} does not fit: skipping", flush=True)
        return
    print(f"{a.steps} steps at micro-batch {a.batch}", flush=True)


if __name__ == "__main__":
    main()
