"""LoRA and QLoRA on a built model, as PEFT applies them (torch side).

``apply_lora`` runs PEFT's own ``get_peft_model`` with a ``LoraConfig`` on the model in place (meta
device, fake mode or real tensors alike): every target linear becomes PEFT's ``lora.Linear`` with
the frozen original as ``base_layer`` and trainable ``lora_A`` (rank × in) and ``lora_B`` (out ×
rank); every other parameter is frozen (``requires_grad = False``); the adapters are kept in fp32
when the base is in a lower precision (PEFT's ``autocast_adapter_dtype``). Parameter and module
paths stay those of the transformers model (``PeftModel.base_model.model`` is the same object).

``quantized_params`` names the weights QLoRA stores in 4 bits: every frozen ``nn.Linear`` weight
inside the decoder blocks, as the FSDP-QLoRA recipe quantizes them (Answer.AI's ``fsdp_qlora``
``replace_linear(model.model, Linear4bit, skip_modules=["lm_head"])``; transformers'
``replace_with_bnb_linear`` likewise keeps the output head). The adapters, norms, embeddings, the
head and experts' stacked 3-D weights (not ``nn.Linear``) stay in the compute dtype.
"""

from typing import Any

import torch
from torch import nn

from sim.errors import UserError

FULL = "full"
LORA_METHODS = ("lora", "qlora")


def lora_config(finetune: dict[str, Any]) -> Any:
    from peft import LoraConfig

    targets = finetune.get("target_modules")
    return LoraConfig(
        r=int(finetune["rank"]),
        lora_alpha=int(finetune["alpha"]),
        lora_dropout=float(finetune.get("dropout", 0.0)),
        target_modules=list(targets) if isinstance(targets, list | tuple) else targets,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(
    model: nn.Module, finetune: dict[str, Any], *, adapters_in_base_dtype: bool = False
) -> nn.Module:
    """PEFT's LoRA on ``model`` in place (``finetune``: rank, alpha, dropout, target_modules);
    returns ``model`` itself, its target linears wrapped and everything but the adapters frozen.

    ``adapters_in_base_dtype`` keeps the adapters in the base's dtype, as FSDP2's mixed precision
    hands them to the forward (``param_dtype``): measuring with fp32 adapters over a bf16 base
    would measure PEFT's input casts, which an FSDP2 run with ``param_dtype = bf16`` never makes."""
    try:
        from peft import get_peft_model
    except ImportError:
        raise UserError("finetune.method lora/qlora is measured with PEFT: pip install peft") from None
    from torch._subclasses.fake_tensor import FakeTensor

    first = next(model.parameters())
    previous, to = torch.get_default_dtype(), nn.Module.to
    # adapters are created in the dtype they keep; under FakeTensorMode PEFT's moves of the new
    # modules to the base layer's device and dtype (no-ops: all are fake CPU tensors of that
    # dtype) are skipped, since nn.Module swaps fake parameters on conversion and fake mode's weak
    # references forbid the swap
    torch.set_default_dtype(first.dtype if adapters_in_base_dtype else adapter_dtype(first.dtype))
    if isinstance(first, FakeTensor):
        nn.Module.to = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        peft_model = get_peft_model(
            model, lora_config(finetune), autocast_adapter_dtype=not adapters_in_base_dtype
        )
    except ValueError as e:
        raise UserError(f"finetune.target_modules: PEFT cannot apply LoRA ({e})") from None
    finally:
        torch.set_default_dtype(previous)
        nn.Module.to = to  # type: ignore[method-assign]
    inner = peft_model.base_model.model
    assert inner is model
    return model


def frozen_params(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def quantized_params(model: nn.Module, blocks: list[str]) -> list[str]:
    """The weights QLoRA quantizes: frozen ``nn.Linear`` weights inside the decoder blocks."""
    out = []
    for path, module in model.named_modules():
        inside = any(path == b or path.startswith(b + ".") for b in blocks)
        if inside and isinstance(module, nn.Linear) and not module.weight.requires_grad:
            out.append(f"{path}.weight")
    return out


def adapter_dtype(base: torch.dtype) -> torch.dtype:
    """PEFT's ``autocast_adapter_dtype``: adapters in fp32 over a bf16/fp16 base."""
    return torch.float32 if base in (torch.bfloat16, torch.float16) else base


def quantize_base(model: nn.Module, blocks: list[str], *, storage: torch.dtype, double_quant: bool) -> int:
    """QLoRA's base, as the FSDP-QLoRA recipe builds it: every ``nn.Linear`` inside the decoder
    blocks replaced by bitsandbytes' ``Linear4bit`` (NF4, block size 64, ``compress_statistics``
    = double quantization, ``quant_storage``) holding its weight quantized. Real tensors only
    (bitsandbytes' fake kernels produce shapes, not quantization). Call before ``apply_lora``,
    so that PEFT wraps the 4-bit layers with its own ``lora.Linear4bit``. Returns the bytes of
    the quantization states (module attributes FSDP does not shard, whole on every rank)."""
    from bitsandbytes.nn import Linear4bit, Params4bit

    compute = next(model.parameters()).dtype
    for path, module in list(model.named_modules()):
        inside = any(path == b or path.startswith(b + ".") for b in blocks)
        if not inside:
            continue
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            q = Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=compute,
                compress_statistics=double_quant,
                quant_type="nf4",
                quant_storage=storage,
            )
            q.weight = Params4bit(
                child.weight.data,
                requires_grad=False,
                compress_statistics=double_quant,
                quant_type="nf4",
                quant_storage=storage,
                module=q,
            )
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(module, name, q.to(child.weight.device))
    return quant_state_bytes(model)


def quant_state_bytes(model: nn.Module) -> int:
    """Bytes of every 4-bit layer's quantization state (each storage once)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        state = getattr(module, "quant_state", None)
        if state is None:
            continue
        tensors = [state.absmax, state.code, getattr(state, "offset", None)]
        nested = getattr(state, "state2", None)
        if nested is not None:
            tensors += [nested.absmax, nested.code]
        for t in tensors:
            if isinstance(t, torch.Tensor):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
