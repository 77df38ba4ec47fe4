"""How many micro-batches' activations a pipeline rank holds at its peak.

Counts are in *chunk-micro-batches*: one micro-batch through one model chunk (``L / (pp · vpp)``
layers). ``shared/reference/memory_estimation.md`` §2.1:

- 1F1B: rank ``r`` of ``p`` holds ``min(p − r, M)`` (Megatron ``get_pp_rank_microbatches``: warm-up
  ``min(p − r − 1, M)`` forwards, then one more before the first backward; PyTorch ``Schedule1F1B``).
- GPipe: all ``M`` forwards before any backward (PyTorch ``ScheduleGPipe``).
- Interleaved 1F1B with ``v`` chunks: ``min((v − 1)·p + 2(p − 1 − r) + 1, M·v)`` (Megatron warm-up
  ``2(p − r − 1) + (v − 1)·g`` with ``g = p``, plus one; PyTorch ``ScheduleInterleaved1F1B``
  ``_get_warmup_ops``). The last rank holds ``p − (p − 1)/v`` micro-batches' worth, not 1.
- Zero-bubble ZB-H1: the 1F1B peak (Qi et al., ICLR'24, arXiv:2401.10241 §3).
- ZB-V (2 chunks per rank in a V): every rank reaches the 1F1B first-rank peak, ``p`` micro-batches of a
  stage, i.e. ``2p`` chunk-micro-batches (ibid. §4).
"""

from __future__ import annotations


def in_flight_chunks(schedule: str, pp: int, rank: int, microbatches: int, vpp: int = 1) -> int:
    """Chunk-micro-batches whose activations pipeline rank ``rank`` holds at its peak.

    Raises:
        ValueError: unknown schedule or a rank outside ``0..pp-1``.
    """
    if not 0 <= rank < pp:
        raise ValueError(f"rank {rank} outside 0..{pp - 1}")
    m = microbatches
    if pp == 1:
        return 1 if schedule != "gpipe" else m
    if schedule in ("1f1b", "zero-bubble"):
        return min(pp - rank, m)
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        return min((vpp - 1) * pp + 2 * (pp - 1 - rank) + 1, m * vpp)
    if schedule == "zbv":
        return min(2 * pp, 2 * m)
    raise ValueError(f"unknown schedule {schedule!r}")


def bubble_fraction(schedule: str, pp: int, microbatches: int, vpp: int = 1) -> float:
    """Idle fraction of a step: ``(p − 1) / (v · M)`` for (interleaved) 1F1B and GPipe (Narayanan et al.
    2021, arXiv:2104.04473 §2.2); about a third of that for zero-bubble ZB-H1 and near zero for ZB-V
    (Qi et al. 2024, Table 3), taken as ``(p − 1) / (3M)`` and 0."""
    if pp == 1:
        return 0.0
    if schedule == "zbv":
        return 0.0
    if schedule == "zero-bubble":
        return (pp - 1) / (3 * microbatches)
    return (pp - 1) / (vpp * microbatches)
