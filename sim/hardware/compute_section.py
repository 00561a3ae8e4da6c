"""The profile's ``compute`` section, typed: per-unit measurements of one model at one micro-batch,
sequence length and dtype, written by ``calibrate compute`` and read by ``sim.costs.compute``.

JSON shape::

    "compute": {
      "model": {n_layers, hidden, n_heads, n_kv_heads, ffn_hidden, vocab, tie_embeddings},
      "micro_batch": int, "seq_len": int, "param_dtype": "fp32" | "bf16",
      "units": {"embed": U, "block": U, "head": U},
      "copy_Bps": float,
      "optimizer_s_per_param": {"adamw": float, "sgd": float},          # plain tensors (DDP)
      "fsdp_optimizer_s_per_param": {"adamw": float, "sgd": float},     # DTensor shards (FSDP2)
      "fsdp_unit_overhead_s": {"forward": float, "backward": float},    # FSDP2's host work per unit
      "fsdp1_unit_overhead_s": {"forward": float, "backward": float},   # FSDP1's (optional)
      "deepspeed_step_s_per_param": {"1" | "2" | "3": float},  # DeepSpeed's whole step (optional)
      "deepspeed_layer_overhead_s": {"1" | "2" | "3": {"forward": float, "backward": float}},  # its hooks
      "host_overhead_in_step": bool,   # true where the host is the device (CPU): the overhead adds up
      "compute_slowdown_during_collective": float,
      "compute_time_rel_std": float,   # the spread of one unit's time, run after run (optional, 0)
      "attention_kernel": "flash" | "math"   # the SDPA kernel the scenario's call ran (optional)
    }
    U = {forward_s, backward_s, recompute_s (block only, else 0), saved_activation_bytes,
         forward_transient_bytes, backward_transient_bytes}

A model described from its ``config.json`` (``sim.workload.description``) is measured on its own
units (``calibrate.hf_units``): ``units`` then holds ``embed``, ``head`` and one ``block.<i>`` per
kind of decoder block (``i``: the kind's first block), and two more keys say which model and
which block is which::

      "described_model": {"name": str, "architecture": str, "config_sha256": str,
                          "finetune": str,    # "full", or the LoRA settings' fingerprint
                          "decoder_seq_len": int | null},   # an encoder-decoder's (T5)
      "block_units": ["block.0", "block.1", "block.1", ...]   # the unit of every decoder block

so that the section is never applied to another model. Its units' bytes are 0: a described
model's saved activations and transients are its description's (measured by the same
saved-tensor hooks under ``FakeTensorMode``).

``head`` is the final RMSNorm, the lm_head and HF's causal-LM cross-entropy loss; ``embed`` is the
token embedding (the rotary tables are not part of any unit; ``sim.workload.layers`` models them).
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
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from sim.errors import UserError
from sim.hardware.json_reader import JsonReader

UNITS = ("embed", "block", "head")
MODEL_FIELDS = ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn_hidden", "vocab", "tie_embeddings")
OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True, kw_only=True)
class UnitMeasurement:
    """One unit's measured times (s, means) and bytes."""

    forward_s: float
    backward_s: float
    recompute_s: float
    saved_activation_bytes: int
    forward_transient_bytes: int
    backward_transient_bytes: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


UNIT_FIELDS = tuple(f.name for f in fields(UnitMeasurement))


@dataclass(frozen=True, kw_only=True)
class MeasuredDims:
    """The model dimensions the section was measured at (the fields of ``ModelConfig`` it depends on)."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab: int
    tie_embeddings: bool


@dataclass(frozen=True, kw_only=True)
class DescribedModelKey:
    """Which described model a section's units were measured on."""

    name: str
    architecture: str
    config_sha256: str
    # how it trained: "full", or ``sim.workload.description.finetune_fingerprint`` of the LoRA
    # settings (a LoRA block runs no weight-gradient matmuls for its frozen base)
    finetune: str = "full"
    decoder_seq_len: int | None = None  # an encoder-decoder's decoder length it was measured at


