"""Build a ``transformers`` language model from a config dict, as training runs it: SDPA attention
(or the measuring probe), no KV cache, MoE experts as grouped matmuls (``experts_implementation =
"grouped_mm"``, the dropless token-sorted path torchtitan also uses). A decoder-only config builds
its causal LM; an encoder-decoder one (``is_encoder_decoder``: T5) its sequence-to-sequence LM
(``T5ForConditionalGeneration``), trained as transformers trains it: ``model(input_ids, labels)``,
the decoder's input the labels shifted right."""

import copy
from typing import Any

import torch
from torch import nn

from sim.errors import UserError

# dict keys a config.json carries that describe the checkpoint, not the architecture
CHECKPOINT_KEYS = ("quantization_config", "auto_map", "_name_or_path", "transformers_version")


def hf_config(config: dict[str, Any], *, attn: str = "sdpa", use_cache: bool = False) -> Any:
    """The ``PretrainedConfig`` of a config.json dict (its ``model_type`` picks the class); the dict
    is copied first, as transformers rewrites nested ones (``rope_scaling``) in place. ``use_cache``:
    the KV cache a training forward keeps (a scenario's ``model.use_cache``; off by default)."""
    from transformers import AutoConfig

    data = copy.deepcopy({k: v for k, v in config.items() if k not in CHECKPOINT_KEYS})
    model_type = data.pop("model_type", None)
    if not isinstance(model_type, str):
        raise UserError("config.json has no model_type")
    try:
        cfg = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as e:
        raise UserError(f"config.json: transformers cannot build model_type {model_type!r} ({e})") from None
    if attn == "fsdpsim_probe":
        from hfmodel.probe import register_probe

        register_probe()
    # training: no KV cache unless asked (with checkpointing a cache keeps every layer's K/V)
    cfg.use_cache = use_cache
    cfg._attn_implementation = attn
    # MoE experts: transformers' default, "grouped_mm", is what runs (left unset on purpose: dense
    # classes refuse the setting)
    if getattr(cfg, "text_config", None) is not None and not hasattr(cfg, "vocab_size"):
        raise UserError(f"config.json: model_type {model_type!r} is multimodal; give its text config")
    return cfg


def is_encoder_decoder(cfg: Any) -> bool:
    return bool(getattr(cfg, "is_encoder_decoder", False))


def build_causal_lm(cfg: Any, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` (an encoder-decoder: ``AutoModelForSeq2SeqLM``) on the
    current device context (meta, fake or CPU)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    torch.manual_seed(seed)
    auto = AutoModelForSeq2SeqLM if is_encoder_decoder(cfg) else AutoModelForCausalLM
    try:
        model = auto.from_config(cfg, dtype=dtype)
    except ValueError as e:
        if cfg._attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(e):
            raise UserError(f"config.json: no causal-LM class for {cfg.model_type!r} ({e})") from None
        cfg._attn_implementation = "eager"  # a class without SDPA support (Gemma 2's soft-capping)
        model = auto.from_config(cfg, dtype=dtype)
    return model.train()


def block_stacks(blocks: list[str]) -> dict[str, list[int]]:
    """Each stack's block list path (``model.layers``; T5's ``encoder.block``, ``decoder.block``)
    -> the indices, over all of ``blocks``, of its blocks, in order."""
    stacks: dict[str, list[int]] = {}
    for i, path in enumerate(blocks):
        stacks.setdefault(path.rpartition(".")[0], []).append(i)
    return stacks


def block_prefixes(model: nn.Module) -> list[str]:
    """Module paths of the wrap units: the instances of the class's ``_no_split_modules``, in
    registration (forward) order, outermost only. An encoder-decoder has two stacks of them
    (``encoder.block.*`` then ``decoder.block.*``): the encoder runs first."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found: list[str] = []
    for path, module in model.named_modules():
        if type(module).__name__ in names and not any(path.startswith(p + ".") for p in found):
            found.append(path)
    return found
