"""Validation: the simulator's predictions against real FSDP2 / DDP runs of the same scenario."""
