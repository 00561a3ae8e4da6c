"""``calibrate comm`` on one rank: sweep the collectives over every group family, then rank 0
fits the curves, measures nothing more than the others, and writes the profile atomically.

Every rank runs this same function (under torchrun or ``calibrate.launch``); they stay in step
because every loop below is a pure function of the configuration.
"""

import os
import sys
import time
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from calibrate.dist_env import RankEnv, init_distributed, mean_over_ranks, versions
from calibrate.fit import fit_curve
from calibrate.groups import GroupFamily, plan_group_families
from calibrate.profile_io import comm_profile, write_profile_atomic
from calibrate.records import Curve, CurveKey, Point
from calibrate.sweep_plan import CPU_DEFAULTS, GPU_DEFAULTS, SweepConfig
from calibrate.topology_fit import attach_nccl_fit
from calibrate.watchdog import Watchdog
from sim.errors import UserError

FAULT_EXIT_CODE = 17


@dataclass(frozen=True, kw_only=True)
class Fault:
    """Test hook: rank ``rank`` exits (or hangs) just before its point number ``point`` (0-based)."""

    rank: int
    point: int
    kind: str  # "exit" | "hang"


@dataclass(frozen=True, kw_only=True)
class CommRequest:
    out: Path
    name: str
    overrides: dict[str, Any]  # SweepConfig fields given on the command line
    dtypes: tuple[str, ...]
    collectives: tuple[str, ...]
    timeout_s: float
    backend: str
    shard_size: int | None
    fault: Fault | None
    command: str
    cluster: str | None = None  # the cluster measured on, for the NCCL model's fit


def resolve_sweep(req: CommRequest, device_type: str) -> SweepConfig:
    base = dict(GPU_DEFAULTS if device_type == "cuda" else CPU_DEFAULTS)
    base.update({k: v for k, v in req.overrides.items() if v is not None})
    cfg = SweepConfig(dtypes=req.dtypes, collectives=req.collectives, timeout_s=req.timeout_s, **base)
    if cfg.min_bytes < 1 or cfg.max_bytes < cfg.min_bytes or cfg.factor < 2:
        raise UserError("sizes: need 1 <= --min-bytes <= --max-bytes and --factor >= 2")
    if cfg.min_iters < 1 or cfg.max_iters < cfg.min_iters or cfg.warmup < 0:
        raise UserError("iterations: need 1 <= --iters and --warmup >= 0")
    return cfg


def _make_groups(families: list[GroupFamily], rank: int) -> list[tuple[GroupFamily, Any]]:
    """Create every group on every rank (torch requires it); keep this rank's group per family."""
    import torch.distributed as dist

    mine = []
    for fam in families:
        pg = None
        for g in fam.groups:
            made = None if fam.kind == "world" else dist.new_group(ranks=list(g))
            if rank in g:
                pg = made
        mine.append((fam, pg))
    return mine


def _maybe_fault(fault: Fault | None, rank: int, index: int) -> None:
    if fault is None or fault.rank != rank or fault.point != index:
        return
    sys.stderr.write(f"calibrate: rank {rank}: injected fault '{fault.kind}' at point {index}\n")
    sys.stderr.flush()
    if fault.kind == "exit":
        os._exit(FAULT_EXIT_CODE)
    while True:
        time.sleep(3600)


def sweep_all(req: CommRequest, cfg: SweepConfig, env: RankEnv, device: Any, dog: Watchdog) -> list[Curve]:
    """Measure every (family, collective, dtype, size); identical results on every rank."""
    from calibrate.cache_state import last_level_cache_bytes
    from calibrate.sweep import build_op, measure_point
    from calibrate.sweep_plan import iters_for, sizes_for

    cache_bytes = last_level_cache_bytes(device)

    families = plan_group_families(env.world_size, env.local_world_size, req.shard_size)
    curves, index = [], 0
    for fam, pg in _make_groups(families, env.rank):
        members = fam.group_of(env.rank)
        for collective in cfg.collectives:
            for dtype in cfg.dtypes:
                key = CurveKey(
                    collective=collective,
                    group_size=fam.size,
                    dtype=dtype,
                    spans_nodes=fam.spans_nodes,
                    ranks_per_node=fam.ranks_per_node,
                )
                points: list[Point] = []
                for size in sizes_for(cfg, fam.size, dtype):
                    _maybe_fault(req.fault, env.rank, index)
                    index += 1
                    dog.arm(
                        f"{collective} of {size} B {dtype} on the {fam.kind} group of {fam.size}",
                        cfg.timeout_s,
                    )
                    iters = iters_for(cfg, size)
                    op = build_op(
                        collective,
                        size,
                        dtype,
                        pg,
                        members.index(env.rank),
                        fam.size,
                        device,
                        uses=cfg.warmup + iters,
                        cache_bytes=cache_bytes,
                    )
                    points.append(measure_point(op, size, cfg.warmup, iters, device))
                    dog.disarm()
                curve = Curve(
                    key=key, points=tuple(points), fit=fit_curve(key, points), source=f"{fam.kind} group"
                )
                curves.append(curve)
                if env.rank == 0:
                    _report_curve(curve, fam)
    return curves


