"""The same model under FSDP1 (``FullyShardedDataParallel``) and FSDP2 (``fully_shard``).

A 12-layer LM (d=1024, 50,257 vocabulary), each layer and the root sharded, bf16 parameters with
fp32 reduction, AdamW, batch 8 x 1024, 4 steps. FSDP1 frees all-gathered parameters through
``record_stream`` on its side streams; FSDP2 manages them without it (``torch/distributed/fsdp``).
Expected: reserved close to allocated on FSDP2; the numbers of both are recorded in docs/scenarios.md.
"""

import torch
from _common import LM, lm_loss, parser, setup, teardown


def main() -> None:
    a = parser(("fsdp1", "fsdp2"), __doc__).parse_args()
    rank, world, dev = setup()
    model = LM(50257, 1024, 12).to(dev)
    if a.variant == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({torch.nn.TransformerEncoderLayer}),
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                     device_id=dev)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(4):
        ids = torch.randint(0, 50257, (8, 1024), device=dev)
        lm_loss(model(ids), ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    teardown()


if __name__ == "__main__":
    main()
