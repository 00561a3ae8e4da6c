"""``calibrate comm``: from arguments to a measured (or nccl-tests-imported) profile."""

import argparse
import os
from pathlib import Path

from calibrate.comm import CommRequest, run_comm
from calibrate.dist_env import rank_env
from sim.errors import UserError


def check_writable(out: Path) -> None:
    """Fail before measuring when the profile could not be written afterwards."""
    parent = out.parent if str(out.parent) else Path(".")
    if out.exists() and out.is_dir():
        raise UserError(f"--out {out} is a directory")
    existing = next((p for p in [parent, *parent.parents] if p.exists()), Path("."))
    if not os.access(existing, os.W_OK):
        raise UserError(f"--out {out}: directory {existing} is not writable")


def run_comm_command(args: argparse.Namespace, command: str) -> None:
    check_writable(args.out)
    name = args.name or args.out.stem
    if args.from_nccl_tests:
        from calibrate.nccl_import import import_nccl_tests

        import_nccl_tests(
            args.from_nccl_tests,
            out=args.out,
            name=name,
            base=args.base,
            command=command,
            cluster=args.cluster,
        )
        return
    env = rank_env()
    if env is None:
        raise UserError("calibrate comm needs at least 2 ranks: pass --nproc N, or run it under torchrun")
    if env.world_size < 2:
        raise UserError(f"calibrate comm needs at least 2 ranks, got WORLD_SIZE={env.world_size}")
    req = CommRequest(
        out=args.out,
        name=name,
        overrides={
            "min_bytes": args.min_bytes,
            "max_bytes": args.max_bytes,
            "factor": args.factor,
            "warmup": args.warmup,
            "min_iters": args.min_iters,
            "max_iters": args.max_iters,
        },
        dtypes=args.dtypes,
        collectives=args.collectives,
        timeout_s=args.timeout,
        backend=args.backend,
        shard_size=args.shard_size,
        fault=args.fault,
        command=command,
        cluster=args.cluster,
    )
    run_comm(req, env)