@dataclass(frozen=True, kw_only=True)
class ComputeSection:
    dims: MeasuredDims
    micro_batch: int
    seq_len: int
    param_dtype: str
    units: Mapping[str, UnitMeasurement]
    copy_Bps: float
    optimizer_s_per_param: Mapping[str, float]  # plain tensors (DDP)
    fsdp_optimizer_s_per_param: Mapping[str, float]  # DTensor shards (FSDP2)
    fsdp_forward_overhead_s: float
    fsdp_backward_overhead_s: float
    host_overhead_in_step: bool
    compute_slowdown_during_collective: float = 1.0
    # the relative standard deviation of one decoder block's forward time over repeated runs on
    # every rank at once: the default of ``simulation.compute_jitter`` (ranks drift apart and wait
    # for the late one at every collective); 0 in profiles calibrated before it was measured
    compute_time_rel_std: float = 0.0
    # the SDPA kernel the scenario's own attention call ran when measured ("flash": a fused one,
    # "math"): T5's float position-bias mask sends a CPU's SDPA to its math path, a causal
    # Llama call to its flash kernel; None in profiles calibrated before it was recorded
    attention_kernel: str | None = None
    # FSDP1's host work per unit (FullyShardedDataParallel's hooks and flat-parameter views), measured
    # the same way; None in profiles calibrated before it was measured
    fsdp1_forward_overhead_s: float | None = None
    fsdp1_backward_overhead_s: float | None = None
    # a described model's own units: which model, and the unit that times each decoder block
    described_model: DescribedModelKey | None = None
    block_units: tuple[str, ...] = ()
    # DeepSpeed ZeRO's ``engine.step()`` less its collectives, per element of a rank's partition,
    # by stage ("1", "2", "3"; measured for the calibrated scenario's stage, on a CPU only)
    deepspeed_step_s_per_param: Mapping[str, float] = field(default_factory=dict)
    # its host work per decoder layer beyond its collectives and the modelled copies, by stage
    deepspeed_layer_overhead_s: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def block_unit(self, block: int) -> str:
        """The unit whose measurement times decoder block ``block``."""
        return self.block_units[block] if self.block_units else "block"

    def to_dict(self) -> dict[str, Any]:
        """The section as the profile's JSON stores it."""
        return (
            {
                "model": asdict(self.dims),
                "micro_batch": self.micro_batch,
                "seq_len": self.seq_len,
                "param_dtype": self.param_dtype,
                "units": {name: u.to_dict() for name, u in self.units.items()},
                "copy_Bps": self.copy_Bps,
                "optimizer_s_per_param": dict(self.optimizer_s_per_param),
                "fsdp_optimizer_s_per_param": dict(self.fsdp_optimizer_s_per_param),
                "fsdp_unit_overhead_s": {
                    "forward": self.fsdp_forward_overhead_s,
                    "backward": self.fsdp_backward_overhead_s,
                },
                "host_overhead_in_step": self.host_overhead_in_step,
                "compute_slowdown_during_collective": self.compute_slowdown_during_collective,
                "compute_time_rel_std": self.compute_time_rel_std,
            }
            | ({"attention_kernel": self.attention_kernel} if self.attention_kernel is not None else {})
            | self._fsdp1_dict()
            | self._described_dict()
            | (
                {"deepspeed_step_s_per_param": dict(self.deepspeed_step_s_per_param)}
                if self.deepspeed_step_s_per_param
                else {}
            )
            | (
                {
                    "deepspeed_layer_overhead_s": {
                        k: dict(v) for k, v in self.deepspeed_layer_overhead_s.items()
                    }
                }
                if self.deepspeed_layer_overhead_s
                else {}
            )
        )

    def _described_dict(self) -> dict[str, Any]:
        if self.described_model is None:
            return {}
        return {"described_model": asdict(self.described_model), "block_units": list(self.block_units)}

    def _fsdp1_dict(self) -> dict[str, Any]:
        if self.fsdp1_forward_overhead_s is None or self.fsdp1_backward_overhead_s is None:
            return {}
        return {
            "fsdp1_unit_overhead_s": {
                "forward": self.fsdp1_forward_overhead_s,
                "backward": self.fsdp1_backward_overhead_s,
            }
        }


def _per_optimizer(r: JsonReader, key: str) -> dict[str, float]:
    table = r.sub(key)
    return {opt: table.number(opt) for opt in OPTIMIZERS}


def _dims(r: JsonReader) -> MeasuredDims:
    m = r.sub("model")
    ints = {f: int(m.get(f, int)) for f in MODEL_FIELDS if f != "tie_embeddings"}
    return MeasuredDims(**ints, tie_embeddings=m.get("tie_embeddings", bool))


