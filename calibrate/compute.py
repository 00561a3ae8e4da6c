"""The profile's ``compute`` section: its shape, the scenario it was measured for, and the check
that refuses it for another scenario. Torch-free (the simulator imports this module).

Shape (read by ``sim.compute_model``)::

    "compute": {
      "model": {n_layers, hidden, n_heads, n_kv_heads, ffn_hidden, vocab, tie_embeddings},
      "micro_batch": int, "seq_len": int, "param_dtype": "fp32" | "bf16",
      "units": {"embed": U, "block": U, "head": U},
      "copy_Bps": float,
      "optimizer_s_per_param": {"adamw": float, "sgd": float},
      "compute_slowdown_during_collective": float
    }
    U = {forward_s, backward_s, recompute_s (block only, else 0), saved_activation_bytes,
         forward_transient_bytes, backward_transient_bytes}

``head`` is the final RMSNorm, the lm_head and HF's causal-LM cross-entropy loss; ``embed`` is the
token embedding (the rotary tables are not part of any unit; ``sim.layers`` models them).
A transient is the peak above what the unit leaves allocated when it returns (see
``calibrate.memtrack``).
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sim.errors import UserError
from sim.model import ModelConfig

UNITS = ("embed", "block", "head")
UNIT_FIELDS = (
    "forward_s",
    "backward_s",
    "recompute_s",
    "saved_activation_bytes",
    "forward_transient_bytes",
    "backward_transient_bytes",
)
MODEL_FIELDS = ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn_hidden", "vocab", "tie_embeddings")


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
        "compute_slowdown_during_collective": slowdown,
    }


def _number(value: Any, where: str, name: str, minimum: float = 0.0) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise UserError(f"{where}: field compute.{name} must be a number >= {minimum:g}, got {value!r}")


def validate_compute_section(compute: Any, where: str) -> None:
    """Raise a UserError naming the field when ``compute`` does not have the shape above."""
    if not isinstance(compute, Mapping):
        raise UserError(f"{where}: field compute must be a JSON object")
    for key in (
        "model",
        "micro_batch",
        "seq_len",
        "param_dtype",
        "units",
        "copy_Bps",
        "optimizer_s_per_param",
    ):
        if key not in compute:
            raise UserError(f"{where}: missing field compute.{key}")
    units = compute["units"]
    for unit in UNITS:
        if not isinstance(units, Mapping) or not isinstance(units.get(unit), Mapping):
            raise UserError(f"{where}: missing field compute.units.{unit}")
        for f in UNIT_FIELDS:
            _number(units[unit].get(f), where, f"units.{unit}.{f}")
    _number(compute["copy_Bps"], where, "copy_Bps", minimum=1e-30)
    for opt in ("adamw", "sgd"):
        _number(compute["optimizer_s_per_param"].get(opt), where, f"optimizer_s_per_param.{opt}")
    _number(
        compute.get("compute_slowdown_during_collective", 1.0),
        where,
        "compute_slowdown_during_collective",
        1.0,
    )


def check_compute_matches(
    compute: Mapping[str, Any],
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    param_dtype: str,
    where: str,
) -> None:
    """Refuse a compute section measured at other dimensions than the scenario's.

    Compares every model dimension (tie_embeddings included), the micro-batch, the sequence
    length and the compute dtype, and names each mismatch.
    """
    validate_compute_section(compute, where)
    dims = compute["model"] if isinstance(compute["model"], Mapping) else {}
    wrong = [
        f"model.{f}={dims.get(f)!r} (scenario: {getattr(model, f)!r})"
        for f in MODEL_FIELDS
        if dims.get(f) != getattr(model, f)
    ]
    for key, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("param_dtype", param_dtype)):
        if compute.get(key) != value:
            wrong.append(f"{key}={compute.get(key)!r} (scenario: {value!r})")
    if wrong:
        raise UserError(
            f"{where}: its compute section was measured at other dimensions: {'; '.join(wrong)}. "
            "Run `fsdpsim calibrate compute SCENARIO --profile PROFILE` for this scenario, or ask for scaling"
        )
