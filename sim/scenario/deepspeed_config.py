"""A real DeepSpeed config (``ds_config.json``) as scenario overrides, and back.

``deepspeed_overrides(path)`` reads the JSON DeepSpeed 0.19.8 reads (``deepspeed/runtime/config.py``,
``deepspeed/runtime/zero/config.py``) and returns ``section.key=value`` overrides for the
scenario's ``[deepspeed]``, ``[training]``, ``[precision]`` and ``[optimizer]`` sections, plus the
fields it accepted that do not change one step's time or memory (learning-rate schedule, logging,
loss-scale dynamics), which the CLI names. A field it does not know, or knows and does not model,
is a ``UserError`` naming the file and the field: nothing is silently ignored. ``"auto"`` (the
Hugging Face Trainer's placeholder) is refused: the Trainer fills it in, the simulator cannot.

``deepspeed_config(scenario)`` writes the config a real DeepSpeed run of the scenario uses
(``validation``).
"""

import json
from pathlib import Path
from typing import Any

from sim.errors import UserError

ZERO_FIELDS = {  # zero_optimization field -> [deepspeed] key (sizes in elements)
    "stage": "stage",
    "contiguous_gradients": "contiguous_gradients",
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "overlap_comm": "overlap_comm",
    "sub_group_size": "sub_group_size",
    "stage3_prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold": "stage3_param_persistence_threshold",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "stage3_max_live_parameters": "stage3_max_live_parameters",
    "max_live_parameters": "stage3_max_live_parameters",
    "stage3_max_reuse_distance": "stage3_max_reuse_distance",
    "max_reuse_distance": "stage3_max_reuse_distance",
}
INT_FIELDS = {
    "reduce_bucket_size",
    "allgather_bucket_size",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
}
# accepted: they change no step's time or memory (checkpoint saving, reordering, logging)
ZERO_NO_EFFECT = {
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "ignore_unused_parameters",
    "round_robin_gradients",
    "log_trace_cache_warnings",
}
# accepted only at the value the simulator models
ZERO_FIXED = {
    "reduce_scatter": True,
    "use_multi_rank_bucket_allreduce": True,
    "allgather_partitions": True,
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False,
    "zero_quantized_gradients": False,
}
OFFLOAD_FIELDS = {
    "device",
    "pin_memory",
    "nvme_path",
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "fast_init",
}
TOP_NO_EFFECT = {
    "steps_per_print",
    "wall_clock_breakdown",
    "scheduler",
    "gradient_clipping",
    "gradient_predivide_factor",
    "zero_allow_untested_optimizer",
    "dump_state",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "flops_profiler",
    "memory_breakdown",
    "seed",
}
LOSS_SCALE_FIELDS = {"loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"}
OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}


def _number(where: str, name: str, value: Any, integer: bool) -> Any:
    if value == "auto":
        raise UserError(f'{where}: {name} is "auto": the Hugging Face Trainer fills it in; give a number')
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{where}: {name} must be a number, got {value!r}")
    if integer:
        if value != int(value):
            raise UserError(f"{where}: {name} must be a whole number of elements, got {value!r}")
        return int(value)
    return value


def _zero(where: str, zero: Any, out: list[str], no_effect: list[str]) -> None:
    if not isinstance(zero, dict):
        raise UserError(f"{where}: zero_optimization must be an object")
    for key, value in zero.items():
        name = f"zero_optimization.{key}"
        if key in ZERO_FIELDS:
            target = ZERO_FIELDS[key]
            if target in ("contiguous_gradients", "overlap_comm"):
                if not isinstance(value, bool):
                    raise UserError(f"{where}: {name} must be true or false, got {value!r}")
                out.append(f"deepspeed.{target}={str(value).lower()}")
            else:
                out.append(f"deepspeed.{target}={_number(where, name, value, True)}")
        elif key in ("offload_optimizer", "offload_param"):
            _offload(where, name, value, out)
        elif key in ZERO_NO_EFFECT:
            no_effect.append(name)
        elif key in ZERO_FIXED:
            if value != ZERO_FIXED[key]:
                raise UserError(
                    f"{where}: {name} = {value!r} is not modelled; only {json.dumps(ZERO_FIXED[key])}"
                )
        else:
            raise UserError(f"{where}: unknown or unsupported field {name}")


def _offload(where: str, name: str, value: Any, out: list[str]) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise UserError(f"{where}: {name} must be an object")
    for key in value:
        if key not in OFFLOAD_FIELDS:
            raise UserError(f"{where}: unknown or unsupported field {name}.{key}")
    device = value.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise UserError(f"{where}: {name}.device = {device!r} is not allowed; allowed: none, cpu, nvme")
    if value.get("pin_memory", False) is not True and device != "none":
        raise UserError(f"{where}: {name}.pin_memory = false is not modelled (transfers are timed pinned)")
    out.append(f"deepspeed.{name.split('.')[-1]}={device}")