def parse_compute_section(data: Any, where: str) -> ComputeSection:
    """The typed section; a missing or malformed field is a ``UserError`` naming ``where`` and it."""
    r = JsonReader(data, where, "compute")
    dims = _dims(r)
    described, block_units = _described(data, r, dims.n_layers)
    units = r.sub("units")
    measured = {}
    for name in ("embed", *dict.fromkeys(block_units), "head") if block_units else UNITS:
        u = units.sub(name)
        measured[name] = UnitMeasurement(
            forward_s=u.number("forward_s"),
            backward_s=u.number("backward_s"),
            recompute_s=u.number("recompute_s"),
            saved_activation_bytes=round(u.number("saved_activation_bytes")),
            forward_transient_bytes=round(u.number("forward_transient_bytes")),
            backward_transient_bytes=round(u.number("backward_transient_bytes")),
        )
    overhead = r.sub("fsdp_unit_overhead_s")
    fsdp1 = (
        r.sub("fsdp1_unit_overhead_s") if isinstance(data, dict) and "fsdp1_unit_overhead_s" in data else None
    )
    return ComputeSection(
        dims=dims,
        micro_batch=int(r.get("micro_batch", int)),
        seq_len=int(r.get("seq_len", int)),
        param_dtype=r.get("param_dtype", str),
        units=measured,
        copy_Bps=r.positive("copy_Bps"),
        optimizer_s_per_param=_per_optimizer(r, "optimizer_s_per_param"),
        fsdp_optimizer_s_per_param=_per_optimizer(r, "fsdp_optimizer_s_per_param"),
        fsdp_forward_overhead_s=overhead.number("forward"),
        fsdp_backward_overhead_s=overhead.number("backward"),
        host_overhead_in_step=r.get("host_overhead_in_step", bool),
        compute_slowdown_during_collective=r.number("compute_slowdown_during_collective", 1.0, 1.0),
        compute_time_rel_std=r.number("compute_time_rel_std", 0.0, 0.0),
        attention_kernel=_attention_kernel(r),
        fsdp1_forward_overhead_s=fsdp1.number("forward") if fsdp1 is not None else None,
        fsdp1_backward_overhead_s=fsdp1.number("backward") if fsdp1 is not None else None,
        described_model=described,
        block_units=block_units,
        deepspeed_step_s_per_param=_deepspeed_step(data, r),
        deepspeed_layer_overhead_s=_deepspeed_layer(data, r),
    )


DEEPSPEED_STAGES = ("1", "2", "3")


def _by_stage(data: Any, r: JsonReader, key: str) -> JsonReader | None:
    if not isinstance(data, dict) or key not in data:
        return None
    table = r.sub(key)
    for stage in table.data:
        if stage not in DEEPSPEED_STAGES:
            raise UserError(
                f"{r.where}: field compute.{key} has stage {stage!r}; allowed: {', '.join(DEEPSPEED_STAGES)}"
            )
    return table


def _deepspeed_step(data: Any, r: JsonReader) -> dict[str, float]:
    table = _by_stage(data, r, "deepspeed_step_s_per_param")
    return {} if table is None else {stage: table.number(stage) for stage in table.data}


def _deepspeed_layer(data: Any, r: JsonReader) -> dict[str, dict[str, float]]:
    table = _by_stage(data, r, "deepspeed_layer_overhead_s")
    if table is None:
        return {}
    return {
        stage: {phase: table.sub(stage).number(phase) for phase in ("forward", "backward")}
        for stage in table.data
    }


def _attention_kernel(r: JsonReader) -> str | None:
    kernel = r.get("attention_kernel", str, None)
    if kernel is not None and kernel not in ("flash", "math"):
        raise UserError(f"{r.where}: field compute.attention_kernel must be flash or math, got {kernel!r}")
    return kernel


def _described(data: Any, r: JsonReader, n_layers: int) -> tuple[DescribedModelKey | None, tuple[str, ...]]:
    if not isinstance(data, dict) or "described_model" not in data:
        return None, ()
    m = r.sub("described_model")
    key = DescribedModelKey(
        **{f: m.get(f, str) for f in ("name", "architecture", "config_sha256")},
        finetune=m.get("finetune", str, "full"),  # profiles before LoRA calibration: full training
        decoder_seq_len=m.get("decoder_seq_len", (int, type(None)), None),
    )
    names = r.get("block_units", list)
    if len(names) != n_layers or not all(isinstance(n, str) and n.startswith("block.") for n in names):
        raise UserError(
            f"{r.where}: field compute.block_units must list a block.<i> unit for each of the {n_layers} decoder blocks"
        )
    return key, tuple(names)
