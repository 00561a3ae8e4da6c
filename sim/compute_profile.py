"""The profile's ``compute`` section: its shape, the scenario it was measured for, and the check
that refuses it for another scenario. Part of the profile format (``sim.profile``); ``calibrate compute`` writes it.

Shape (read by ``sim.compute_model``)::

    "compute": {
      "model": {n_layers, hidden, n_heads, n_kv_heads, ffn_hidden, vocab, tie_embeddings},
      "micro_batch": int, "seq_len": int, "param_dtype": "fp32" | "bf16",
      "units": {"embed": U, "block": U, "head": U},
      "copy_Bps": float,
      "optimizer_s_per_param": {"adamw": float, "sgd": float},          # plain tensors (DDP)
      "fsdp_optimizer_s_per_param": {"adamw": float, "sgd": float},     # DTensor shards (FSDP2)
      "fsdp_unit_overhead_s": {"forward": float, "backward": float},    # FSDP2's host work per unit
      "host_overhead_in_step": bool,   # true where the host is the device (CPU): the overhead adds up
      "compute_slowdown_during_collective": float
    }
    U = {forward_s, backward_s, recompute_s (block only, else 0), saved_activation_bytes,
         forward_transient_bytes, backward_transient_bytes}

``head`` is the final RMSNorm, the lm_head and HF's causal-LM cross-entropy loss; ``embed`` is the
token embedding (the rotary tables are not part of any unit; ``sim.layers`` models them).
Unit times are means measured inside the real model (``calibrate.context_timing``); FSDP2's
per-unit host overhead and its DTensor optimizer are measured with the real ``fully_shard``
(``calibrate.fsdp_overhead``). On a GPU the host runs ahead of the device, so the host overhead
is recorded but not added to the step (``host_overhead_in_step`` false).
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
        "fsdp_optimizer_s_per_param",
        "fsdp_unit_overhead_s",
        "host_overhead_in_step",
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
    for table in ("optimizer_s_per_param", "fsdp_optimizer_s_per_param"):
        if not isinstance(compute[table], Mapping):
            raise UserError(f"{where}: field compute.{table} must be a JSON object")
        for opt in ("adamw", "sgd"):
            _number(compute[table].get(opt), where, f"{table}.{opt}")
    if not isinstance(compute["fsdp_unit_overhead_s"], Mapping):
        raise UserError(f"{where}: field compute.fsdp_unit_overhead_s must be a JSON object")
    for phase in ("forward", "backward"):
        _number(compute["fsdp_unit_overhead_s"].get(phase), where, f"fsdp_unit_overhead_s.{phase}")
    if not isinstance(compute["host_overhead_in_step"], bool):
        raise UserError(f"{where}: field compute.host_overhead_in_step must be true or false")
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
