"""Preflight: trace a training step on a CPU under fake tensors and predict its GPU memory (issue 42).

Imports torch (the ``oomdoctor[preflight]`` extra); sits at the capture layer. See ``docs/preflight.md``.
"""
