"""The model description of a config.json at one micro-batch, sequence length and dtype.

1. The meta-device model gives every parameter (names and shapes, registration order, a tied
   weight once), the module buffers and the wrap units (``_no_split_modules``).
2. Decoder layers that are built alike (same parameter shapes, module classes, attention type
   and window) are measured once: the fake model keeps one representative of each kind, and
   its ops are copied to the others under their own names.
3. One forward and backward under ``FakeTensorMode`` with the attention probe measures every op
   (``hfmodel.trace``).
"""

import hashlib
import json
from importlib import metadata
from typing import Any

import torch
from torch import nn

from hfmodel.build import block_prefixes, block_stacks, build_causal_lm, hf_config, is_encoder_decoder
from hfmodel.finetune import FULL, apply_lora, frozen_params, quantized_params
from hfmodel.ops import owner_block
from hfmodel.probe import PROBE, ProbeRecorder
from hfmodel.trace import HostCalls, OpRecord, Owners, SavedBytes, Tracer
from hfmodel.trace_figures import backward_live_bytes, finish
from sim.dtypes import canonical_dtype
from sim.errors import UserError
from sim.workload.description import DESCRIPTION_VERSION

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def config_sha256(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _layer_signature(layer: nn.Module) -> str:
    """What makes two decoder layers measure alike."""
    parts = [f"{n}:{tuple(p.shape)}" for n, p in layer.named_parameters()]
    parts += [f"{n}:{type(m).__name__}" for n, m in layer.named_modules()]
    for n, m in layer.named_modules():
        for attr in ("attention_type", "sliding_window", "is_sliding"):
            if isinstance(getattr(m, attr, None), int | str | bool):
                parts.append(f"{n}.{attr}={getattr(m, attr)}")
    return "|".join(parts)


def representatives(model: nn.Module, blocks: list[str], *, first_alone: bool = False) -> list[int]:
    """For every block, the index of the first block built like it. ``first_alone``: the first
    block is measured on its own (under LoRA its input, from the frozen embedding, needs no
    gradient, so it saves less and runs no input-gradient matmuls)."""
    modules = dict(model.named_modules())
    first: dict[str, int] = {}
    return [
        first.setdefault(("first|" if first_alone and i == 0 else "") + _layer_signature(modules[p]), i)
        for i, p in enumerate(blocks)
    ]


def _moe(cfg: Any) -> dict[str, int] | None:
    experts = next(
        (
            getattr(cfg, a)
            for a in ("num_local_experts", "num_experts", "n_routed_experts")
            if getattr(cfg, a, None)
        ),
        None,
    )
    if not experts:
        return None
    shared = getattr(cfg, "n_shared_experts", None) or (
        1 if getattr(cfg, "shared_expert_intermediate_size", 0) else 0
    )
    return {"experts": int(experts), "top_k": int(cfg.num_experts_per_tok), "shared_experts": int(shared)}


def _dims(cfg: Any, n_blocks: int, tied: bool) -> dict[str, Any]:
    """The config's dimensions (T5's ``d_model``, ``num_heads``, ``d_kv`` through its attribute
    map; its ``d_ff``; an encoder-decoder's ``n_layers`` counts both stacks' blocks)."""
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {
        "n_layers": n_blocks,
        "hidden": cfg.hidden_size,
        "n_heads": heads,
        "n_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "ffn_hidden": getattr(cfg, "intermediate_size", 0) or getattr(cfg, "d_ff", 0) or 4 * cfg.hidden_size,
        "vocab": cfg.vocab_size,
        "tie_embeddings": tied,
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
    }


def _finetuned(model: nn.Module, finetune: dict[str, Any] | None) -> nn.Module:
    """The model as the fine-tuning method trains it: PEFT's LoRA applied (QLoRA's base is traced
    in the compute dtype; its 4-bit storage and dequantization are the simulator's, from
    bitsandbytes' formulas, since bitsandbytes' fake kernels allocate nothing)."""
    if not finetune or finetune.get("method", FULL) == FULL:
        return model
    # adapters in the compute dtype (FSDP2's and DDP's mixed precision casts them), unless the step
    # computes them in their own (``adapter_dtype``: FSDP1 without MixedPrecision, PEFT's fp32)
    return apply_lora(model, finetune, adapters_in_base_dtype=finetune.get("adapter_dtype") is None)


def _finetune_facts(
    model: nn.Module, finetune: dict[str, Any] | None, blocks: list[str]
) -> dict[str, Any] | None:
    if not finetune or finetune.get("method", FULL) == FULL:
        return None
    quantized = quantized_params(model, blocks) if finetune["method"] == "qlora" else []
    return {**finetune, "frozen": frozen_params(model), "quantized": quantized}


def _meta_facts(cfg: Any, dtype: torch.dtype, finetune: dict[str, Any] | None = None) -> dict[str, Any]:
    with torch.device("meta"):
        model = _finetuned(build_causal_lm(cfg, dtype), finetune)
    blocks = block_prefixes(model)
    params = [[n, list(p.shape)] for n, p in model.named_parameters()]
    tied = len(params) < len(list(model.named_parameters(remove_duplicate=False)))
    buffer_bytes = sum(b.numel() * b.element_size() for _, b in model.named_buffers())
    return {
        "architecture": type(model).__name__,
        "blocks": blocks,
        "params": params,
        "buffer_bytes": buffer_bytes,
        "tied": tied,
        "reps": representatives(
            model, blocks, first_alone=finetune is not None and finetune.get("method", FULL) != FULL
        ),
        "param_modules": {n: n.rpartition(".")[0] for n, _ in model.named_parameters()},
        "param_users": _param_users(model),
        "direct_3d": sorted({n.rpartition(".")[0] for n, p in model.named_parameters() if p.dim() == 3}),
        "finetune": _finetune_facts(model, finetune, blocks),
    }


def _keep_representatives(model: nn.Module, cfg: Any, blocks: list[str], reps: list[int]) -> dict[str, str]:
    """Trim every stack of blocks (one for a decoder, the encoder's and the decoder's for an
    encoder-decoder) to its representatives; returns each kept block's path in the trimmed model
    -> its path in the whole one."""
    modules = dict(model.named_modules())
    keep = set(reps)
    stacks = block_stacks(blocks)
    rename: dict[str, str] = {}
    for container_path, indices in stacks.items():
        kept = [i for i in indices if i in keep]
        rename |= {f"{container_path}.{j}": blocks[i] for j, i in enumerate(kept)}
        container = modules[container_path]
        if not isinstance(container, nn.ModuleList) or len(kept) == len(indices):
            continue
        parent, _, attr = container_path.rpartition(".")
        setattr(modules[parent] if parent else model, attr, nn.ModuleList([modules[blocks[i]] for i in kept]))
        if len(stacks) == 1:  # a decoder's layer count (an encoder-decoder's stacks loop over their lists)
            for owner in (cfg, getattr(cfg, "text_config", None)):
                if owner is not None and hasattr(owner, "num_hidden_layers"):
                    owner.num_hidden_layers = len(kept)
    return rename


def _inputs(cfg: Any, batch: int, seq: int, decoder_seq: int) -> dict[str, Any]:
    """A training step's inputs: token ids and labels; an encoder-decoder's labels (its decoder's
    tokens, shifted right into the decoder's input) have the decoder's own length."""
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    labels = torch.randint(0, cfg.vocab_size, (batch, decoder_seq)) if is_encoder_decoder(cfg) else ids
    return {"input_ids": ids, "labels": labels}


def _param_users(model: nn.Module) -> dict[str, list[str]]:
    """Every module that holds each parameter, a tied one under all its names (T5's ``shared``
    weight is the encoder's and the decoder's embedding and the head)."""
    first: dict[int, str] = {}
    users: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = first.setdefault(id(p), name)
        users.setdefault(key, []).append(name.rpartition(".")[0])
    return users


def _trace(
    cfg: Any,
    dtype: torch.dtype,
    reps: list[int],
    blocks: list[str],
    batch: int,
    seq: int,
    finetune: dict[str, Any] | None = None,
    decoder_seq: int | None = None,
):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = build_causal_lm(cfg, dtype)
        rename = _keep_representatives(model, cfg, blocks, reps)
        model = _finetuned(model, finetune)
        paths = {id(m): p for p, m in model.named_modules()}
        params = list(model.parameters())
        owners = Owners(model)
        tracer = Tracer(owners, params)
        probe = ProbeRecorder(tracer, paths)
        probe.register()
        step_inputs = _inputs(cfg, batch, seq, decoder_seq or seq)
        with tracer, HostCalls(owners, tracer), SavedBytes(tracer).hooks:
            loss = model(**step_inputs).loss
            tracer.watch_parameter_grads(loss.grad_fn)
            tracer.backward = True
            loss.backward()
        grads = {tracer_key(p.grad) for p in params if p.grad is not None}
        kernel_inputs: dict[int, frozenset[int]] = {}
        for op, call in zip(probe.ops, probe.inputs, strict=True):
            uids = {uid for uid, _, _ in call if uid is not None}
            kernel_inputs[op] = kernel_inputs.get(op, frozenset()) | uids
        finish(tracer, grads, block_of=lambda op: owner_block(op, blocks), kernel_inputs=kernel_inputs)
        owners.remove()
        # whether autograd keeps each call's output anyway (a trainable projection after it saves
        # it): then the model's ops count it, else the kernel's own saved output must be added
        counted = [uid is not None and uid in tracer.saved for uid in probe.outputs]
        extra = [_view_storage_extra(inputs, tracer.saved) for inputs in probe.inputs]
        # what the model's backward holds as each kernel's backward starts (its output's gradient
        # among it): a kernel that frees some of it before its own peak (eager) needs the figure
        starts = [0 if s is None else backward_live_bytes(tracer, grads, s) for s in probe.backward_steps]
    calls = [
        {**call.__dict__, "output_counted": c, "extra_saved_bytes": x, "backward_start_bytes": b}
        for call, c, x, b in zip(probe.calls, counted, extra, starts, strict=True)
    ]
    return tracer.ops, calls, rename


def _view_storage_extra(inputs: list[tuple[int | None, int, int]], saved: set[int]) -> int:
    """What saving q, k, v keeps beyond their own bytes: the rest of each storage they view that
    nothing else saves (a fused qkv projection's output, of which v is a slice)."""
    by_storage: dict[int, tuple[int, int]] = {}
    for uid, storage, view in inputs:
        if uid is None or uid in saved:
            continue
        total, views = by_storage.get(uid, (storage, 0))
        by_storage[uid] = (total, views + view)
    return sum(max(0, total - views) for total, views in by_storage.values())


def tracer_key(t: torch.Tensor) -> int:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage()).cdata


