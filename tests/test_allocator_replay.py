"""``validation.allocator_replay``: a real FSDP1 step's own allocations, logged storage by storage
and replayed through the caching-allocator model."""

from pathlib import Path

import pytest

from validation.allocator_replay import replay

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
    with_workspace = replay(events, 1, capacity_bytes=BIG, workspace_bytes=8 * MIB, steps=1)
    assert with_workspace["peak_allocated_bytes"] == 70 * MIB
    assert with_workspace["peak_reserved_bytes"] == 72 * MIB + 20 * MIB  # 8 MiB: a 20 MiB segment


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
