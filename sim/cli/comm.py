"""``fsdpsim comm COLLECTIVE --size BYTES --nodes N --gpus-per-node G --cluster NAME``: one
collective on its own, the number to check against your own nccl-tests run (time, algbw and
busbw by nccl-tests' definitions, NCCL's algorithm, protocol and channels); ``--format json``
prints ``time_s, algbw_Bps, busbw_Bps, algorithm, protocol, channels`` and the inputs."""

import argparse
import json

from sim.cli.parser import parse_size
from sim.costs.one_collective import CollectiveAnswer, one_collective
from sim.errors import UserError
from sim.hardware.cluster_spec import BUILTIN_CLUSTERS, load_cluster
from sim.hardware.network import job_network
from sim.hardware.registry import load_profile
from sim.hardware.schema import COLLECTIVES

DEFAULT_CLUSTER = "dgx-h100"


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("comm", help="one collective on its own: time, algbw, busbw, algorithm, protocol")
    p.add_argument("collective", choices=COLLECTIVES)
    p.add_argument(
        "--size", type=parse_size, required=True, metavar="BYTES", help="nccl-tests size: 4096, 1K, 64M, 1G"
    )
    p.add_argument("--nodes", type=int, default=1, metavar="N")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G", help="default: the cluster's")
    p.add_argument(
        "--cluster",
        default=DEFAULT_CLUSTER,
        metavar="NAME",
        help=f"built-in cluster or cluster JSON file (default {DEFAULT_CLUSTER}; {', '.join(BUILTIN_CLUSTERS)})",
    )
    p.add_argument("--profile", default=None, help="hardware profile (default: the cluster's GPUs)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--nic-factor", type=float, default=1.0, help="NICs at this fraction of their rate")
    p.add_argument("--spine-oversubscription", type=float, default=None)
    p.add_argument("--format", choices=("table", "json"), default="table")


def main(args: argparse.Namespace) -> int:
    spec = load_cluster(args.cluster, where="comm --cluster")
    profile = load_profile(args.profile or spec.device_profile, where="comm --profile")
    gpus = args.gpus_per_node or spec.gpus_per_node
    if args.nodes < 1 or gpus < 1:
        raise UserError("comm: --nodes and --gpus-per-node must be >= 1")
    if gpus > spec.gpus_per_node:
        raise UserError(
            f"comm: --gpus-per-node {gpus}, but a {spec.name} node holds {spec.gpus_per_node} GPUs"
        )
    if not args.nic_factor > 0:
        raise UserError(f"comm: --nic-factor must be > 0, got {args.nic_factor}")
    network = job_network(
        spec,
        world_size=args.nodes * gpus,
        ranks_per_node=gpus,
        arch=profile.device.architecture,
        nic_factor=args.nic_factor,
        spine_oversubscription=args.spine_oversubscription,
    )
    answer = one_collective(args.collective, args.size, profile, network, args.dtype)
    print(json.dumps(answer.to_json()) if args.format == "json" else table(answer, spec.name, profile.name))
    return 0


def table(a: CollectiveAnswer, cluster: str, profile: str) -> str:
    how = f"{a.algorithm}, {a.protocol}, {a.channels} channels" if a.protocol else a.algorithm
    return "\n".join(
        [
            f"collective  {a.collective} of {a.size_bytes:,} B on {a.n_ranks} ranks ({a.n_nodes} nodes of {cluster}, {profile})",
            f"time        {a.time_s * 1e6:,.1f} us",
            f"algbw       {a.algbw_Bps / 1e9:.2f} GB/s",
            f"busbw       {a.busbw_Bps / 1e9:.2f} GB/s (nccl-tests' bus bandwidth)",
            f"algorithm   {how}",
        ]
    )
