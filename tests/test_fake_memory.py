"""Fake-mode FSDP2 memory (validation.fake_memory) against real 2-process gloo runs and exact formulas.

One module fixture starts the real runs (``validation.worker``, 2 processes each: tiny as it is,
with GQA, and a variant without GQA and with activation checkpointing) and the fake-mode children
at once, so the file takes about as long as the real runs (~60 s on 2 cores).
"""

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from calibrate.launch import free_port
from sim.errors import UserError
from sim.scenario.loader import load_scenario
from sim.workload.model import param_specs
from validation.fake_memory import measure_fake_memory
from validation.fake_memory_child import measure_fake_memory_subprocess
from validation.fake_mode_patches import one_sequence_per_row
from validation.tracker_categories import CATEGORIES

pytestmark = pytest.mark.slow  # real torch.distributed processes

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "scenarios" / "tiny.toml")
TIMEOUT_S = 180.0
FP32_BYTES = 4  # master parameters and AdamW state (and AdamW's scalar step) are fp32
WORLD_SIZES = (2, 8, 64)
# a second real run: no GQA (tiny has 4 heads, 2 KV heads) and checkpointed blocks
VARIANT = ["model.n_kv_heads=4", 'checkpointing.mode="full"']


def _start_real_run(out_dir: Path, overrides: list[str]) -> list[subprocess.Popen]:
    """``python -m validation.worker SPEC.json`` as ranks 0 and 1 of a gloo group (tiny, world size 2)."""
    spec = {"scenario": TINY, "overrides": overrides, "warmup": 1, "steps": 1, "out_dir": str(out_dir)}
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "validation.worker", str(spec_path)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    out_dir, variant_dir = tmp_path_factory.mktemp("real"), tmp_path_factory.mktemp("real_variant")
    procs = _start_real_run(out_dir, []) + _start_real_run(variant_dir, VARIANT)
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures: dict[Any, Any] = {
                k: pool.submit(measure_fake_memory_subprocess, TINY, [f"parallel.world_size={k}"], TIMEOUT_S)
                for k in WORLD_SIZES
            }
            futures["variant"] = pool.submit(measure_fake_memory_subprocess, TINY, VARIANT, TIMEOUT_S)
            fake = {k: f.result() for k, f in futures.items()}
        for p in procs:
            _, err = p.communicate(timeout=TIMEOUT_S)
            assert p.returncode == 0, err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    real = json.loads((out_dir / "rank0.json").read_text())["memory_peak"]
    real_variant = json.loads((variant_dir / "rank0.json").read_text())["memory_peak"]
    return {"real": real, "real_variant": real_variant, **fake}


def _assert_matches(fake: dict[str, Any], real: dict[str, Any]) -> None:
    assert fake["world_size"] == 2
    assert abs(fake["total"] - real["total"]) <= 0.01 * real["total"]
    for category in CATEGORIES:  # same breakdown, to 1 % of the peak
        assert abs(fake[category] - real.get(category, 0)) <= 0.01 * real["total"], category
    assert sum(fake[c] for c in CATEGORIES) == fake["total"]
    # the real run's attention path: SDPA with is_causal and no mask (no mask, no K/V copies for GQA)
    assert fake["kernels"]["attention_mask"] == ["is_causal"]


def test_fake_world_size_2_matches_the_real_gloo_run(runs: dict[Any, Any]) -> None:
    _assert_matches(runs[2], runs["real"])


def test_fake_matches_the_real_run_without_gqa_and_with_checkpointing(runs: dict[Any, Any]) -> None:
    _assert_matches(runs["variant"], runs["real_variant"])
    assert runs["variant"]["activations"] < runs[2]["activations"]  # checkpointing took effect


def _sharded_param_bytes(k: int) -> int:
    """FSDP2 pads dim 0 of each parameter to a multiple of K; each rank holds ceil(dim0 / K) rows."""
    model = load_scenario(TINY).model
    return sum(math.ceil(s.shape[0] / k) * s.numel // s.shape[0] * FP32_BYTES for s in param_specs(model))


@pytest.mark.parametrize("k", WORLD_SIZES)
def test_sharded_params_and_optimizer_state_are_exact(runs: dict[Any, Any], k: int) -> None:
    raw = runs[k]["raw"]
    sharded = _sharded_param_bytes(k)
    assert raw["Sharded Param"] == sharded
    n_tensors = len(param_specs(load_scenario(TINY).model))
    # exp_avg and exp_avg_sq like the shard, plus AdamW's fp32 scalar `step` per parameter
    assert raw["OptState"] == 2 * sharded + n_tensors * FP32_BYTES


def test_world_sizes_that_do_not_exist_here(runs: dict[Any, Any]) -> None:
    r64, r8 = runs[64], runs[8]
    assert r64["world_size"] == 64 and r64["total"] > 0
    assert r64["raw"]["Sharded Param"] < r8["raw"]["Sharded Param"]
    assert r64["activations"] == r8["activations"]  # activations do not depend on the world size
    assert r64["kernels"]["attention_kernel"] == "flash"  # CPU flash attention ran
    assert "scaled_dot_product_flash_attention_for_cpu" in " ".join(r64["kernels"]["attention"])


def test_one_sequence_per_row_answers_fake_positions_only() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    packed = torch.tensor([[0, 1, 0, 1]])  # two packed sequences: real values are still read
    with one_sequence_per_row(nn.Identity()):
        assert masking_utils.find_packed_sequence_indices(packed) is not None
        assert masking_utils.find_packed_sequence_indices(torch.arange(4)[None]) is None
        with FakeTensorMode():
            assert masking_utils.find_packed_sequence_indices(torch.arange(4)[None]) is None
    assert masking_utils.find_packed_sequence_indices is original
    with FakeTensorMode():  # transformers' own answer for fake positions: a (fake) packing mask
        assert original(torch.arange(4)[None]) is not None


class _Model(nn.Module):
    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return input_ids


def test_one_sequence_per_row_refuses_positions_and_masks_it_cannot_read() -> None:
    model = _Model()
    ids = torch.zeros(1, 4, dtype=torch.long)
    with one_sequence_per_row(model):
        model(input_ids=ids, position_ids=None, attention_mask=None)
        with pytest.raises(UserError, match="position_ids"):
            model(input_ids=ids, position_ids=torch.arange(4)[None])
        with pytest.raises(UserError, match="attention_mask"):
            model(input_ids=ids, attention_mask=torch.ones(1, 4))
    model(input_ids=ids, position_ids=torch.arange(4)[None])  # the hook is gone on exit


def test_no_shard_is_refused() -> None:
    scenario = load_scenario(TINY, ['parallel.strategy="NO_SHARD"'])
    with pytest.raises(UserError, match="NO_SHARD is not supported in fake mode"):
        measure_fake_memory(scenario)


def test_a_failing_child_raises_user_error() -> None:
    with pytest.raises(UserError, match="failed"):
        measure_fake_memory_subprocess(TINY, ["parallel.world_size=0"], TIMEOUT_S)


def test_a_timed_out_child_raises_user_error() -> None:
    with pytest.raises(UserError, match="timed out"):
        measure_fake_memory_subprocess(TINY, [], timeout_s=0.2)
