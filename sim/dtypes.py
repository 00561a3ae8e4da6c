"""The one table of element sizes. Every byte count in the simulator goes through ``dtype_bytes``."""

from sim.errors import UserError

DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "uint8": 1,  # QLoRA's packed 4-bit weights may be stored as bytes (bnb_4bit_quant_storage)
}
FLOAT_DTYPES = frozenset({"fp32", "bf16", "fp16", "fp8"})  # what compute and mixed precision take

# Spellings users bring from torch (``torch.bfloat16``) and from other tools.
DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8": "fp8",
}

INDEX_BYTES = 8  # token ids are int64 in torch
FP32_BYTES = DTYPE_BYTES["fp32"]  # the fp32 internals (upcasts, log-sum-exp, accumulators) of any dtype


def canonical_dtype(name: str) -> str:
    """Return the canonical short name (``fp32``, ``bf16``, ...) or raise a UserError."""
    key = name.lower().removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        allowed = ", ".join(DTYPE_BYTES)
        raise UserError(f"unknown dtype {name!r}; allowed: {allowed}")
    return key


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype given by any accepted spelling."""
    return DTYPE_BYTES[canonical_dtype(name)]
