"""Replay recorded traces through a model of PyTorch's CUDA caching allocator and answer "what if".

``config``: allocator settings from ``PYTORCH_CUDA_ALLOC_CONF`` strings and snapshots; ``allocator``:
the model; ``capacity``: the memory limit; ``replay``: trace -> model, with validation against the
recording; ``search``: a grid of settings and the recommendation.
"""
