"""Build a scenario's model as real torch modules and wrap it exactly as the scenario says.

The model is ``transformers``' ``LlamaForCausalLM`` with random weights (no download). FSDP2:
one ``fully_shard`` per wrap unit, then the root; FULL_SHARD => ``reshard_after_forward=True``,
SHARD_GRAD_OP => False, HYBRID_SHARD => a 2-D (replicate, shard) mesh; NO_SHARD => DDP.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from calibrate.hf_llama import llama_config
from calibrate.sweep import TORCH_DTYPES
from sim.errors import UserError
from sim.scenario.sections import Scenario
from sim.workload.checkpointing import CheckpointPlan, checkpoint_plan
from sim.workload.model import ModelConfig
from sim.workload.options import OptimizerImplementation, OptimizerName, OutputFormat, Strategy, WrapPolicy
from sim.workload.units import unit_prefixes
from validation.sac_policy import op_sac_context, sac_save_list  # noqa: F401 (re-exported)


def build_llama(
    model: ModelConfig, seq_len: int, seed: int = 0, use_cache: bool = False, attention: str = "sdpa"
) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = llama_config(model, seq_len)
    config.use_cache = use_cache
    config._attn_implementation = attention
    return LlamaForCausalLM(config)


def build_model(
    model: ModelConfig,
    seq_len: int,
    seed: int = 0,
    use_cache: bool = False,
    attention: str = "sdpa",
    master_dtype: str = "fp32",
) -> nn.Module:
    """The scenario's model: a described one from its own config.json, else Llama, with
    ``attn_implementation = attention`` (``training.attention``: "sdpa" or "eager").
    Trained whole, it is stored in ``master_dtype`` (``Scenario.master_dtype``: bf16 for
    llama-recipes' ``--pure_bf16``, ``model.to(torch.bfloat16)`` before FSDP1).
    Fine-tuned with LoRA: the base in the compute dtype it was described in, PEFT's adapters on it
    (fp32, PEFT's default over a lower-precision base). ``use_cache``: the scenario's
    ``model.use_cache``, the KV cache its forward keeps."""
    if model.description is None:
        return build_llama(model, seq_len, seed, use_cache, attention)
    import json

    from hfmodel.build import build_causal_lm, hf_config

    d = model.description
    config = hf_config(json.loads(d.config_json), use_cache=use_cache, attn=attention)
    if d.finetune is None:
        return build_causal_lm(config, dtype=TORCH_DTYPES[master_dtype], seed=seed)
    from hfmodel.build import block_prefixes
    from hfmodel.finetune import apply_lora, quantize_base

    base = build_causal_lm(config, dtype=TORCH_DTYPES[d.dtype], seed=seed)
    if d.finetune.method == "qlora":  # bitsandbytes' 4-bit layers first, PEFT's wrappers on them
        storage = TORCH_DTYPES.get(d.finetune.quant_storage, torch.uint8)
        quantize_base(base, block_prefixes(base), storage=storage, double_quant=d.finetune.double_quant)
    return apply_lora(base, finetune_settings(model))


def check_output_format(scenario: Scenario, transformers_version: str | None = None) -> None:
    """A scenario whose cache is transformers < 4.36's per-layer (k, v) tuples
    (``model.output_format = "legacy"``) cannot be run on a newer transformers, whose model
    returns a ``DynamicCache`` instead (under checkpointing each recompute appends to it and the
    eager attention's mask no longer fits: "Attempting to broadcast a dimension ..."). The old
    code runs through ``validation.legacy_transformers --site DIR``. ``transformers_version``:
    the installed distribution's unless given (read from its metadata: nothing is imported)."""
    if transformers_version is None:
        from importlib import metadata

        transformers_version = metadata.version("transformers")
    major, minor = (int(part) for part in transformers_version.split(".")[:2])
    if scenario.use_cache and scenario.output_format is OutputFormat.LEGACY and (major, minor) >= (4, 36):
        raise UserError(
            f'{scenario.source}: model.output_format = "legacy" is the cache of transformers < 4.36, and '
            f"transformers {transformers_version} is installed: run the old code (python -m "
            'validation.legacy_transformers SCENARIO --site DIR) or set model.output_format = "current"'
        )


def build_scenario_model(scenario: Scenario) -> nn.Module:
    """The model a validation run trains: the scenario's, with its KV cache and attention settings."""
    check_output_format(scenario)
    return build_model(
        scenario.model,
        scenario.training.seq_len,
        use_cache=scenario.use_cache,
        attention=scenario.training.attention.value,
        master_dtype=scenario.master_dtype,
    )


def finetune_settings(model: ModelConfig) -> dict[str, Any]:
    """The LoRA settings the model was described with, as ``hfmodel.finetune`` takes them."""
    f = model.description.finetune if model.description is not None else None
    assert f is not None
    return f.lora_settings()


def block_modules(model: nn.Module, scenario: Scenario) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, block) of every decoder block, by the scenario's unit paths."""
    modules = dict(model.named_modules())
    paths = unit_prefixes(scenario.model, WrapPolicy.BLOCK)
    out = []
    for path in paths:
        parent, _, attr = path.rpartition(".")
        out.append((modules[parent], attr, modules[path]))
    return out


@dataclass
class Wrapped:
    model: nn.Module
    units: list[Any]  # non-root FSDP units in forward order (empty for DDP)
    is_fsdp: bool
    fsdp_version: int = 2  # 1: FullyShardedDataParallel (is_fsdp is true for both)


def apply_checkpointing(model: nn.Module, plan: CheckpointPlan, scenario: Scenario) -> None:
    """Non-reentrant activation checkpointing of the plan's decoder blocks, before sharding, as
    torchtitan applies it (full regions, or regions under its op-level policy)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, (parent, attr, layer) in enumerate(block_modules(model, scenario)):
        if not plan.covers(i):
            continue
        if plan.selective_op:
            wrapped = checkpoint_wrapper(layer, preserve_rng_state=False, context_fn=op_sac_context)
        else:
            wrapped = checkpoint_wrapper(layer, preserve_rng_state=False)
        setattr(parent, attr, wrapped)


def wrap(model: nn.Module, scenario: Scenario, mesh: Any) -> Wrapped:
    if scenario.parallel.expert_parallel > 1:  # README, "Expert parallelism": why it cannot run here
        raise UserError(
            f"{scenario.source}: parallel.expert_parallel = {scenario.parallel.expert_parallel} is a what-if "
            "the validation cannot run (its dispatch needs the token counts other ranks send)"
        )
    c = scenario.checkpointing
    plan = checkpoint_plan(c.mode, c.selective, scenario.model.n_layers)
    if scenario.parallel.fsdp_version == 1:
        from validation.build_fsdp1 import wrap_fsdp1

        return Wrapped(wrap_fsdp1(model, scenario, mesh, plan), [], is_fsdp=True, fsdp_version=1)
    if plan.active:
        apply_checkpointing(model, plan, scenario)
    if scenario.parallel.strategy is Strategy.NO_SHARD:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, bucket_cap_mb=scenario.parallel.ddp_bucket_mb)
        return Wrapped(ddp, [], is_fsdp=False)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPES[scenario.param_dtype], reduce_dtype=TORCH_DTYPES[scenario.reduce_dtype]
    )
    # checkpoint_wrapper inserts `_checkpoint_wrapped_module` into module paths; match the HF names
    modules = {name.replace("._checkpoint_wrapped_module", ""): m for name, m in model.named_modules()}
    units = [modules[prefix] for prefix in unit_prefixes(scenario.model, scenario.parallel.wrap)]
    offload = _offload_policy(scenario)
    raf = scenario.parallel.reshard_after_forward  # an integer k goes to FSDP2 as it is
    reshard = raf if isinstance(raf, int) and not isinstance(raf, bool) else scenario.reshard_after_forward
    for module in units:
        fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    # the root: reshard_after_forward=None, as FSDP2's default
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    _set_prefetch(units, scenario)
    return Wrapped(model, units, is_fsdp=True)


def _offload_policy(scenario: Scenario) -> Any:
    """``parallel.cpu_offload``: ``CPUOffloadPolicy``, pinned only where an accelerator exists
    (``pin_memory()`` fails without one: "Cannot access accelerator device when none is available")."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not scenario.parallel.cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=scenario.parallel.cpu_offload_pin_memory and torch.cuda.is_available())


def _set_prefetch(units: list[Any], scenario: Scenario) -> None:
    fwd, bwd = scenario.parallel.forward_prefetch, scenario.parallel.backward_prefetch
    if scenario.parallel.wrap is WrapPolicy.MODEL:
        return
    for i, unit in enumerate(units):
        if fwd > 0:
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + fwd])
        if bwd != 1:  # 1 is FSDP2's implicit default; anything else is an explicit list
            unit.set_modules_to_backward_prefetch(units[max(0, i - bwd) : i][::-1])


