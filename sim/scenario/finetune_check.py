"""What a fine-tuning method (``[finetune]``: LoRA, QLoRA) needs of the system that trains it,
checked at load: its own settings before the model is described (``check_finetune``), and the
systems that model it, with FSDP1's flattening rules (one dtype, one ``requires_grad`` per
``FlatParameter``), on the whole scenario (``check_finetune_system``). Each broken rule is one
``UserError`` naming the file and keys.
"""

from sim.dtypes import FLOAT_DTYPES, canonical_dtype
from sim.errors import UserError
from sim.scenario.sections import FinetuneSection, Scenario
from sim.workload.options import FinetuneMethod, WrapPolicy
from sim.workload.units import build_units


def check_finetune(f: FinetuneSection, param_dtype: str, fsdp_version: int, where: str) -> None:
    """Before the model is described with these settings."""
    if not f.lora:
        return
    for name in ("rank", "alpha"):
        if getattr(f, name) <= 0:
            raise UserError(f"{where}: finetune.{name} must be > 0, got {getattr(f, name)}")
    if not 0 <= f.dropout < 1:
        raise UserError(f"{where}: finetune.dropout must be in [0, 1), got {f.dropout}")
    if f.method is FinetuneMethod.QLORA:
        storage = ("bf16", "fp16", "fp32", "uint8")
        try:
            name = canonical_dtype(f.quant_storage)
        except UserError:
            name = ""
        if name not in storage:
            raise UserError(
                f"{where}: finetune.quant_storage = {f.quant_storage!r} is not allowed; allowed: {', '.join(storage)}"
            )
        compute = canonical_dtype(param_dtype)
        if name in FLOAT_DTYPES and name != compute:
            raise UserError(
                f"{where}: finetune.quant_storage = {name!r} differs from precision.param_dtype = "
                f"{param_dtype!r}: FSDP2 would cast the packed 4-bit weights; use {param_dtype!r} or 'uint8'"
            )
        if fsdp_version == 1 and name != compute:
            # a block's FlatParameter holds its packed weights with its norms, stored in param_dtype;
            # checked here, before the model is described, so _check_fsdp1_lora never meets it
            raise UserError(
                f"{where}: FSDP1 cannot flatten the packed 4-bit weights ({name}) with the blocks' "
                f"{compute} norms (FSDP1 flattens only tensors of one dtype); "
                f'set finetune.quant_storage = "{compute}" (FSDP-QLoRA\'s bnb_4bit_quant_storage)'
            )


def check_finetune_system(s: Scenario, where: str) -> None:
    """LoRA and QLoRA are modelled in the FSDP2, DDP and FSDP1 schedules; accumulation without
    sync in the FSDP2 and DDP ones."""
    fsdp1 = s.parallel.fsdp_version == 1 and not s.deepspeed.enabled
    if s.parallel.wrap is WrapPolicy.PEFT and not (fsdp1 and s.finetune.lora):
        raise UserError(
            f"{where}: parallel.wrap = \"peft\" is PEFT's FSDP1 policy for LoRA's adapters; it needs "
            'parallel.fsdp_version = 1 and finetune.method = "lora" or "qlora"'
        )
    if fsdp1 and s.finetune.lora:
        _check_fsdp1_lora(s, where)
    elif s.deepspeed.enabled and s.finetune.lora:
        raise UserError(
            f"{where}: finetune.method = {s.finetune.method.value!r} is modelled under FSDP2, DDP and "
            "FSDP1 (lora), not DeepSpeed (deepspeed.enabled = false)"
        )
    other = s.parallel.fsdp_version == 1 or s.deepspeed.enabled
    if other and not s.training.sync_every_microbatch:
        raise UserError(
            f"{where}: training.sync_every_microbatch = false is modelled under FSDP2 and DDP only "
            "(parallel.fsdp_version = 2, deepspeed.enabled = false)"
        )


def _check_fsdp1_lora(s: Scenario, where: str) -> None:
    """FSDP1 flattens each unit into one ``FlatParameter``: one dtype, and (``use_orig_params =
    false``) one ``requires_grad``, else ``FullyShardedDataParallel`` refuses; with
    ``use_orig_params = true`` a unit mixing frozen and trainable weights computes, reduce-scatters
    and keeps gradients of the frozen ones too (their views share the flat parameter's
    ``requires_grad``), which the LoRA description does not hold. QLoRA's packed base flattens
    with the block's norms only when ``finetune.quant_storage`` is their dtype (why FSDP-QLoRA
    stores it in bf16)."""
    if s.param_dtype != "fp32" and s.fsdp1.mixed_precision:
        # measured: a real 2-rank gloo step of PEFT's fp32 adapters over a bf16 base under
        # MixedPrecision(param_dtype=bf16) fails in its first forward ("expected m1 and m2 to have
        # the same dtype"): PEFT casts an adapter's input to the dtype its sharded fp32 weight shows,
        # FSDP1 hands the matmul the bf16 unsharded one
        raise UserError(
            f'{where}: FSDP1 with finetune.method = "lora" and precision.param_dtype = {s.param_dtype!r} '
            "fails in the real system without autocast (PEFT casts each adapter's input to its fp32 "
            'shard\'s dtype, FSDP1 computes with the low-precision weight); modelled: param_dtype = "fp32", '
            "or fsdp1.mixed_precision = false (no MixedPrecision: a base stored in param_dtype, fp32 adapters)"
        )
    for unit in build_units(s.model, s.parallel.wrap):
        label = "the root" if unit.is_root else f"unit {unit.name}"
        if len({p.trainable for p in unit.params}) > 1:
            why = (
                "with fsdp1.use_orig_params = true FSDP1 computes and reduces the frozen weights' "
                "gradients too, which is not modelled"
                if s.fsdp1.use_orig_params
                else "FSDP1 flattens only tensors of one requires_grad without fsdp1.use_orig_params"
            )
            raise UserError(
                f"{where}: {label} mixes frozen and trainable parameters: {why}; set "
                'parallel.wrap = "peft" (PEFT\'s fsdp_auto_wrap_policy: every adapter its own unit)'
            )
        dtypes = sorted({p.dtype or "fp32" for p in unit.params})  # trainable ones: fp32 masters
        if len(dtypes) > 1:
            raise UserError(
                f"{where}: FSDP1 cannot flatten {label}: its parameters are {' and '.join(dtypes)} "
                "(FSDP1 flattens only tensors of one dtype)"
            )
