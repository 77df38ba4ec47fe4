"""All-gather into a list and ``torch.cat``, vs ``all_gather_into_tensor``.

20 all-gathers of bf16 tensors of 1-24 Mi elements (seeded), each result kept for 3 iterations.
``list``: ``all_gather(list, x)`` then ``torch.cat`` (world_size buffers plus the concatenation);
``tensor``: ``all_gather_into_tensor`` into one output.
Expected: ``allgather-list`` on list only.
"""

import torch
from _common import parser, setup, teardown


def main() -> None:
    a = parser(("list", "tensor"), __doc__).parse_args()
    rank, world, dev = setup()
    g = torch.Generator().manual_seed(7)
    kept = []
    for _ in range(20):
        n = int(torch.randint(1 << 20, 24 << 20, (1,), generator=g))
        x = torch.randn(n, device=dev, dtype=torch.bfloat16)
        if a.variant == "list":
            parts = [torch.empty_like(x) for _ in range(world)]
            torch.distributed.all_gather(parts, x)
            y = torch.cat(parts)
            del parts
        else:
            y = torch.empty(world * n, device=dev, dtype=torch.bfloat16)
            torch.distributed.all_gather_into_tensor(y, x)
        kept = (kept + [y])[-3:]
        del x, y
    teardown()


if __name__ == "__main__":
    main()
