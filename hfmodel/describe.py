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

from hfmodel.build import block_prefixes, build_causal_lm, hf_config
from hfmodel.probe import PROBE, ProbeRecorder
from hfmodel.trace import HostCalls, OpRecord, Owners, SavedBytes, Tracer, finish
from sim.dtypes import canonical_dtype
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


def representatives(model: nn.Module, blocks: list[str]) -> list[int]:
    """For every block, the index of the first block built like it."""
    modules = dict(model.named_modules())
    first: dict[str, int] = {}
    return [first.setdefault(_layer_signature(modules[p]), i) for i, p in enumerate(blocks)]


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
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {
        "n_layers": n_blocks,
        "hidden": cfg.hidden_size,
        "n_heads": heads,
        "n_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "ffn_hidden": getattr(cfg, "intermediate_size", 0) or 4 * cfg.hidden_size,
        "vocab": cfg.vocab_size,
        "tie_embeddings": tied,
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
    }


def _meta_facts(cfg: Any, dtype: torch.dtype) -> dict[str, Any]:
    with torch.device("meta"):
        model = build_causal_lm(cfg, dtype)
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
        "reps": representatives(model, blocks),
        "param_modules": {n: n.rpartition(".")[0] for n, _ in model.named_parameters()},
        "direct_3d": sorted({n.rpartition(".")[0] for n, p in model.named_parameters() if p.dim() == 3}),
    }


def _trace(cfg: Any, dtype: torch.dtype, reps: list[int], blocks: list[str], batch: int, seq: int):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = build_causal_lm(cfg, dtype)
        modules = dict(model.named_modules())
        container_path = blocks[0].rpartition(".")[0]
        container = modules[container_path]
        keep = sorted(set(reps))
        if isinstance(container, nn.ModuleList) and len(keep) < len(blocks):
            parent, _, attr = container_path.rpartition(".")
            setattr(modules[parent] if parent else model, attr, nn.ModuleList([container[i] for i in keep]))
            for owner in (cfg, getattr(cfg, "text_config", None)):
                if owner is not None and hasattr(owner, "num_hidden_layers"):
                    owner.num_hidden_layers = len(keep)
        paths = {id(m): p for p, m in model.named_modules()}
        params = list(model.parameters())
        owners = Owners(model)
        tracer = Tracer(owners, params)
        probe = ProbeRecorder(tracer, paths)
        probe.register()
        vocab = cfg.vocab_size
        ids = torch.randint(0, vocab, (batch, seq))
        with tracer, HostCalls(owners, tracer), SavedBytes(tracer).hooks:
            loss = model(input_ids=ids, labels=ids).loss
            tracer.backward = True
            loss.backward()
        grads = {tracer_key(p.grad) for p in params if p.grad is not None}
        finish(tracer, grads)
        owners.remove()
        # the kept blocks' module paths in the trimmed model are their position among ``keep``
        rename = {f"{container_path}.{j}": f"{container_path}.{i}" for j, i in enumerate(keep)}
    return tracer.ops, probe.calls, rename


def tracer_key(t: torch.Tensor) -> int:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage()).cdata


def _renamed(path: str, rename: dict[str, str]) -> str:
    for old, new in rename.items():
        if path == old or path.startswith(old + "."):
            return new + path[len(old) :]
    return path


def describe(
    config: dict[str, Any], *, micro_batch: int, seq_len: int, dtype: str, name: str
) -> dict[str, Any]:
    """The description (a JSON-ready dict, ``sim.workload.description`` reads it)."""
    from hfmodel.ops import assemble_ops

    dtype = canonical_dtype(dtype)
    sha = config_sha256(config)
    cfg = hf_config(config, attn=PROBE)
    meta = _meta_facts(cfg, TORCH_DTYPES[dtype])
    blocks = meta["blocks"]
    ops, calls, rename = _trace(cfg, TORCH_DTYPES[dtype], meta["reps"], blocks, micro_batch, seq_len)
    for op in ops:
        op.owner = (
            _renamed(op.owner.removeprefix("attention:"), rename)
            if op.module_type == "AttentionProbe"
            else _renamed(op.owner, rename)
        )
    calls = [{**call.__dict__, "module": _renamed(call.module, rename)} for call in calls]
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
            "dtype": dtype,
            "transformers": metadata.version("transformers"),
            "torch": torch.__version__,
        },
        "ops": assemble_ops(ops, calls, meta, blocks),
    }


def describe_ops_debug(ops: list[OpRecord]) -> list[str]:
    return [f"{o.owner} {o.module_type} {o.flops:.3g} {o.saved_bytes}" for o in ops]