def _renamed(path: str, rename: dict[str, str]) -> str:
    for old, new in rename.items():
        if path == old or path.startswith(old + "."):
            return new + path[len(old) :]
    return path


def describe(
    config: dict[str, Any],
    *,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    name: str,
    finetune: dict[str, Any] | None = None,
    decoder_seq_len: int | None = None,
) -> dict[str, Any]:
    """The description (a JSON-ready dict, ``sim.workload.description`` reads it); ``finetune``
    (method, rank, alpha, dropout, target_modules, ...) describes the model LoRA trains;
    ``decoder_seq_len`` is an encoder-decoder's decoder length (default ``seq_len``; a decoder-only
    model refuses another)."""
    from hfmodel.ops import assemble_ops

    dtype = canonical_dtype(dtype)
    sha = config_sha256(config)
    cfg = hf_config(config, attn=PROBE)
    meta = _meta_facts(cfg, TORCH_DTYPES[dtype], finetune)
    blocks = meta["blocks"]
    decoder_seq = _decoder_seq_len(cfg, seq_len, decoder_seq_len)
    ops, calls, rename = _trace(
        cfg, TORCH_DTYPES[dtype], meta["reps"], blocks, micro_batch, seq_len, finetune, decoder_seq
    )
    for op in ops:
        op.owner = (
            _renamed(op.owner.removeprefix("attention:"), rename)
            if op.module_type == "AttentionProbe"
            else _renamed(op.owner, rename)
        )
    calls = [{**call, "module": _renamed(call["module"], rename)} for call in calls]
    return {
        "version": DESCRIPTION_VERSION,
        "name": name,
        "model_type": config.get("model_type"),
        "architecture": meta["architecture"],
        "config_sha256": sha,
        "config": config,
        "dims": _dims(cfg, len(blocks), meta["tied"]),
        "moe": _moe(cfg),
        "params": meta["params"],
        "buffer_bytes": meta["buffer_bytes"],
        "blocks": blocks,
        "measured": {
            "micro_batch": micro_batch,
            "seq_len": seq_len,
            **({"decoder_seq_len": decoder_seq} if decoder_seq is not None else {}),
            "dtype": dtype,
            "transformers": metadata.version("transformers"),
            "torch": torch.__version__,
        },
        "ops": assemble_ops(ops, calls, meta, blocks),
        "finetune": meta["finetune"],
    }


def _decoder_seq_len(cfg: Any, seq_len: int, decoder_seq_len: int | None) -> int | None:
    """An encoder-decoder's decoder length (``seq_len`` unless given); None for a decoder-only model."""
    if not is_encoder_decoder(cfg):
        if decoder_seq_len not in (None, seq_len):
            raise UserError(
                f"training.decoder_seq_len = {decoder_seq_len}: model_type {cfg.model_type!r} has no "
                "decoder stack of its own (decoder_seq_len is for encoder-decoder models such as T5)"
            )
        return None
    if decoder_seq_len is not None and decoder_seq_len <= 0:
        raise UserError(f"training.decoder_seq_len must be > 0, got {decoder_seq_len}")
    return decoder_seq_len or seq_len


def describe_ops_debug(ops: list[OpRecord]) -> list[str]:
    return [f"{o.owner} {o.module_type} {o.flops:.3g} {o.saved_bytes}" for o in ops]
