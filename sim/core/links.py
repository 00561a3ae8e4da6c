"""Collectives that run at the same time share the links they cross: a flow-level model with
max-min fair rates (progressive filling, Bertsekas and Gallager, "Data Networks", §6.5.2).

Each flow is a collective in flight: ``work_s`` seconds at full speed, of which ``share`` is
spent moving bytes over each link in ``links`` (the rest is latency, which contends for nothing).
At full speed it takes ``share`` of every link it crosses; a link's flows together take at most
all of it, shared max-min fairly: equal shares, a flow that needs less keeping all it needs and
leaving the rest to the others (progressive filling). Rates are recomputed whenever a flow
starts or ends, and a running flow's remaining work is carried over at its new rate.

A group spanning many nodes crosses thousands of links (each node's NICs and NVLink), but only
the set of flows on a link matters to the filling: links are merged into classes of equal flow
sets, computed once per combination of flows in flight (keyed by the flows' ``key``, their
process group), so a rebalance costs the number of classes, not of links.
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
    key: Hashable = None  # what fixes ``links`` (its process group); None: not cached


def link_classes(flows: list[Flow]) -> list[tuple[int, ...]]:
    """The distinct sets of flows (by index) that share a link: one entry per class of links."""
    on_link: dict[Hashable, list[int]] = {}
    for i, f in enumerate(flows):
        for link in f.links:
            on_link.setdefault(link, []).append(i)
    return sorted({tuple(members) for members in on_link.values()})


def max_min_rates(flows: list[Flow], classes: list[tuple[int, ...]] | None = None) -> list[float]:
    """Rates in (0, 1] from a max-min fair share of every link's bandwidth: flows on a link share it
    equally, a flow that needs less than its equal share (``share``) runs at full speed and leaves
    the rest to the others (water-filling; no link ever carries more than all of it). ``classes``
    (``link_classes``) stands for the links when given."""
    if classes is None:
        classes = link_classes(flows)
    links_of: list[list[int]] = [[] for _ in flows]
    for c, members in enumerate(classes):
        for i in members:
            links_of[i].append(c)
    rates = [1.0] * len(flows)
    active = {i for i, f in enumerate(flows) if f.share > 0 and links_of[i]}
    used: dict[int, float] = {}  # bandwidth taken by frozen flows, per link class
    while active:
        count: dict[int, int] = {}
        for i in active:
            for link in links_of[i]:
                count[link] = count.get(link, 0) + 1
        fair = {link: (1.0 - used.get(link, 0.0)) / n for link, n in count.items()}
        level = min([flows[i].share for i in active] + list(fair.values()))
        full = {link for link, x in fair.items() if x <= level * (1 + 1e-12)}
        frozen = {i for i in active if flows[i].share <= level or full.intersection(links_of[i])}
        for i in frozen:
            allocation = min(flows[i].share, level)
            rates[i] = max(allocation / flows[i].share, EPS_S)
            for link in links_of[i]:
                used[link] = used.get(link, 0.0) + allocation
        active -= frozen
    return rates


class SharedLinks:
    """The flows in flight on one simulation, each run by its own SimPy process."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.flows: dict[simpy.Process, Flow] = {}
        self.classes: dict[tuple[Hashable, ...], list[tuple[int, ...]]] = {}

    def transfer(
        self, work_s: float, share: float, links: tuple[Hashable, ...], key: Hashable = None
    ) -> Generator[simpy.Event, object, None]:
        """Run a flow of ``work_s`` full-speed seconds to its end, at the rate the others leave it."""
        process = self.env.active_process
        assert process is not None
        flow = Flow(share=share, links=links, key=key)
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
        flows = [self.flows[p] for p in processes]
        keys = tuple(f.key for f in flows)
        classes = self.classes.get(keys) if None not in keys else None
        if classes is None:
            classes = link_classes(flows)
            if None not in keys:
                self.classes[keys] = classes
        for process, rate in zip(processes, max_min_rates(flows, classes), strict=True):
            flow = self.flows[process]
            if rate != flow.rate:
                flow.rate = rate
                if process is not current and process.is_alive:
                    process.interrupt()