def build_optimizer(params: Any, scenario: Scenario) -> torch.optim.Optimizer:
    """The scenario's optimizer as ``torch.optim`` builds it, in the implementation it names
    (``optimizer.implementation``: foreach, for-loop = ``foreach=False``, fused): AdamW; SGD with
    momentum 0.9 (what the calibration times); ``none`` as SGD without momentum, which keeps no
    state and no temporaries."""
    impl = scenario.optimizer.implementation
    flags: dict[str, Any] = (
        {"fused": True}
        if impl is OptimizerImplementation.FUSED
        else {"foreach": impl is OptimizerImplementation.FOREACH}
    )
    name = scenario.optimizer.name
    if name is OptimizerName.ADAMW:
        return torch.optim.AdamW(params, lr=1e-4, **flags)
    momentum = 0.9 if name is OptimizerName.SGD else 0.0
    return torch.optim.SGD(params, lr=1e-4 if momentum else 0.0, momentum=momentum, **flags)


def step_loss(model: Any, inputs: dict[str, torch.Tensor], keep_outputs: bool) -> tuple[torch.Tensor, Any]:
    """One micro-batch's forward (``model(**batch)``, ``inputs`` from ``batch``): its loss, and the
    output the loop keeps (``training.keep_outputs``: ``outputs = model(**batch)``, held until the
    next forward returns); None, as ``loss = model(**batch).loss``, drops the output with the forward."""
    outputs = model(**inputs)
    return outputs.loss, (outputs if keep_outputs else None)


