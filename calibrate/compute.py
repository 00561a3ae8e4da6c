"""Measurements of ``calibrate compute``, shaped as the profile's ``compute`` section.

The section's format and its checks live with the profile format in ``sim.hardware.compute_section``.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sim.hardware.compute_section import (
    MODEL_FIELDS,
    UNIT_FIELDS,
    UNITS,
    check_compute_matches,
    validate_compute_section,
)
from sim.workload.model import ModelConfig

__all__ = [
    "ComputeTarget",
    "UnitMeasure",
    "check_compute_matches",
    "compute_section",
    "validate_compute_section",
]


@dataclass(frozen=True, kw_only=True)
class ComputeTarget:
    """What to measure: the scenario's model, micro-batch, sequence length and compute dtype.

    ``world_size`` is the scenario's shard count; it sizes the parameter shards the optimizer
    steps over and the FSDP copy buffers. It is not part of the dimensions check.
    """

    model: ModelConfig
    micro_batch: int
    seq_len: int
    param_dtype: str
    world_size: int

    def model_dict(self) -> dict[str, Any]:
        return {f: getattr(self.model, f) for f in MODEL_FIELDS}


@dataclass(frozen=True, kw_only=True)
class UnitMeasure:
    forward_s: float
    backward_s: float
    recompute_s: float
    saved_activation_bytes: int
    forward_transient_bytes: int
    backward_transient_bytes: int

    def to_dict(self) -> dict[str, float | int]:
        return {f: getattr(self, f) for f in UNIT_FIELDS}


def compute_section(
    target: ComputeTarget,
    units: Mapping[str, UnitMeasure],
    *,
    copy_Bps: float,
    optimizer_s_per_param: Mapping[str, float],
    fsdp_optimizer_s_per_param: Mapping[str, float],
    fsdp_unit_overhead_s: Mapping[str, float],
    host_overhead_in_step: bool,
    slowdown: float,
) -> dict[str, Any]:
    return {
        "model": target.model_dict(),
        "micro_batch": target.micro_batch,
        "seq_len": target.seq_len,
        "param_dtype": target.param_dtype,
        "units": {name: units[name].to_dict() for name in UNITS},
        "copy_Bps": copy_Bps,
        "optimizer_s_per_param": dict(optimizer_s_per_param),
        "fsdp_optimizer_s_per_param": dict(fsdp_optimizer_s_per_param),
        "fsdp_unit_overhead_s": dict(fsdp_unit_overhead_s),
        "host_overhead_in_step": host_overhead_in_step,
        "compute_slowdown_during_collective": slowdown,
    }
