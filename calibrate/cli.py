"""Command line of ``calibrate``: ``comm``, ``compute`` and ``host``; ``main(argv) -> exit code``.

Exit codes: 0 success; 1 a calibration failed (a rank died, a collective failed or timed out);
2 a user mistake (bad flag, file or profile), reported as one line without a traceback.
``fsdpsim calibrate ...`` calls ``main`` with the arguments after ``calibrate``.
"""

import argparse
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from calibrate.errors import CalibrationFailed
from calibrate.launch import COMMAND_ENV, WORKER_ENV
from sim.cli.parser import parse_size
from sim.errors import UserError

if TYPE_CHECKING:
    from calibrate.comm import Fault

PROG = "calibrate"


def _csv(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
        return items

    return parse


def _fault(text: str) -> "Fault":
    from calibrate.comm import Fault

    try:
        rank, point, kind = text.split(":")
        assert kind in ("exit", "hang")
        return Fault(rank=int(rank), point=int(point), kind=kind)
    except (ValueError, AssertionError):
        raise argparse.ArgumentTypeError("--fault RANK:POINT:exit|hang") from None


def _add_comm(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("comm", help="measure all-gather, reduce-scatter and all-reduce into a profile")
    p.add_argument("--out", type=Path, required=True, help="profile JSON to write (atomically, by rank 0)")
    p.add_argument("--name", help="profile name (default: the file name without .json)")
    p.add_argument("--nproc", type=int, help="launch N local ranks without torchrun (CPU: gloo, 127.0.0.1)")
    p.add_argument("--min-bytes", type=parse_size, help="smallest nccl-tests size (default 1K)")
    p.add_argument("--max-bytes", type=parse_size, help="largest size (default 64M on CPU, 1G on GPU)")
    p.add_argument("--factor", type=int, help="size step factor of the log grid (default 4 CPU, 2 GPU)")
    p.add_argument("--warmup", type=int, help="warm-up iterations per size (default 2 CPU, 5 GPU)")
    p.add_argument(
        "--iters", dest="min_iters", type=int, help="fewest timed iterations per size (default 5 CPU, 10 GPU)"
    )
    p.add_argument("--max-iters", type=int, help="most timed iterations per size (default 20 CPU, 50 GPU)")
    p.add_argument(
        "--dtypes", type=_csv(("fp32", "bf16", "fp16")), default=("fp32", "bf16"), help="default fp32,bf16"
    )
    p.add_argument(
        "--collectives",
        type=_csv(("all_gather", "reduce_scatter", "all_reduce", "all_to_all")),
        default=("all_gather", "reduce_scatter", "all_reduce"),
        help="default: the three FSDP uses; all_to_all (expert parallelism's token exchange) on request",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="auto: nccl on CUDA GPUs, else gloo",
    )
    p.add_argument(
        "--shard-size",
        type=int,
        help="also measure HSDP shard groups of this size and their replicate groups",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds one size may take before the run fails (default 120)",
    )
    p.add_argument(
        "--from-nccl-tests",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="read nccl-tests outputs (-J JSON or text) instead of measuring",
    )
    p.add_argument(
        "--base", help="with --from-nccl-tests: profile (built-in name or file) giving device and backend"
    )
    p.add_argument(
        "--cluster",
        help="built-in cluster (or cluster JSON) the measurements ran on: NCCL's cost model is fitted "
        "to them on its graph, so the profile extrapolates to other node counts (default: the base "
        "profile's cluster)",
    )
    p.add_argument("--fault", type=_fault, help=argparse.SUPPRESS)


def _add_compute(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compute", help="measure per-unit compute of a scenario's model into an existing profile"
    )
    p.add_argument(
        "scenario",
        nargs="?",
        help="scenario TOML (model, training.micro_batch/seq_len, precision, checkpointing)",
    )
    p.add_argument(
        "--profile", type=Path, required=True, help="profile JSON to add the compute section to (atomically)"
    )
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="scenario override"
    )
    p.add_argument("--model", help="model preset, instead of a scenario file")
    p.add_argument("--micro-batch", type=int, help="instead of a scenario file")
    p.add_argument("--seq-len", type=int, help="instead of a scenario file")
    p.add_argument("--param-dtype", choices=("fp32", "bf16"), help="instead of a scenario file")
    p.add_argument("--nproc", type=int, help="launch N local ranks (they compute at once, as in training)")
    p.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="auto: nccl and CUDA on GPUs, else gloo and CPU",
    )
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (default 5)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck rank fails the run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    _add_comm(sub)
    _add_compute(sub)
    from calibrate.cli_host import add_parser as add_host

    add_host(sub)
    return parser


def command_line(argv: list[str]) -> str:
    if COMMAND_ENV in os.environ:
        return os.environ[COMMAND_ENV]
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun (WORLD_SIZE={os.environ.get('WORLD_SIZE')}) -m calibrate " + shlex.join(argv)
    if Path(sys.argv[0]).name == "__main__.py":
        return "python -m calibrate " + shlex.join(argv)
    return shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _maybe_launch(args: argparse.Namespace, argv: list[str]) -> bool:
    """With --nproc outside a worker, run the workers and return True; else False."""
    from calibrate.dist_env import rank_env

    if args.nproc is None or os.environ.get(WORKER_ENV):
        return False
    if rank_env() is not None:
        raise UserError("--nproc starts its own ranks; do not combine it with torchrun")
    if args.nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {args.nproc}")
    from calibrate.api import run_local

    run_local(_without_nproc(argv), args.nproc, command_line(argv))
    return True


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        if args.verb == "comm" and _maybe_launch(args, argv):
            return 0
        if args.verb == "comm":
            from calibrate.cli_comm import run_comm_command

            run_comm_command(args, command_line(argv))
        elif args.verb == "host":
            from calibrate.cli_host import run_host_command

            run_host_command(args, command_line(argv))
        else:
            from calibrate.cli_compute import run_compute_command

            run_compute_command(args, command_line(argv))
        return 0
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except CalibrationFailed as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # torch.distributed errors: a peer died, a collective failed
        rank = os.environ.get("RANK", "0")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"{PROG}: error: rank {rank}: {first}; no profile written", file=sys.stderr)
        return 1