# the label the loss ignores (transformers' and torch's ``ignore_index``)
IGNORED_LABEL = -100


def batch(
    scenario: Scenario, rank: int, step: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """One micro-batch as a collator hands it to the model, on ``device``: token ids and labels (an
    encoder-decoder's labels are its decoder's tokens at its decoder's length; transformers shifts
    them right into the decoder's input). Rows padded to ``seq_len`` (``training.avg_seq_len``
    below it) come as a padding collator makes them: each row's ``avg_seq_len`` real tokens, then
    padding, marked 0 in the ``attention_mask`` and ignored by the loss (right padding, as
    ``DataCollatorWithPadding`` pads for training; which rows are longer does not change a step's
    memory or its kernels). Packed rows (``training.avg_doc_len`` below ``seq_len``) come as
    transformers' ``DataCollatorWithFlattening`` makes them: documents of ``avg_doc_len`` tokens
    (the last one of a row cut short), their ``position_ids`` restarting at each, and the label of
    each document's first token ignored (its ``separator_id``, -100), so that no document
    predicts the next one's start."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    t = scenario.training
    ids = torch.randint(0, scenario.model.vocab, (t.micro_batch, t.seq_len), generator=g)
    d = scenario.model.description
    if d is not None and d.decoder_seq_len is not None:
        labels = torch.randint(0, scenario.model.vocab, (t.micro_batch, d.decoder_seq_len), generator=g)
        inputs = {"input_ids": ids, "labels": labels}
    else:
        inputs = {"input_ids": ids, "labels": ids.clone()}
    if t.padded:
        assert t.avg_seq_len is not None
        mask = torch.ones(t.micro_batch, t.seq_len, dtype=torch.long)
        mask[:, t.avg_seq_len :] = 0
        inputs["attention_mask"] = mask
        if d is None or d.decoder_seq_len is None:
            inputs["labels"][:, t.avg_seq_len :] = IGNORED_LABEL
    if t.packed:
        assert t.avg_doc_len is not None
        positions = torch.arange(t.seq_len) % t.avg_doc_len
        inputs["position_ids"] = positions.expand(t.micro_batch, -1).clone()
        inputs["labels"][:, positions == 0] = IGNORED_LABEL
    return {name: tensor.to(device) for name, tensor in inputs.items()}