def _report_curve(c: Curve, fam: GroupFamily) -> None:
    last = c.points[-1].to_dict(c.key)
    wrong = sum(p.wrong or 0 for p in c.points)
    print(
        f"{c.key.collective:>14} {c.key.dtype} {fam.kind}({fam.size}): {len(c.points)} sizes, "
        f"busbw {last['busbw_Bps'] / 1e9:.3f} GB/s at {c.points[-1].bytes} B; "
        f"fit latency {c.fit.latency_s * 1e6:.1f} us, bus bw {c.fit.bus_bw_Bps / 1e9:.3f} GB/s, "
        f"rms residual {c.fit.rms_rel_residual:.1%}; #wrong {wrong}",
        flush=True,
    )


def launch_cost_s(curves: list[Curve]) -> float:
    """``backend.collective_launch_s``: the fastest median time of a smallest message on the world group."""
    world = [c for c in curves if c.source == "world group"] or curves
    return min(c.points[0].median_s for c in world)


def run_comm(req: CommRequest, env: RankEnv) -> None:
    """The whole comm calibration on this rank; rank 0 writes ``req.out``."""
    import torch.distributed as dist

    from calibrate import device_probe

    dog = Watchdog(env.rank)
    dog.arm("joining the process group", req.timeout_s)
    backend, device = init_distributed(env, req.timeout_s, req.backend)
    dog.disarm()
    try:
        cfg = resolve_sweep(req, device.type)
        started = time.perf_counter()
        curves = sweep_all(req, cfg, env, device, dog)
        dog.arm("the device measurements", req.timeout_s)
        probed = mean_over_ranks(device_probe.probe_device(device, ("fp32", "bf16")), device)
        dist.barrier()
        dog.disarm()
        if env.rank == 0:
            _write(req, cfg, env, backend, device, curves, probed, started)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _write(
    req: CommRequest,
    cfg: SweepConfig,
    env: RankEnv,
    backend: str,
    device: Any,
    curves: list[Curve],
    probed: dict[str, Any],
    started: float,
) -> None:
    """Rank 0: assemble the profile from the curves and the device measurements; write it atomically."""
    from calibrate import device_probe

    evidence = {d: device_probe.sdpa_kernel(device, d) for d in ("fp32", "bf16")}
    dev = {
        "name": device_probe.device_name(device),
        "memory_bytes": device_probe.total_memory_bytes(device),
        "compute_efficiency": 1.0,
        **probed,
    }
    be = {
        "name": backend,
        "overlaps_comm_compute": backend == "nccl",
        "collective_temp_buffers": backend == "gloo",
        "attention_kernel": device_probe.attention_kernel(evidence),
        "collective_launch_s": launch_cost_s(curves),
    }
    src = _source(req, cfg, env, backend, device, evidence, time.perf_counter() - started)
    doc = comm_profile(
        name=req.name,
        curves=curves,
        device=dev,
        backend=be,
        gpus_per_node=env.local_world_size,
        source=src,
        topology_dtype=cfg.dtypes[0],
    )
    doc["source"]["nccl_fit"] = attach_nccl_fit(doc, req.cluster, str(req.out))
    write_profile_atomic(req.out, doc)
    print(f"wrote {req.out} ({len(curves)} curves, {time.perf_counter() - started:.1f} s)", flush=True)


def _source(
    req: CommRequest,
    cfg: SweepConfig,
    env: RankEnv,
    backend: str,
    device: Any,
    evidence: dict[str, str],
    wall_s: float,
) -> dict[str, Any]:
    import torch

    from calibrate import device_probe

    return {
        "method": (
            f"calibrate comm: torch.distributed {backend}, {env.world_size} ranks; per size {cfg.warmup} warm-up and "
            f"{cfg.min_iters}-{cfg.max_iters} timed iterations, each after a world barrier "
            f"({'CUDA events' if device.type == 'cuda' else 'wall clock'}), max over ranks; time_s is the mean (median_s kept); "
            "algbw/busbw per nccl-tests doc/PERFORMANCE.md; fit t = latency_s + bytes*factor/bus_bw_Bps by "
            "least squares on relative residuals; device peak_flops are achieved matmul rates "
            "and hbm_bandwidth_Bps a STREAM-copy rate (read+write), both averaged over ranks measuring at once"
        ),
        "device_name": device_probe.device_name(device),
        "device_count": env.world_size,
        "nodes": env.nodes,
        "world_size": env.world_size,
        "ranks_per_node": env.local_world_size,
        **versions(backend),
        "cpu_model": device_probe.cpu_model(),
        "threads": torch.get_num_threads(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": req.command,
        "wall_s": round(wall_s, 3),
        "sweep": {f.name: getattr(cfg, f.name) for f in fields(cfg)},
        "attention_kernel_evidence": {
            **evidence,
            "rule": "flash if torch's SDPA ran a fused kernel (no seq^2 scores) for every dtype, else math",
        },
        "collective_launch_s": "fastest median time of the smallest message over the world-group curves",
    }
