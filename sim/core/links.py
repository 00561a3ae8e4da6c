"""Collectives that run at the same time share the links they cross: a flow-level model with
max-min fair rates (progressive filling, Bertsekas and Gallager, "Data Networks", §6.5.2).

Each flow is a collective in flight: ``work_s`` seconds at full speed, of which ``share`` is
spent moving bytes over each link in ``links`` (the rest is latency, which contends for nothing).
At full speed it takes ``share`` of every link it crosses; a link's flows together take at most
all of it. Every flow gets the largest common rate its links allow, the flows of a saturated link
stop there, and the others grow on (progressive filling). Rates are recomputed whenever a flow
starts or ends, and a running flow's remaining work is carried over at its new rate.
"""

from collections.abc import Generator, Hashable
from dataclasses import dataclass

import simpy

EPS_S = 1e-15


@dataclass
class Flow:
    share: float
    links: tuple[Hashable, ...]
    rate: float = 1.0


def max_min_rates(flows: list[Flow]) -> list[float]:
    """Max-min fair rates in (0, 1] for ``flows`` whose shares of a link sum to at most one per unit rate."""
    rates = [1.0 if f.share <= 0 or not f.links else 0.0 for f in flows]
    active = {i for i, f in enumerate(flows) if rates[i] == 0.0}
    used: dict[Hashable, float] = {}
    while active:
        demand: dict[Hashable, float] = {}
        for i in active:
            for link in flows[i].links:
                demand[link] = demand.get(link, 0.0) + flows[i].share
        level = min([1.0] + [(1.0 - used.get(link, 0.0)) / d for link, d in demand.items()])
        full = {link for link, d in demand.items() if (1.0 - used.get(link, 0.0)) / d <= level * (1 + 1e-12)}
        done = {i for i in active if level >= 1.0 or full.intersection(flows[i].links)}
        for i in done:
            rates[i] = max(level, EPS_S)
            for link in flows[i].links:
                used[link] = used.get(link, 0.0) + flows[i].share * rates[i]
        active -= done
    return rates


class SharedLinks:
    """The flows in flight on one simulation, each run by its own SimPy process."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.flows: dict[simpy.Process, Flow] = {}

    def transfer(
        self, work_s: float, share: float, links: tuple[Hashable, ...]
    ) -> Generator[simpy.Event, object, None]:
        """Run a flow of ``work_s`` full-speed seconds to its end, at the rate the others leave it."""
        process = self.env.active_process
        assert process is not None
        flow = Flow(share=share, links=links)
        self.flows[process] = flow
        self._rebalance(process)
        while work_s > EPS_S:
            started, rate = self.env.now, flow.rate
            try:
                yield self.env.timeout(work_s / rate)
                work_s = 0.0
            except simpy.Interrupt:
                work_s -= (self.env.now - started) * rate
        del self.flows[process]
        self._rebalance(process)

    def _rebalance(self, current: simpy.Process) -> None:
        """New rates for every flow; a flow whose rate changed recomputes its remaining time."""
        processes = list(self.flows)
        for process, rate in zip(processes, max_min_rates([self.flows[p] for p in processes]), strict=True):
            flow = self.flows[process]
            if rate != flow.rate:
                flow.rate = rate
                if process is not current and process.is_alive:
                    process.interrupt()
