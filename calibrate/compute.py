"""What ``calibrate compute`` measures, shaped as the profile's typed ``compute`` section
(``sim.hardware.compute_section``, where the format and its checks live)."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sim.errors import UserError
from sim.hardware.compute_section import (
    MODEL_FIELDS,
    ComputeSection,
    DescribedModelKey,
    MeasuredDims,
    UnitMeasurement,
)
from sim.workload.description import finetune_fingerprint
from sim.workload.model import ModelConfig, layer_params

# an encoder-decoder's stacks (their block lists) and the config key of each one's depth: T5's,
# the two stacks ``calibrate.hf_units`` can cut (a decoder's one stack is ``num_hidden_layers``)
STACK_DEPTH_KEYS = {"encoder.block": "num_layers", "decoder.block": "num_decoder_layers"}


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
    # the scenario's DeepSpeed config (``sim.scenario.deepspeed_config``) when it trains under
    # DeepSpeed ZeRO: its optimizer step is then timed through the real engine
    deepspeed_config: Mapping[str, Any] | None = None

    def model_dict(self) -> dict[str, Any]:
        return {f: getattr(self.model, f) for f in MODEL_FIELDS}

    def described_key(self) -> DescribedModelKey | None:
        d = self.model.description
        if d is None:
            return None
        return DescribedModelKey(
            name=d.name,
            architecture=d.architecture,
            config_sha256=d.config_sha256,
            finetune=finetune_fingerprint(d.finetune),
            decoder_seq_len=d.decoder_seq_len,
        )

    @property
    def finetuned(self) -> bool:
        """A described model trained with LoRA (its base frozen)."""
        d = self.model.description
        return d is not None and d.finetune is not None

    def check_measurable(self) -> None:
        """Refuse, in one line, a described model this calibration cannot time as it trains."""
        d = self.model.description
        if d is None:
            return
        qlora = d.finetune is not None and d.finetune.method == "qlora"
        stacks = {b.rpartition(".")[0] for b in d.blocks}
        other_stacks = len(stacks) > 1 and stacks != set(STACK_DEPTH_KEYS)
        if qlora or other_stacks:
            # QLoRA: bitsandbytes' 4-bit kernels are not what this host would run; measured on a
            # compute-dtype base, the scales would cancel the modelled dequantization. Two stacks:
            # T5's only, whose depth keys STACK_DEPTH_KEYS knows
            what = "fine-tuned with QLoRA" if qlora else "an encoder-decoder other than T5's two stacks"
            raise UserError(
                f"calibrate compute: model {d.name} is {what}; it is timed by the kernel model only "
                "(use a profile without a compute section)"
            )

    def block_param_shapes(self, *, trainable_only: bool = False) -> list[tuple[int, ...]]:
        """The parameter shapes of the first decoder block (a described model's own; under LoRA
        with ``trainable_only``, its adapters')."""
        d = self.model.description
        if d is None:
            return [s.shape for s in layer_params(self.model, 0)]
        inside = [s for s in d.params if s.name.startswith(d.blocks[0] + ".")]
        return [s.shape for s in inside if s.trainable or not trainable_only]


def compute_section(
    target: ComputeTarget,
    units: Mapping[str, UnitMeasurement],
    *,
    copy_Bps: float,
    optimizer_s_per_param: Mapping[str, float],
    fsdp_optimizer_s_per_param: Mapping[str, float],
    fsdp_unit_overhead_s: Mapping[str, float],
    host_overhead_in_step: bool,
    slowdown: float,
    time_rel_std: float = 0.0,
    attention_kernel: str | None = None,
    fsdp1_unit_overhead_s: Mapping[str, float] | None = None,
    block_units: tuple[str, ...] = (),
    deepspeed_step_s_per_param: Mapping[str, float] | None = None,
    deepspeed_layer_overhead_s: Mapping[str, Mapping[str, float]] | None = None,
) -> ComputeSection:
    return ComputeSection(
        dims=MeasuredDims(**target.model_dict()),
        micro_batch=target.micro_batch,
        seq_len=target.seq_len,
        param_dtype=target.param_dtype,
        units=dict(units),
        copy_Bps=copy_Bps,
        optimizer_s_per_param=dict(optimizer_s_per_param),
        fsdp_optimizer_s_per_param=dict(fsdp_optimizer_s_per_param),
        fsdp_forward_overhead_s=fsdp_unit_overhead_s["forward"],
        fsdp_backward_overhead_s=fsdp_unit_overhead_s["backward"],
        host_overhead_in_step=host_overhead_in_step,
        compute_slowdown_during_collective=slowdown,
        compute_time_rel_std=time_rel_std,
        attention_kernel=attention_kernel,
        fsdp1_forward_overhead_s=fsdp1_unit_overhead_s["forward"] if fsdp1_unit_overhead_s else None,
        fsdp1_backward_overhead_s=fsdp1_unit_overhead_s["backward"] if fsdp1_unit_overhead_s else None,
        described_model=target.described_key(),
        block_units=block_units,
        deepspeed_step_s_per_param=dict(deepspeed_step_s_per_param or {}),
        deepspeed_layer_overhead_s=dict(deepspeed_layer_overhead_s or {}),
    )
