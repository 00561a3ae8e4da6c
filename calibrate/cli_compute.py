"""``calibrate compute``: resolve what to measure (scenario file or flags), check the profile,
choose the ranks, and run ``calibrate.compute_run`` on each."""

import argparse
import os
from pathlib import Path
from typing import Any

from calibrate.api import run_local
from calibrate.compute import ComputeTarget
from calibrate.compute_run import run_compute
from calibrate.dist_env import rank_env
from calibrate.launch import WORKER_ENV
from sim.errors import UserError
from sim.hardware.registry import read_profile_document
from sim.workload.model import preset


def target_from_args(args: argparse.Namespace, ranks: int) -> ComputeTarget:
    flags = (args.model, args.micro_batch, args.seq_len, args.param_dtype)
    if args.scenario:
        if any(f is not None for f in flags):
            raise UserError("give a scenario file or --model/--micro-batch/--seq-len/--param-dtype, not both")
        from sim.scenario.deepspeed_config import deepspeed_config
        from sim.scenario.loader import load_scenario

        sc = load_scenario(args.scenario, args.overrides)
        target = ComputeTarget(
            model=sc.model,
            micro_batch=sc.training.micro_batch,
            seq_len=sc.training.seq_len,
            param_dtype=sc.precision.param_dtype,
            world_size=sc.parallel.world_size,
            deepspeed_config=deepspeed_config(sc) if sc.deepspeed.enabled else None,
        )
        target.check_measurable()
        return target
    if args.model is None or args.micro_batch is None or args.seq_len is None:
        raise UserError("calibrate compute needs a scenario file, or --model, --micro-batch and --seq-len")
    if args.micro_batch < 1 or args.seq_len < 2:
        raise UserError("--micro-batch must be >= 1 and --seq-len >= 2")
    return ComputeTarget(
        model=preset(args.model, where="--model"),
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        param_dtype=args.param_dtype or "fp32",
        world_size=ranks,
    )


def default_ranks(profile: dict[str, Any]) -> int:
    """The rank layout of the profile's own comm calibration on this node, else one rank."""
    per_node = profile.get("source", {}).get("ranks_per_node")
    return per_node if isinstance(per_node, int) and per_node >= 1 else 1


def run_compute_command(args: argparse.Namespace, command: str) -> None:
    profile = read_profile_document(args.profile)
    if args.reps < 1:
        raise UserError(f"--reps must be >= 1, got {args.reps}")
    env = rank_env()
    if env is None:
        nproc = args.nproc or default_ranks(profile)
        target_from_args(args, nproc)  # report a bad scenario before starting ranks
        run_local(_argv(args), nproc, command)
        return
    if not os.environ.get(WORKER_ENV) and args.nproc:
        raise UserError("--nproc starts its own ranks; do not combine it with torchrun")
    target = target_from_args(args, env.world_size)
    run_compute(target, Path(args.profile), env, args.reps, args.timeout, command, args.backend)


def _argv(args: argparse.Namespace) -> list[str]:
    """The worker command line: the same request, without --nproc."""
    out = ["compute"] + ([args.scenario] if args.scenario else [])
    out += ["--profile", str(args.profile), "--reps", str(args.reps), "--timeout", str(args.timeout)]
    out += ["--backend", args.backend]
    for o in args.overrides:
        out += ["--set", o]
    for flag, value in (
        ("--model", args.model),
        ("--micro-batch", args.micro_batch),
        ("--seq-len", args.seq_len),
        ("--param-dtype", args.param_dtype),
    ):
        if value is not None:
            out += [flag, str(value)]
    return out
