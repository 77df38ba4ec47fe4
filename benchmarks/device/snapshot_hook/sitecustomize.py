"""The GPU truth hook (``benchmarks/preflight_corpus/truth_hook``) plus a memory snapshot of the K measured steps,
for comparing a public script's GPU allocations with preflight's trace event by event (issue 50: the dev-half
scripts whose peaks differ: conv workspaces, the reserved bytes after an evaluation).

Put this folder first on ``PYTHONPATH`` with the truth hook's variables and ``OOMSNAP_OUT`` (a directory). At start-up
it turns on the caching allocator's history (``torch.cuda.memory._record_memory_history``, Python stacks, every
event), registers a global optimizer step post-hook that, at the K-th step, dumps the snapshot to
``OOMSNAP_OUT/<name>-rank<R>.pickle`` (``torch.cuda.memory._dump_snapshot``), then runs the truth hook's file, whose
own post-hook (registered after this one, so called after it) writes the peaks and ends the process.
Nothing changes what the job computes; without ``OOMSNAP_OUT`` only the truth hook runs.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

_TRUTH = Path(__file__).resolve().parents[2] / "preflight_corpus" / "truth_hook" / "sitecustomize.py"


def _install() -> None:
    import torch

    out = Path(os.environ["OOMSNAP_OUT"])
    k = int(os.environ.get("OOMTRUTH_STEPS", "2"))
    name = os.environ.get("OOMTRUTH_NAME", "job")
    steps = {"n": 0}
    try:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python", context="alloc")
    except Exception as e:  # noqa: BLE001 - never break the job
        print(f"oomsnap: no history: {type(e).__name__}: {e}", file=sys.stderr)
        return

    def post(opt, args, kwargs) -> None:  # noqa: ANN001 - torch's hook signature
        steps["n"] += 1
        if steps["n"] >= k and torch.cuda.is_initialized():
            out.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(out / f"{name}-rank{os.environ.get('RANK', '0')}.pickle"))

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(post)


if os.environ.get("OOMSNAP_OUT") and os.environ.get("OOMTRUTH_OUT"):
    try:
        _install()
    except Exception as e:  # noqa: BLE001
        print(f"oomsnap: not installed: {type(e).__name__}: {e}", file=sys.stderr)
runpy.run_path(str(_TRUTH), run_name="sitecustomize")
