"""Calibration starts each timed repetition with caches as a training step leaves them."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from calibrate import cache_state
from calibrate.cache_state import copies_for
from calibrate.sweep import build_op


def _cache_dir(root: Path, entries: list[tuple[int, str, str]]) -> Path:
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return root


def test_the_last_level_cache_is_the_largest_data_cache_sysfs_lists(tmp_path: Path) -> None:
    root = _cache_dir(
        tmp_path,
        [(1, "Data", "48K"), (1, "Instruction", "64K"), (2, "Unified", "2048K"), (3, "Unified", "491520K")],
    )
    assert cache_state.cache_sizes_bytes(root) == [48 * 1024, 2048 * 1024, 491520 * 1024]
    assert cache_state.last_level_cache_bytes(torch.device("cpu"), root) == 491520 * 1024


def test_without_sysfs_caches_the_buffer_is_triton_do_bench_s(tmp_path: Path) -> None:
    assert cache_state.last_level_cache_bytes(torch.device("cpu"), tmp_path / "absent") == 256 * 2**20


@pytest.mark.parametrize("text,value", [("48K", 49152), ("2M", 2 * 2**20), ("1G", 2**30), ("512", 512)])
def test_sysfs_sizes_use_binary_units(text: str, value: int) -> None:
    assert cache_state.sysfs_size_bytes(text) == value


def test_this_machine_has_a_cache_to_evict() -> None:
    assert cache_state.last_level_cache_bytes(torch.device("cpu")) >= 2**20


def test_rotation_needs_enough_sets_to_outrun_the_cache_but_no_more_than_the_uses() -> None:
    assert copies_for(1 << 20, uses=100, cache_bytes=8 << 20) == 9  # 8 others × 1 MiB before a reuse
    assert copies_for(3 << 20, uses=100, cache_bytes=8 << 20) == 4  # 3 others × 3 MiB >= 8 MiB
    assert copies_for(1024, uses=32, cache_bytes=8 << 20) == 32  # each use its own set
    assert copies_for(64 << 20, uses=7, cache_bytes=8 << 20) == 2  # the other one outgrows the cache


@pytest.fixture
def one_rank_group() -> object:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"])
def test_each_iteration_of_a_point_uses_the_next_buffer_set(collective: str, one_rank_group: object) -> None:
    size = 4096  # one set: 4 KiB in and 4 KiB out (all-reduce: one 4 KiB buffer) on one rank
    op = build_op(
        collective, size, "fp32", one_rank_group, 0, 1, torch.device("cpu"), uses=7, cache_bytes=3 * size
    )
    assert op.sets == (4 if collective == "all_reduce" else 3)
    seen = []
    for _ in range(7):
        op.before_each()
        op.run()
        assert op.wrong() == 0  # every set holds the right inputs and gets the right result
        seen.append(op.current_output().data_ptr())
    assert len(set(seen)) == op.sets
    assert seen == [seen[i % op.sets] for i in range(7)]  # round robin: the longest reuse distance


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_cache_is_the_devices_l2() -> None:
    device = torch.device("cuda", 0)
    assert (
        cache_state.last_level_cache_bytes(device)
        == torch.cuda.get_device_properties(device).L2_cache_size
        > 0
    )
    cache_state.evict(device)  # the buffer lives on the device
    assert cache_state._buffer(device).device.type == "cuda"
