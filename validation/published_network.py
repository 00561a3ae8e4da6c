"""The network half of ``make validate-published``: single collectives of the development set
(``shared/published-dev.md`` §4: nccl-tests bus bandwidths and small-message times on published
clusters) predicted by ``sim.costs.nccl`` on the built-in clusters, against the published figures,
and the per-GPU throughput the simulator predicts for one model from one node to 16. Nothing is
fitted to these figures. Targets (the network issue): large-message bus bandwidth within 10 %,
small-message time within 25 %."""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sim.costs.one_collective import CollectiveAnswer, one_collective
from sim.hardware.cluster_spec import load_cluster
from sim.hardware.network import job_network
from sim.hardware.registry import load_profile
from sim.outputs.report import build_report
from sim.scenario.loader import scenario_from_dict
from sim.simulate import simulate

GiB, MiB = 1 << 30, 1 << 20
BUSBW_TOLERANCE, TIME_TOLERANCE = 0.10, 0.25


@dataclass(frozen=True, kw_only=True)
class CollectiveCheck:
    """One published collective: its shape, the cluster it ran on, and the figure published."""

    name: str
    collective: str
    size_bytes: int
    cluster: str
    nodes: int
    published: float  # bus bandwidth in B/s (``metric`` "busbw") or time in s ("time")
    metric: str
    source: str
    what_ifs: dict[str, Any] = field(default_factory=dict)  # cluster fields the run had otherwise

    @property
    def tolerance(self) -> float:
        return BUSBW_TOLERANCE if self.metric == "busbw" else TIME_TOLERANCE


FOUR_NICS = {"nics_per_node": 4, "gpus_per_nic": 2}
CHECKS: tuple[CollectiveCheck, ...] = (
    CollectiveCheck(
        name="8 x A100 all-reduce 1 GB",
        collective="all_reduce",
        size_bytes=GiB,
        cluster="dgx-a100",
        nodes=1,
        published=228.1e9,
        metric="busbw",
        source="Azure ND A100 v4, NCCL 2.18 (Azure/AI-benchmarking-guide)",
    ),
    CollectiveCheck(
        name="8 x A100 all-reduce 8 GB",
        collective="all_reduce",
        size_bytes=8 * GiB,
        cluster="dgx-a100",
        nodes=1,
        published=231.6e9,
        metric="busbw",
        source="Azure ND A100 v4, NCCL 2.18 (Azure/AI-benchmarking-guide)",
    ),
    CollectiveCheck(
        name="8 x H100 all-gather 1 GB (ring)",
        collective="all_gather",
        size_bytes=GiB,
        cluster="dgx-h100",
        nodes=1,
        published=367.5e9,
        metric="busbw",
        source="ring 365-370 GB/s at 2-8 GPUs (NVIDIA/nccl#1455)",
    ),
    CollectiveCheck(
        name="8 x H100 all-reduce 1 GB (NVLS)",
        collective="all_reduce",
        size_bytes=GiB,
        cluster="dgx-h100",
        nodes=1,
        published=480e9,
        metric="busbw",
        source="NVLS 480 GB/s at 8 GPUs (NVIDIA/nccl#1455)",
    ),
    CollectiveCheck(
        name="4 DGX A100 all-reduce 1 GB",
        collective="all_reduce",
        size_bytes=GiB,
        cluster="dgx-a100",
        nodes=4,
        published=192e9,
        metric="busbw",
        source="8 x 200 Gb/s HDR per node, 192 GB/s (NVIDIA, NVIDIA/nccl#812)",
    ),
    CollectiveCheck(
        name="5 x 8 H100, 4 x 400 Gb/s, all-reduce 1 GB (ring)",
        collective="all_reduce",
        size_bytes=GiB,
        cluster="dgx-h100",
        nodes=5,
        published=190e9,
        metric="busbw",
        source="RoCE, ring 190 GB/s (NVIDIA/nccl#1368)",
        what_ifs=FOUR_NICS,
    ),
    CollectiveCheck(
        name="32 A100 nodes, 4 x HDR, small all-reduce",
        collective="all_reduce",
        size_bytes=8,
        cluster="dgx-a100",
        nodes=32,
        published=63e-6,
        metric="time",
        source="about 63 us (NVIDIA/nccl#652)",
        what_ifs=FOUR_NICS,
    ),
    CollectiveCheck(
        name="8 x A100 all-reduce 1 MB",
        collective="all_reduce",
        size_bytes=MiB,
        cluster="dgx-a100",
        nodes=1,
        published=MiB / (36.2e9 / 1.75),
        metric="time",
        source="36.2 GB/s bus bandwidth at 1 MB (Azure/AI-benchmarking-guide)",
    ),
)


