"""Collectives share the links they cross (sim.core.links): max-min fair rates, and in the engine
two collectives on one node's network each run at half speed while both are in flight."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.engine import Variability, run_program
from sim.core.events import OpKind, Stream
from sim.core.links import Flow, max_min_rates
from sim.core.program import Program
from sim.core.topology import GroupKind, Topology


def test_two_flows_on_one_link_split_it() -> None:
    assert max_min_rates([Flow(share=1.0, links=("a",)), Flow(share=1.0, links=("a",))]) == [0.5, 0.5]


def test_a_light_flow_is_not_slowed_and_leaves_the_rest() -> None:
    rates = max_min_rates([Flow(share=0.2, links=("a",)), Flow(share=1.0, links=("a",))])
    assert rates == pytest.approx([1.0, 0.8])


def test_progressive_filling_across_two_links() -> None:
    # f0 on a, f1 on a and b, f2 on b: a and b each split in two
    flows = [Flow(share=1.0, links=("a",)), Flow(share=1.0, links=("a", "b")), Flow(share=1.0, links=("b",))]
    assert max_min_rates(flows) == pytest.approx([0.5, 0.5, 0.5])
    # a flow alone on its link, beside latency-only flows, keeps full speed
    assert max_min_rates([Flow(share=0.0, links=("a",)), Flow(share=1.0, links=("a",))]) == [1.0, 1.0]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 1.0), st.sets(st.sampled_from("abcd"), min_size=1, max_size=3)),
        min_size=1,
        max_size=8,
    )
)
def test_no_link_beats_its_capacity(raw: list[tuple[float, set[str]]]) -> None:
    flows = [Flow(share=s, links=tuple(sorted(ls))) for s, ls in raw]
    rates = max_min_rates(flows)
    assert all(0 < r <= 1 for r in rates)
    for link in "abcd":
        assert sum(r * f.share for r, f in zip(rates, flows, strict=True) if link in f.links) <= 1 + 1e-9


def _two_collectives(wire_fraction: float) -> dict[str, tuple[float, float]]:
    """Rank 0's shard all-gather (nodes 0, 1) and replicate all-reduce (nodes 0, 2), issued at once:
    both cross node 0's network."""
    p = Program()
    for stream, kind, name, group, duration in (
        (Stream.ALL_GATHER, OpKind.ALL_GATHER, "ag", GroupKind.SHARD, 1.0),
        (Stream.ALL_REDUCE, OpKind.ALL_REDUCE, "ar", GroupKind.REPLICATE, 2.0),
    ):
        p.emit(
            stream=stream,
            kind=kind,
            name=name,
            unit="u",
            microbatch=0,
            duration_s=duration,
            group=group,
            bytes=1,
            wire_fraction=wire_fraction,
        )
    topology = Topology(world_size=4, gpus_per_node=1, shard_size=2)
    table = run_program(p, topology, Variability(), serial=False)
    return {o.name: (o.start_s, o.end_s) for o in table.ops_of(0)}


def test_collectives_crossing_one_nic_share_it() -> None:
    t = _two_collectives(1.0)
    # both at half speed until the all-gather's 1 s of work is done at t=2, then the all-reduce
    # alone finishes its remaining 1 s at full speed
    assert t["ag"] == pytest.approx((0.0, 2.0))
    assert t["ar"] == pytest.approx((0.0, 3.0))
    alone = _two_collectives(0.0)  # latency-bound collectives contend for nothing
    assert alone == {"ag": (0.0, 1.0), "ar": (0.0, 2.0)}
