"""``validation.allocator_replay``: a real FSDP1 step's own allocations, logged storage by storage
and replayed through the caching-allocator model."""

from pathlib import Path

import pytest

from validation.allocator_trace import replay
from validation.fsdp1_init import fsdp1_init_order, simulated_reserved_bytes

MIB = 1 << 20
BIG = 1 << 40
DATA = Path(__file__).resolve().parent / "data" / "hf"


def test_replay_of_a_hand_made_log() -> None:
    """Two 30 MiB tensors on the compute stream, one freed and its block reused by a 20 MiB one
    (62 MiB live at most);
    a 12 MiB gathered parameter on the unshard stream cannot reuse the compute stream's hole."""
    events = [
        ("alloc", 1, 30 * MIB, "compute"),  # before the step: its own 30 MiB segment
        ("alloc", 2, 30 * MIB, "compute"),
        ("free", 2, 0, ""),
        ("alloc", 3, 20 * MIB, "compute"),  # best fit: 2's freed 30 MiB block, split
        ("alloc", 4, 12 * MIB, "all_gather"),  # another stream's pool: a new segment
        ("free", 3, 0, ""),
        ("free", 4, 0, ""),
        ("free", 99, 0, ""),  # a storage that lived before the log: ignored
    ]
    one = replay(events, 1, capacity_bytes=BIG, workspace_bytes=0, steps=1)
    assert one == {"peak_allocated_bytes": 62 * MIB, "peak_reserved_bytes": 72 * MIB}
    # a second step reuses the first one's cached segments: nothing more is reserved
    assert replay(events, 1, capacity_bytes=BIG, workspace_bytes=0, steps=2) == one
    # two cuBLAS workspaces (the forward's thread and autograd's): 8 MiB each share a 20 MiB segment
    with_workspace = replay(events, 1, capacity_bytes=BIG, workspace_bytes=8 * MIB, steps=1)
    assert with_workspace["peak_allocated_bytes"] == 62 * MIB + 2 * 8 * MIB
    assert with_workspace["peak_reserved_bytes"] == 72 * MIB + 20 * MIB
    # Hopper's 32 MiB ones each take a segment of their own
    hopper = replay(events, 1, capacity_bytes=BIG, workspace_bytes=32 * MIB, steps=1)
    assert hopper == {"peak_allocated_bytes": 62 * MIB + 64 * MIB, "peak_reserved_bytes": 72 * MIB + 64 * MIB}


@pytest.mark.slow
def test_a_real_fsdp1_step_is_logged_whole(tmp_path: Path) -> None:
    """The log of a real FSDP1 LoRA step (tiny-llama, one rank of 4, fake process group) replays
    to the tracker's own peak: every allocation and free is in it, in order; the gathered flat
    parameters come from the unshard stream's pool, the reductions' from the post-backward one."""
    from sim.scenario.loader import load_scenario
    from validation.allocator_replay import logged_step

    (tmp_path / "tiny-llama.json").write_text((DATA / "tiny-llama.json").read_text())
    path = tmp_path / "s.toml"
    path.write_text(
        '[model]\nconfig = "tiny-llama.json"\n[training]\nmicro_batch = 2\nseq_len = 128\n'
        '[parallel]\nworld_size = 4\nfsdp_version = 1\nwrap = "peft"\n'
        '[precision]\nparam_dtype = "fp32"\nreduce_dtype = "fp32"\n'
        '[finetune]\nmethod = "lora"\nrank = 8\nalpha = 16\ntarget_modules = ["q_proj", "v_proj"]\n'
    )
    log, measured = logged_step(load_scenario(path), legacy=False)
    streams = {stream for kind, _, _, stream in log.events[log.step_start :] if kind == "alloc"}
    assert streams == {"compute", "all_gather", "reduce_scatter"}
    out = replay(log.events, log.step_start, capacity_bytes=BIG, workspace_bytes=0, steps=1)
    assert out["peak_allocated_bytes"] == measured["total"]
    assert out["peak_reserved_bytes"] >= out["peak_allocated_bytes"]


def test_fsdp1_initialises_nested_units_before_their_holder_and_the_root_last() -> None:
    from sim.workload.units import ROOT, WrapUnit

    def unit(prefix: str) -> WrapUnit:
        return WrapUnit(name=prefix or ROOT, prefix=prefix, params=())

    units = [
        unit(""),
        unit("layers.0"),
        unit("layers.0.q.lora_A"),
        unit("layers.0.q.lora_B"),
        unit("layers.1"),
    ]
    order = [u.prefix for u in fsdp1_init_order(units)]
    assert order == ["layers.0.q.lora_A", "layers.0.q.lora_B", "layers.0", "layers.1", ""]


def test_the_simulated_replay_with_and_without_fsdp1_initialisation() -> None:
    """Without the initialisation: the report's own reserved peak (one replay, one rule set). With
    it: FSDP1's per-unit move, flatten and shard leave after ``empty_cache()`` only the segments
    the shards live in, and the step then reserves at least as much as those hold."""
    from simtest import make_scenario

    from sim.outputs.report import build_report
    from sim.simulate import simulate

    scenario = make_scenario(
        model={"preset": "tiny", "n_layers": 4},
        parallel={"fsdp_version": 1, "world_size": 4},
        cluster={"profile": "a100-sxm-80g"},
    )
    result = simulate(scenario)
    assert simulated_reserved_bytes(result, fsdp1_init=False) == (0, build_report(result).peak_reserved_bytes)
    after_init, peak = simulated_reserved_bytes(result, fsdp1_init=True)
    shards = [r for r in result.events.memory_of(0) if r.label.startswith("param:")]
    assert len(shards) == len(result.step.units)
    assert sum(r.delta_bytes for r in shards) <= after_init <= peak
    assert after_init % (2 << 20) == 0  # whole segments: small ones 2 MiB, large ones 2 MiB multiples
