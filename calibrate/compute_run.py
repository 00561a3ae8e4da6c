"""``calibrate compute`` on one rank: build the units, measure them, and (rank 0) add the
``compute`` section to the profile atomically.

All ranks measure at the same time, as they compute in training (on a CPU they share cores and
memory bandwidth); times are averaged over ranks, memory is identical on every rank.
"""

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from calibrate.compute import ComputeTarget, compute_section
from calibrate.dist_env import RankEnv, init_distributed, mean_over_ranks
from calibrate.profile_io import write_profile_atomic
from sim.hardware.compute_section import ComputeSection, UnitMeasurement
from sim.hardware.registry import read_profile_document

TIME_FIELDS = ("forward_s", "backward_s", "recompute_s")


def _measure_llama(target: ComputeTarget, device: Any, reps: int) -> tuple[dict[str, UnitMeasurement], Any]:
    """The Llama units alone (memory, recompute) and their times inside plain models."""
    from calibrate import context_timing
    from calibrate.layers import build_units
    from calibrate.unit_timing import measure_unit

    units = build_units(target, device)
    isolated = {
        name: measure_unit(unit, device, reps, with_recompute=name == "block") for name, unit in units.items()
    }
    model_times = context_timing.model_times(target, device, reps)
    measured, _ = context_timing.in_model(isolated, model_times)
    extra = {"isolated": {f"{u}.{f}": getattr(isolated[u], f) for u in units for f in TIME_FIELDS}}
    return measured, extra | {"block_unit": units["block"], "block_units": ()}


def _measure_described(
    target: ComputeTarget, device: Any, reps: int
) -> tuple[dict[str, UnitMeasurement], Any]:
    """A described model's own units, timed inside the real model (``calibrate.hf_units``)."""
    from calibrate import hf_units

    times, block_units = hf_units.measure_described(target, device, reps)
    measured = hf_units.units_of(times, block_units)
    return measured, {"block_unit": hf_units.block_unit(target, device), "block_units": block_units}


def _measure(
    target: ComputeTarget, device: Any, reps: int
) -> tuple[dict[str, UnitMeasurement], dict[str, Any]]:
    from calibrate import device_probe, fsdp_overhead, overheads

    described = target.model.description is not None
    measured, extra = (_measure_described if described else _measure_llama)(target, device, reps)
    # the optimizer's repetitions each follow a cache eviction (calibrate.cache_state), whose cost
    # (40 ms here) is most of theirs: ``reps`` of them, not the floor of 10 the warm ones had
    extra |= {
        "copy": overheads.copy_rates(target, device, max(reps, 20)),
        "optimizer_s_per_param": overheads.optimizer_s_per_param(target, device, reps),
        "fsdp_optimizer_s_per_param": fsdp_overhead.dtensor_optimizer_s_per_param(target, device, reps),
    }
    copy_Bps = extra["copy"]["copy_Bps"]
    extra |= {
        "fsdp_unit_overhead": fsdp_overhead.unit_overhead(target, device, reps, copy_Bps),
    }
    # FSDP1's hooks per unit; a LoRA model's chain is wrapped as PEFT's policy wraps it (each block
    # and each adapter), its per-layer time shared out over the layer's units
    extra["fsdp1_unit_overhead"] = fsdp_overhead.unit_overhead(target, device, reps, copy_Bps, version=1)
    if target.deepspeed_config is not None and device.type == "cpu":
        from calibrate import deepspeed_overhead

        extra["deepspeed_step"] = deepspeed_overhead.step_s_per_param(
            target, target.deepspeed_config, device, reps
        )
        extra["deepspeed_layer"] = deepspeed_overhead.layer_overhead(
            target, target.deepspeed_config, device, reps, copy_Bps
        )
    block = extra.pop("block_unit")
    extra["time_spread"] = overheads.time_spread(block, device, reps)
    extra["slowdown"], extra["slowdown_raw"] = overheads.slowdown_during_collective(block, device, reps)
    m, d = target.model, target.model.description
    # T5 hands SDPA its relative position bias as a float mask: the call is probed as it makes it
    float_bias = d is not None and any(op.attention is not None and op.attention.bias for op in d.ops)
    extra["attention_kernel"] = device_probe.sdpa_kernel(
        device, target.param_dtype, m.n_heads, m.n_kv_heads, target.seq_len, m.head_dim, float_bias=float_bias
    )
    return measured, extra


