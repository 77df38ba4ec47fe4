"""Variable-length training under a memory cap: a fragmentation OOM, and expandable segments.

One model per GPU (no process group): a 6-layer pre-norm LM (d=2048, 32,000 vocabulary), AdamW,
bf16 autocast, batch 8, sequence lengths drawn from 128..4096 (multiples of 64, seeded). Two steps at
the longest length calibrate the peak allocated; then ``set_per_process_memory_fraction`` caps the
process at 1.10 x that peak and 12 steps run. ``default``: the default allocator fails with gigabytes
reserved but unallocated (the process dies of the OutOfMemoryError, as a real job does).
``expandable``: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, no OOM.
Expected: an OOM dump and ``fragmentation`` on default; no OOM and no ``fragmentation`` on expandable.
"""

import os
import sys

if "--variant=expandable" in sys.argv or sys.argv[-2:] == ["--variant", "expandable"]:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch  # noqa: E402
from _common import LM, lm_train_step, parser, setup  # noqa: E402

VOCAB, D, LAYERS, BATCH, MAX_SEQ = 32000, 2048, 6, 8, 4096


def step(model, opt, seq, dev):
    lm_train_step(model, opt, VOCAB, BATCH, seq, dev)


def main() -> None:
    parser(("default", "expandable"), __doc__).parse_args()
    rank, world, dev = setup(dist=False)
    model = LM(VOCAB, D, LAYERS).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        step(model, opt, MAX_SEQ, dev)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(1.10 * peak / total, dev)
    g = torch.Generator().manual_seed(1234)
    for i in range(12):
        seq = int(torch.randint(2, MAX_SEQ // 64 + 1, (1,), generator=g)) * 64
        step(model, opt, seq, dev)
    torch.cuda.synchronize()
    print(f"rank {rank}: 12 steps without OOM", flush=True)


if __name__ == "__main__":
    main()
