"""LoRA and QLoRA: which parameters train, how QLoRA stores its 4-bit base, and what dequantizing
it costs. Pure functions; the ops themselves are measured with PEFT (``hfmodel.finetune``).

- **LoRA** (PEFT ``LoraConfig``): each target linear keeps its weight frozen (``base_layer``) and
  adds trainable ``lora_A`` (rank × in) and ``lora_B`` (out × rank); every other parameter is
  frozen. Frozen parameters have no gradient and no optimizer state; they are stored in the
  compute dtype (the base is loaded in ``precision.param_dtype``; FSDP2 then all-gathers them
  without a cast), the adapters in fp32 (PEFT's ``autocast_adapter_dtype``).
- **QLoRA** (bitsandbytes 0.50 ``Params4bit``, NF4, block size 64): a weight of n elements is
  stored packed, two 4-bit values a byte, as ``((n + 1) // (2 · itemsize), 1)`` elements of
  ``bnb_4bit_quant_storage`` (``_ops.py`` ``quantize_4bit`` fake); FSDP2 shards and all-gathers
  that packed tensor. Its quantization state (``functional.quantize_4bit``) stays whole on every
  rank, as a module attribute FSDP does not shard: absmax per 64-element block, with double
  quantization (``compress_statistics``) as uint8 bytes plus an fp32 absmax per 256 of them
  (``quantize_blockwise``) and an fp32 offset, without it as fp32; the 16-entry NF4 code (fp32)
  per weight, and with double quantization the nested state's 256-entry dynamic code, which
  ``quantize_blockwise`` copies into every state (``code.to(A.device, copy=True)``).
- **Dequantization** (``backends/cuda/ops.py`` ``_dequant_linear_fallback``, which training's
  large token counts take: past M = 1536 rows, and on sm90/sm100 well before): the nested absmax
  is dequantized to fp32 and the offset added (two fp32 block vectors live), then the weight is
  dequantized into a compute-dtype copy of n elements that lives while ``F.linear`` runs. The
  backward (``autograd/_functions.py`` ``MatMul4Bit.backward``) dequantizes again for the input
  gradient (``functional.dequantize_4bit``: the absmax offset added in place). Each pass moves the
  packed bytes, the absmax vectors and the n-element output at the streaming bandwidth.
"""

from dataclasses import dataclass, replace
from math import ceil
from typing import Any

from sim.dtypes import FP32_BYTES, dtype_bytes
from sim.workload.params import ParamSpec

NF4_BLOCK = 64  # bitsandbytes' default 4-bit block size
NESTED_BLOCK = 256  # the double quantization's block of absmax values
NF4_CODE_BYTES = 16 * 4  # get_4bit_type("nf4"): 16 fp32 values, one tensor per weight
DYNAMIC_CODE_BYTES = 256 * 4  # create_dynamic_map(): 256 fp32 values, copied into each nested state


@dataclass(frozen=True, kw_only=True)
class FinetuneFacts:
    """How the described model is fine-tuned, as the description records it."""

    method: str
    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...] | str | None
    frozen: frozenset[str]
    quantized: frozenset[str]
    quant_storage: str = "bf16"
    double_quant: bool = True
    adapter_dtype: str | None = None  # the adapters' own compute dtype, where not the base's

    def lora_settings(self) -> dict[str, Any]:
        """The LoRA settings as ``hfmodel.finetune.apply_lora`` takes them (PEFT's ``LoraConfig``)."""
        targets = self.target_modules
        out: dict[str, Any] = {
            "method": self.method,
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "target_modules": list(targets) if isinstance(targets, tuple) else targets,
        }
        if self.adapter_dtype is not None:
            out["adapter_dtype"] = self.adapter_dtype
        return out


def packed_rows(numel: int, storage: str) -> int:
    """Rows of the ``(rows, 1)`` packed tensor of an n-element weight."""
    return (numel + 1) // (2 * dtype_bytes(storage))


def blocks(numel: int) -> int:
    return ceil(numel / NF4_BLOCK)


def quant_state_bytes(numel: int, double_quant: bool) -> int:
    """One weight's quantization state."""
    b = blocks(numel)
    if double_quant:
        nested = FP32_BYTES * ceil(b / NESTED_BLOCK) + DYNAMIC_CODE_BYTES
        return b + nested + FP32_BYTES + NF4_CODE_BYTES
    return FP32_BYTES * b + NF4_CODE_BYTES


def total_quant_state_bytes(params: tuple[ParamSpec, ...], double_quant: bool) -> int:
    """Every quantized weight's state: whole on every rank."""
    return sum(quant_state_bytes(p.quantized_numel, double_quant) for p in params if p.quantized_numel)


def dequant_bytes(numel: int, act_bytes: int, double_quant: bool) -> int:
    """Bytes one dequantization moves: the nested absmax to fp32 (read the uint8 bytes and the
    fp32 per-256 absmax, write fp32) and the offset added (read and write fp32), then the packed
    weight and the fp32 absmax read and the n-element compute-dtype weight written."""
    b = blocks(numel)
    weight = (numel + 1) // 2 + FP32_BYTES * b + numel * act_bytes
    if not double_quant:
        return weight
    return weight + (b + FP32_BYTES * ceil(b / NESTED_BLOCK) + FP32_BYTES * b) + 2 * FP32_BYTES * b


def dequant_kernels(double_quant: bool) -> int:
    """Kernels one dequantization launches (nested absmax, offset add, the weight)."""
    return 3 if double_quant else 1


def dequant_transient_bytes(numel: int, act_bytes: int, double_quant: bool, *, backward: bool) -> int:
    """What one dequantization holds while its matmul runs: the compute-dtype weight and the fp32
    absmax (forward: the dequantized and the offset one, both locals of the fallback; backward:
    one, the offset added in place)."""
    absmax = (1 if backward else 2) * FP32_BYTES * blocks(numel) if double_quant else 0
    return numel * act_bytes + absmax


def finetuned_params(
    params: tuple[ParamSpec, ...], facts: FinetuneFacts, base_dtype: str
) -> tuple[ParamSpec, ...]:
    """The described parameters with the method's roles: frozen ones stored in ``base_dtype``,
    quantized ones as their packed storage."""
    out = []
    for p in params:
        if p.name in facts.quantized:
            rows = packed_rows(p.numel, facts.quant_storage)
            p = replace(
                p, shape=(rows, 1), trainable=False, dtype=facts.quant_storage, quantized_numel=p.numel
            )
        elif p.name in facts.frozen:
            p = replace(p, trainable=False, dtype=base_dtype)
        out.append(p)
    return tuple(out)
