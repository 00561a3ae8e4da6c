"""The profile's ``compute`` section: its shape, the scenario it was measured for, and the check
that refuses it for another scenario. Part of the profile format (``sim.profile``); ``calibrate compute`` writes it.

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
Transients are defined the way the simulator's memory ledger uses them: while a unit runs forward
the ledger holds its saved activations plus ``forward_transient_bytes``, so that field is the
unit's peak above what was allocated when it started, less its saved bytes; while it runs
backward the ledger holds ``backward_transient_bytes`` on top of everything live when it started
(its gradients appear when it finishes), so that field is the peak above the start.
"""

from collections.abc import Mapping
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
            "Run `fsdpsim calibrate compute SCENARIO --profile PROFILE` for this scenario, or set "
            "cluster.compute_scaling = true to scale the measurements by the analytic model"
        )