def predict_collective(check: CollectiveCheck) -> CollectiveAnswer:
    spec = dataclasses.replace(load_cluster(check.cluster), **check.what_ifs)
    profile = load_profile(spec.device_profile)
    network = job_network(
        spec,
        world_size=check.nodes * spec.gpus_per_node,
        ranks_per_node=spec.gpus_per_node,
        arch=profile.device.architecture,
    )
    return one_collective(check.collective, check.size_bytes, profile, network)


def predicted_value(check: CollectiveCheck) -> float:
    answer = predict_collective(check)
    return answer.busbw_Bps if check.metric == "busbw" else answer.time_s


def _check_row(check: CollectiveCheck) -> tuple[str, bool]:
    answer = predict_collective(check)
    value = predicted_value(check)
    error = value / check.published - 1
    ok = abs(error) <= check.tolerance
    unit, scale = ("GB/s busbw", 1e-9) if check.metric == "busbw" else ("us", 1e6)
    return (
        f"| {check.name} | {value * scale:,.1f} {unit} | {check.published * scale:,.1f} {unit} | {error:+.1%} "
        f"| {answer.algorithm}/{answer.protocol}, {answer.channels} ch | {check.source} |",
        ok,
    )


SCALING_MODEL: dict[str, dict[str, Any]] = {
    "model": {"preset": "llama2-7b"},
    "training": {"micro_batch": 2, "seq_len": 4096},
    "parallel": {"strategy": "FULL_SHARD", "wrap": "block"},
    "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
}


def _scaling_rows() -> list[str]:
    """Per-GPU throughput of one model at 8 and 128 GPUs on each cluster (no dev-set pair to
    compare with: the published 1-node and 16-node runs are held back)."""
    rows = []
    for cluster in ("dgx-a100", "dgx-h100", "aws-p4d", "aws-p5"):
        per_gpu = []
        for ranks in (8, 128):
            tables = {**SCALING_MODEL, "parallel": {**SCALING_MODEL["parallel"], "world_size": ranks}}
            tables["cluster"] = {"name": cluster}
            per_gpu.append(build_report(simulate(scenario_from_dict(tables, cluster))).tokens_per_s_per_gpu)
        rows.append(f"| {cluster} | {per_gpu[0]:,.0f} | {per_gpu[1]:,.0f} | {per_gpu[1] / per_gpu[0]:.3f} |")
    return rows


def network_section() -> str:
    lines = [
        "### Collectives against published nccl-tests figures",
        "",
        "Predicted by NCCL's own cost model (`sim/costs/nccl.py`) on the built-in clusters; time as a "
        "simulated step charges it (with the host's launch); targets: bus bandwidth within "
        f"{BUSBW_TOLERANCE:.0%}, small-message time within {TIME_TOLERANCE:.0%}.",
        "",
        "| collective | predicted | published | error | NCCL's choice | source |",
        "|---|---|---|---|---|---|",
    ]
    results = [_check_row(c) for c in CHECKS]
    lines += [row for row, _ in results]
    met = sum(ok for _, ok in results)
    lines += [
        "",
        f"{met} of {len(results)} within their tolerance.",
        "",
        "### Scale-out: tokens/s per GPU from 8 to 128 GPUs (Llama-2-7B, FULL_SHARD, bf16, 2 x 4096)",
        "",
        "| cluster | 8 GPUs | 128 GPUs | ratio |",
        "|---|---|---|---|",
        *_scaling_rows(),
        "",
        "The development set has no published pair of one model on one node and on many to compare these "
        "ratios with; those runs are held back.",
    ]
    return "\n".join(lines) + "\n"
