"""Pipeline parallelism with ``torch.distributed.pipelining`` (seed 003): the last stage's cached outputs.

``Schedule1F1B``, 2 stages of 2 Transformer layers (d=1024, bf16), the last ending in a
128,256-token head; 8 micro-batches of 1 x 2048 tokens, 2 steps. ``return-outputs`` calls
``step()`` with the default ``return_outputs=True``, so the last stage keeps every micro-batch's
logits until the step returns; ``no-return-outputs`` passes ``return_outputs=False``.
Expected: ``pipeline-output-cache`` on the last stage with return-outputs only.
"""

import torch
import torch.nn as nn
from _common import lm_loss, parser, setup, teardown
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

VOCAB, D, SEQ, MICRO = 128256, 1024, 2048, 8


class First(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.layers = nn.Sequential(*(nn.TransformerEncoderLayer(D, 16, 4 * D, batch_first=True) for _ in range(2)))

    def forward(self, ids):
        return self.layers(self.tok(ids))


class Last(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.TransformerEncoderLayer(D, 16, 4 * D, batch_first=True) for _ in range(2)))
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, x):
        return self.head(self.layers(x))


def main() -> None:
    a = parser(("return-outputs", "no-return-outputs"), __doc__).parse_args()
    rank, world, dev = setup()
    mod = (First if rank == 0 else Last)().to(dev, torch.bfloat16)
    stage = PipelineStage(mod, stage_index=rank, num_stages=world, device=dev)
    sched = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=lm_loss)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), device=dev)
    kw = {"return_outputs": a.variant == "return-outputs"}
    for _ in range(2):
        mod.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(ids, **kw)
        else:
            losses = []
            out = sched.step(target=ids, losses=losses, **kw)
            del out, losses
    teardown()


if __name__ == "__main__":
    main()