def _averaged(measured: dict[str, UnitMeasurement], extra: dict[str, Any], device: Any) -> dict[str, Any]:
    flat: dict[str, Any] = {f"{u}.{f}": getattr(measured[u], f) for u in measured for f in TIME_FIELDS}
    flat.update({"copy": extra["copy"], "optimizer": extra["optimizer_s_per_param"]})
    flat.update(
        fsdp_optimizer=extra["fsdp_optimizer_s_per_param"],
        fsdp_unit_overhead=extra["fsdp_unit_overhead"],
    )
    if "fsdp1_unit_overhead" in extra:
        flat["fsdp1_unit_overhead"] = extra["fsdp1_unit_overhead"]
    if "deepspeed_step" in extra:
        flat["deepspeed_step"] = extra["deepspeed_step"]
        flat["deepspeed_layer"] = extra["deepspeed_layer"]
    if "isolated" in extra:  # the Llama units measured alone (a described model's are not)
        flat["isolated"] = extra["isolated"]
    flat.update(
        slowdown=extra["slowdown"], slowdown_raw=extra["slowdown_raw"], time_spread=extra["time_spread"]
    )
    avg = mean_over_ranks(flat, device)
    # the floor at zero after the mean over ranks, not before: one rank's negative raw figure
    # (noise on a loaded host) must not lift the mean of the floored ones above the floored mean
    for key in ("fsdp_unit_overhead", "deepspeed_layer"):
        for phase in ("forward", "backward") if key in avg else ():
            avg[key][f"{phase}_s"] = max(0.0, avg[key][f"{phase}_raw_s"])
    return avg


def _section(
    target: ComputeTarget,
    measured: dict[str, UnitMeasurement],
    avg: dict[str, Any],
    device: Any,
    block_units: tuple[str, ...] = (),
    attention_evidence: str | None = None,
) -> ComputeSection:
    from calibrate import device_probe

    units = {
        u: UnitMeasurement(
            **{f: avg[f"{u}.{f}"] for f in TIME_FIELDS},
            saved_activation_bytes=measured[u].saved_activation_bytes,
            forward_transient_bytes=measured[u].forward_transient_bytes,
            backward_transient_bytes=measured[u].backward_transient_bytes,
        )
        for u in measured
    }
    return compute_section(
        target,
        units,
        copy_Bps=avg["copy"]["copy_Bps"],
        optimizer_s_per_param=avg["optimizer"],
        fsdp_optimizer_s_per_param=avg["fsdp_optimizer"],
        fsdp_unit_overhead_s={k: avg["fsdp_unit_overhead"][f"{k}_s"] for k in ("forward", "backward")},
        fsdp1_unit_overhead_s=(
            {k: avg["fsdp1_unit_overhead"][f"{k}_s"] for k in ("forward", "backward")}
            if "fsdp1_unit_overhead" in avg
            else None
        ),
        host_overhead_in_step=device.type == "cpu",
        slowdown=max(1.0, avg["slowdown"]),
        time_rel_std=avg["time_spread"],
        attention_kernel=(
            device_probe.attention_kernel({target.param_dtype: attention_evidence})
            if attention_evidence
            else None
        ),
        block_units=block_units,
        **_deepspeed_fields(target, avg),
    )


