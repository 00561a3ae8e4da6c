"""Calibration on a real machine: collectives and per-unit compute, measured into a versioned profile.

This is the only package of fsdp-sim that runs ``torch.distributed``. Importing it (or its
torch-free modules ``busbw``, ``fit``, ``records``, ``nccl_tests``, ``profile_io``, ``compute``)
does not import torch; the measuring modules import it when they run.

Entry points: ``python -m calibrate comm|compute ...`` and ``calibrate.cli.main(argv)``.
"""
