"""Tensor-parallel all-reduce after every layer (seed 000): legacy record_stream vs modern.

``legacy`` runs each all-reduce on a side stream and ``record_stream``s its input there, as
``ProcessGroupNCCL`` did before PyTorch 2.8 (``TORCH_NCCL_AVOID_RECORD_STREAMS=0``): the input's free
is deferred until the side stream's work is seen done, so blocks pile up. ``modern`` calls
``all_reduce`` plainly. 8 x Linear(8192, 8192) in bf16, batch 4096, 5 forward passes under no_grad.
Expected: ``deferred-free`` on legacy only; legacy peak reserved ~2x peak allocated.
"""

import torch
from _common import parser, setup, teardown


def main() -> None:
    a = parser(("legacy", "modern"), __doc__).parse_args()
    rank, world, dev = setup()
    side = torch.cuda.Stream()
    layers = [torch.nn.Linear(8192, 8192, bias=False, device=dev, dtype=torch.bfloat16) for _ in range(8)]
    x = torch.randn(4096, 8192, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(5):
            h = x
            for layer in layers:
                h = layer(h)
                if a.variant == "legacy":
                    cur = torch.cuda.current_stream()
                    side.wait_stream(cur)
                    with torch.cuda.stream(side):
                        torch.distributed.all_reduce(h)
                    h.record_stream(side)
                    cur.wait_stream(side)
                else:
                    torch.distributed.all_reduce(h)
    teardown()


if __name__ == "__main__":
    main()