def _deepspeed_fields(target: ComputeTarget, avg: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed figures, keyed by the calibrated scenario's stage."""
    if "deepspeed_step" not in avg or target.deepspeed_config is None:
        return {}
    stage = str(target.deepspeed_config["zero_optimization"]["stage"])
    layer = avg["deepspeed_layer"]
    return {
        "deepspeed_step_s_per_param": {stage: avg["deepspeed_step"]["s_per_param"]},
        "deepspeed_layer_overhead_s": {stage: {p: layer[f"{p}_s"] for p in ("forward", "backward")}},
    }


def _source(
    target: ComputeTarget,
    env: RankEnv,
    backend: str,
    device: Any,
    avg: dict[str, Any],
    extra: dict[str, Any],
    reps: int,
    command: str,
    wall_s: float,
) -> dict[str, Any]:
    import torch

    from calibrate import device_probe, overheads
    from calibrate.fsdp_overhead import CHAIN, TINY_SEQ

    return {
        "method": _method(target, env, device, reps),
        "device_name": device_probe.device_name(device),
        "backend": backend,
        "world_size": env.world_size,
        "shard_world_size": target.world_size,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command,
        "wall_s": round(wall_s, 3),
        "copy_rates_Bps": avg["copy"],
        "optimizer": "AdamW(foreach=True) and SGD(momentum=0.9, foreach=True) on fp32 shards: plain tensors "
        "(optimizer_s_per_param, DDP) and DTensors Shard(0) on the world mesh (fsdp_optimizer_s_per_param)",
        **_alone(avg),
        "fsdp_unit_overhead": avg["fsdp_unit_overhead"]
        | {
            "method": f"{CHAIN} decoder layers of the scenario's dimensions on {TINY_SEQ} tokens with one "
            "fully_shard each plus the root on the world mesh, less their blocking collectives, less the same "
            f"layers unwrapped, over {CHAIN}, less the modelled copies; added to the step only where the host "
            "is the device (CPU)"
        },
        "time_spread_method": "the block's forward time over "
        f"{overheads.SPREAD_RUNS} runs in a row, every rank at once: sqrt(pi)/2 x the mean |t_i - t_j| over "
        "pairs (a normal law's sigma from Gini's mean difference) over the mean time, averaged over ranks",
        "slowdown_raw": avg["slowdown_raw"],
        "slowdown_note": "1.0: one rank, no collective"
        if env.world_size < 2
        else "block forward during / before an all-reduce, floored at 1.0",
        "attention_kernel": extra["attention_kernel"],
    } | (
        {
            "deepspeed_step": avg["deepspeed_step"]
            | {
                "method": "deepspeed.initialize with the scenario's DeepSpeed config on a module holding the "
                "scenario's parameters; engine.step() after a backward, less the collectives it calls, per "
                "element of this rank's partition (calibrate.deepspeed_overhead)"
            },
            "deepspeed_layer": avg["deepspeed_layer"]
            | {
                "method": f"{CHAIN} decoder layers of the scenario's dimensions on {TINY_SEQ} tokens through "
                "deepspeed.initialize with the scenario's config against the same layers plain, interleaved, less the engine's "
                f"blocking collectives, over {CHAIN}, less the copies the ZeRO schedules charge; floored at 0"
            },
        }
        if "deepspeed_step" in avg
        else {}
    )


def _method(target: ComputeTarget, env: RankEnv, device: Any, reps: int) -> str:
    from calibrate.context_timing import DEPTHS

    d = target.model.description
    where = f"with random weights on {device}, {env.world_size} rank(s) measuring at once; mean of {reps} "
    if d is not None:
        return (
            f"calibrate compute: transformers {_hf_version()} {d.architecture} built from the description's "
            f"config.json (model {d.name}, config sha256 {d.config_sha256[:12]}), one decoder block of each kind "
            f"{where}training steps after a warm-up, averaged over ranks; each unit timed inside the model by "
            "module hooks (blocks: forward pre-hook to hook, full backward pre-hook to hook; embed: its forward "
            "hooks, backward = the rest; head = the rest of the model), recompute inside a non-reentrant "
            "checkpoint_wrapper backward (calibrate.hf_units); bytes not measured (the description's)"
        )
    return (
        f"calibrate compute: transformers {_hf_version()} LlamaDecoderLayer / Embedding / "
        f"RMSNorm+lm_head+ForCausalLMLoss {where}repetitions after a warm-up, averaged over ranks; "
        f"forward/backward times taken inside plain LlamaForCausalLM models of {' and '.join(map(str, DEPTHS))} "
        "layers (block = their difference per layer, embed + head = the rest, split as measured alone; "
        "recompute scaled like the block's forward); recompute timed inside a non-reentrant "
        "torch.utils.checkpoint backward; saved bytes from saved_tensors_hooks (distinct storages, "
        "parameters excluded); transients = peak - allocated at return "
        + (
            "(torch.cuda.max_memory_allocated)"
            if device.type == "cuda"
            else "(TorchDispatchMode storage tracker)"
        )
    )


def _alone(avg: dict[str, Any]) -> dict[str, Any]:
    if "isolated" not in avg:
        return {}
    return {
        "units_alone": avg["isolated"],
        "in_model_over_alone": {
            f: avg[f"block.{f}"] / avg["isolated"][f"block.{f}"] for f in ("forward_s", "backward_s")
        },
    }


def _hf_version() -> str:
    import transformers

    return str(transformers.__version__)


def run_compute(
    target: ComputeTarget,
    profile: Path,
    env: RankEnv,
    reps: int,
    timeout_s: float,
    command: str,
    backend: str = "auto",
) -> None:
    import torch.distributed as dist

    from calibrate.watchdog import Watchdog

    dog = Watchdog(env.rank)
    dog.arm("joining the process group and the compute calibration", timeout_s)
    backend, device = init_distributed(env, timeout_s, backend)
    try:
        started = time.perf_counter()
        measured, extra = _measure(target, device, reps)
        avg = _averaged(measured, extra, device)
        dist.barrier()
        dog.disarm()
        if env.rank == 0:
            section = _section(target, measured, avg, device, extra["block_units"], extra["attention_kernel"])
            doc = read_profile_document(profile)
            doc["compute"] = section.to_dict()
            wall = time.perf_counter() - started
            doc.setdefault("source", {})["compute"] = _source(
                target, env, backend, device, avg, extra, reps, command, wall
            )
            write_profile_atomic(profile, doc)
            _report(section, profile, wall)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report(section: ComputeSection, profile: Path, wall_s: float) -> None:
    for name, u in section.units.items():
        print(
            f"{name:>5}: forward {u.forward_s * 1e3:.3f} ms, backward {u.backward_s * 1e3:.3f} ms, "
            f"recompute {u.recompute_s * 1e3:.3f} ms, saved {u.saved_activation_bytes} B, "
            f"transient fwd/bwd {u.forward_transient_bytes}/{u.backward_transient_bytes} B",
            flush=True,
        )
    print(
        f"copy {section.copy_Bps / 1e9:.2f} GB/s, AdamW {section.optimizer_s_per_param['adamw'] * 1e9:.2f} ns/param, "
        f"slowdown during a collective x{section.compute_slowdown_during_collective:.3f}; "
        f"wrote {profile} ({wall_s:.1f} s)",
        flush=True,
    )
