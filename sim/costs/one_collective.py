"""A collective on its own, as ``fsdpsim comm`` answers it: its time on a group of ``nodes`` ×
``gpus_per_node`` ranks of a cluster, nccl-tests' algbw and busbw, and the algorithm, protocol and
channels NCCL's model picks. The time is the one a simulated step charges the collective: NCCL's
model plus the host's launch (``backend.collective_launch_s``), which nccl-tests' back-to-back
timing also pays for small messages."""

from dataclasses import dataclass
from typing import Any

from sim.core.topology import GroupShape
from sim.costs.collectives import bus_factor, collective_cost
from sim.hardware.network import Network
from sim.hardware.schema import HardwareProfile


@dataclass(frozen=True, kw_only=True)
class CollectiveAnswer:
    collective: str
    size_bytes: int  # nccl-tests' size: all-gather output, reduce-scatter input, all-reduce buffer
    n_ranks: int
    n_nodes: int
    time_s: float
    algorithm: str
    protocol: str
    channels: int

    @property
    def algbw_Bps(self) -> float:
        return self.size_bytes / self.time_s if self.time_s > 0 else 0.0

    @property
    def busbw_Bps(self) -> float:
        """nccl-tests doc/PERFORMANCE.md: algbw × (n-1)/n, or × 2(n-1)/n for all-reduce."""
        return self.algbw_Bps * bus_factor(self.collective, self.n_ranks)

    def to_json(self) -> dict[str, Any]:
        return {
            "collective": self.collective,
            "size_bytes": self.size_bytes,
            "n_ranks": self.n_ranks,
            "n_nodes": self.n_nodes,
            "time_s": self.time_s,
            "algbw_Bps": self.algbw_Bps,
            "busbw_Bps": self.busbw_Bps,
            "algorithm": self.algorithm,
            "protocol": self.protocol,
            "channels": self.channels,
        }


def one_collective(
    collective: str, size_bytes: int, profile: HardwareProfile, network: Network, dtype: str = "bf16"
) -> CollectiveAnswer:
    """``collective`` of ``size_bytes`` over every rank of ``network`` (ranks node-major)."""
    n = network.n_nodes * network.ranks_per_node
    shape = GroupShape(size=n, spans_nodes=network.n_nodes > 1)
    fabric = network.fabric(tuple(range(n))) if profile.backend.name == "nccl" and n > 1 else None
    cost = collective_cost(collective, size_bytes, shape, dtype, profile, fabric)
    return CollectiveAnswer(
        collective=collective,
        size_bytes=size_bytes,
        n_ranks=n,
        n_nodes=network.n_nodes,
        time_s=cost.time_s,
        algorithm=cost.algorithm,
        protocol=cost.protocol,
        channels=cost.channels,
    )
