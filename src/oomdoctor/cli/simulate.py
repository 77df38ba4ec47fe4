"""``oomdoctor simulate SNAPSHOT``: replay the trace through the allocator model and answer "what if"."""

from __future__ import annotations

import click

from ..errors import UsageError
from ..render.protocol import formats
from ..simulate.whatif import simulate_recorded
from ..units import parse_bytes
from .inputs import load_with_progress
from .output import OUTPUT, emit


@click.command("simulate")
@click.argument("snapshot", type=click.Path(path_type=str))
@click.option("--config", "configs", multiple=True, metavar="STR",
              help="A PYTORCH_CUDA_ALLOC_CONF value to try, e.g. 'expandable_segments:True' (repeatable).")
@click.option("--immediate-frees", is_flag=True,
              help="Also replay with deferred (record_stream) frees completed at once, as with "
                   "TORCH_NCCL_AVOID_RECORD_STREAMS=1 or PyTorch >= 2.8.")
@click.option("--cap", metavar="SIZE", help="Memory limit, in bytes or e.g. 38.67GiB (default: from the snapshot).")
@click.option("--cap-kind", type=click.Choice(["device", "fraction"]),
              help="What --cap is: what cudaMalloc can get (device), or a set_per_process_memory_fraction "
                   "limit (fraction, which also enables garbage_collection_threshold).")
@click.option("--search", is_flag=True, help="Try a grid of settings and recommend one.")
@click.option("--format", "fmt", type=click.Choice(formats("simulate")), default="text", show_default=True)
@click.option("-o", "--output", type=OUTPUT, help="Write to this file (- for standard output).")
@click.option("-j", "--jobs", type=click.IntRange(min=1), help="Worker processes for --search (default: CPUs).")
def command(snapshot: str, configs: tuple[str, ...], immediate_frees: bool, cap: str | None, cap_kind: str | None,
            search: bool, fmt: str, output: str | None, jobs: int | None) -> None:
    """Replay SNAPSHOT under its recorded allocator settings (checked against the recording) and under
    the settings given, and report peak reserved memory and OOMs for each."""
    from .main import keep_decoded_when_exiting

    keep_decoded_when_exiting()  # as diagnose
    # the replay reads the stacks of segment entries only, and no metadata columns or annotations (issue 38)
    traces = load_with_progress([snapshot], replay_only=True)
    if len(traces) != 1:
        raise UsageError(f"{snapshot}: holds {len(traces)} snapshots; simulate takes one file")
    if cap is None and cap_kind is not None:
        raise UsageError("--cap-kind needs --cap")
    sim = simulate_recorded(traces[0], configs=list(configs), immediate_frees=immediate_frees,
                            cap_bytes=None if cap is None else parse_bytes(cap), cap_kind=cap_kind, search=search,
                            workers=jobs)
    emit(output, "simulate", fmt, sim)