def _precision(where: str, cfg: dict[str, Any], out: list[str], no_effect: list[str]) -> None:
    enabled = []
    for key in ("bf16", "bfloat16", "fp16"):
        block = cfg.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise UserError(f"{where}: {key} must be an object")
        for field in block:
            if field == "enabled" or (key == "fp16" and field in LOSS_SCALE_FIELDS):
                continue
            if key == "fp16" and field == "auto_cast" and block[field] is False:
                continue
            raise UserError(f"{where}: unknown or unsupported field {key}.{field}")
        if block.get("enabled", False) is True:
            enabled.append("fp16" if key == "fp16" else "bf16")
            no_effect += [f"fp16.{f}" for f in block if f in LOSS_SCALE_FIELDS]
    if len(enabled) > 1:
        raise UserError(f"{where}: bf16 and fp16 are both enabled")
    out.append(f"precision.param_dtype={enabled[0] if enabled else 'fp32'}")
    dtype = cfg.get("communication_data_type")
    if dtype is not None:
        out.append(f"precision.reduce_dtype={dtype}")


def _optimizer(where: str, block: Any, out: list[str], no_effect: list[str]) -> None:
    if not isinstance(block, dict) or "type" not in block:
        raise UserError(f"{where}: optimizer must be an object with a type")
    kind = str(block["type"]).lower()
    if kind not in OPTIMIZERS:
        raise UserError(
            f"{where}: optimizer.type = {block['type']!r} is not modelled; allowed: Adam, AdamW, SGD"
        )
    for key in block:
        if key not in ("type", "params"):
            raise UserError(f"{where}: unknown or unsupported field optimizer.{key}")
    out.append(f"optimizer.name={OPTIMIZERS[kind]}")
    no_effect += [f"optimizer.params.{k}" for k in (block.get("params") or {})]


def _batch(where: str, cfg: dict[str, Any], out: list[str]) -> None:
    micro = cfg.get("train_micro_batch_size_per_gpu")
    accum = cfg.get("gradient_accumulation_steps")
    if micro is not None:
        out.append(f"training.micro_batch={_number(where, 'train_micro_batch_size_per_gpu', micro, True)}")
    if accum is not None:
        out.append(f"training.grad_accum={_number(where, 'gradient_accumulation_steps', accum, True)}")
    total = cfg.get("train_batch_size")
    if total is not None:
        out.append(f"deepspeed.train_batch_size={_number(where, 'train_batch_size', total, True)}")


HANDLED = {
    "zero_optimization",
    "bf16",
    "bfloat16",
    "fp16",
    "communication_data_type",
    "optimizer",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
}


def deepspeed_overrides(path: str | Path) -> tuple[list[str], list[str]]:
    """(scenario overrides, the accepted fields without effect on one step) of a DeepSpeed config."""
    where = str(path)
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{where}: DeepSpeed config not found")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{where}: a DeepSpeed config is a JSON object")
    out, no_effect = ["deepspeed.enabled=true"], []
    for key in cfg:
        if key in TOP_NO_EFFECT:
            no_effect.append(key)
        elif key not in HANDLED:
            raise UserError(f"{where}: unknown or unsupported field {key}")
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict) or "stage" not in zero:
        raise UserError(f"{where}: zero_optimization.stage is missing: stage 0 (no ZeRO) is not simulated")
    _zero(where, zero, out, no_effect)
    _precision(where, cfg, out, no_effect)
    if "optimizer" in cfg:
        _optimizer(where, cfg["optimizer"], out, no_effect)
    _batch(where, cfg, out)
    return out, no_effect


def deepspeed_config(scenario: Any) -> dict[str, Any]:
    """The DeepSpeed config of ``scenario`` (a ``Scenario`` with ``deepspeed.enabled``): what a
    real run is given. AdamW is DeepSpeed's ``torch_adam`` (``torch.optim.AdamW``), so the real
    optimizer is the one the calibration times."""
    d, t = scenario.deepspeed, scenario.training
    zero: dict[str, Any] = {
        "stage": d.stage,
        "contiguous_gradients": d.contiguous_gradients,
        "reduce_bucket_size": d.reduce_bucket_size,
        "allgather_bucket_size": d.allgather_bucket_size,
        "sub_group_size": d.sub_group_size,
        "stage3_prefetch_bucket_size": d.stage3_prefetch_bucket_size,
        "stage3_param_persistence_threshold": d.stage3_param_persistence_threshold,
        "stage3_max_live_parameters": d.stage3_max_live_parameters,
        "stage3_max_reuse_distance": d.stage3_max_reuse_distance,
    }
    if d.overlap_comm is not None:
        zero["overlap_comm"] = d.overlap_comm
    for name in ("offload_optimizer", "offload_param"):
        device = getattr(d, name).value
        if device != "none":
            zero[name] = {"device": device, "pin_memory": True}
    optimizer = {"adamw": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
    }
    if scenario.optimizer.name.value in optimizer:
        cfg["optimizer"] = optimizer[scenario.optimizer.name.value]
    if scenario.param_dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif scenario.param_dtype == "fp16":
        cfg["fp16"] = {"enabled": True}
    if scenario.reduce_dtype != scenario.param_dtype:
        cfg["communication_data_type"] = scenario.reduce_dtype
    return cfg
