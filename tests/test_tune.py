"""``fsdpsim tune``: the best configuration is the best simulated one that fits, pruning never drops a
configuration that fits (against brute force), a scenario where nothing fits gets a change that
fits when applied, output is deterministic and user mistakes exit 2."""

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from sim.errors import UserError
from sim.hardware.registry import load_profile
from sim.outputs.report import build_report
from sim.scenario.loader import load_scenario
from sim.simulate import build_step, simulate
from sim.study.tune.bounds import memory_lower_bound_bytes, step_time_lower_bound_s
from sim.study.tune.report import format_table, to_json
from sim.study.tune.search import SearchResult, Status, search
from sim.study.tune.space import apply, candidates, global_batch, per_rank_batch
from sim.study.tune.tuner import tune
from sim.workload.options import CheckpointMode, Strategy, WrapPolicy

ROOT = Path(__file__).resolve().parent.parent

# Four Llama-3-70B layers (5.5 B parameters, 128k vocabulary): model state, logits and activations
# all press on the 80 GB of an H100, while a step simulates in milliseconds.
SMALL = """# Question: a small space for the tuner tests
[model]
n_layers = 4
hidden = 8192
n_heads = 64
n_kv_heads = 8
ffn_hidden = 28672
vocab = 128256

[training]
micro_batch = 2
seq_len = 8192
grad_accum = 2

[parallel]
world_size = 16
strategy = "FULL_SHARD"

[precision]
param_dtype = "bf16"
reduce_dtype = "fp32"

[cluster]
profile = "h100-sxm"
gpus_per_node = 8
"""
NO_FIT = ["parallel.world_size=1", "training.grad_accum=1"]  # 88 GB of model state on one GPU
MARGIN = 0.1


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tune") / "small.toml"
    path.write_text(SMALL)
    return path


@cache
def searched(path: Path, prune: bool) -> tuple[SearchResult, float]:
    scenario = load_scenario(path)
    profile = load_profile(scenario.cluster.profile)
    limit = profile.device.memory_bytes * (1 - MARGIN)
    return search(scenario, profile, global_batch(scenario), limit, 5, prune=prune), limit


def fsdpsim(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "sim.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_space_keeps_the_global_batch_and_dedups(small: Path) -> None:
    scenario = load_scenario(small)
    cands = candidates(scenario, 64)
    assert all(c.micro_batch * c.grad_accum * 16 == 64 for c in cands)
    assert {c.micro_batch for c in cands} == {1, 2, 4}
    assert len(set(cands)) == len(cands) and cands == sorted(cands)
    ddp = [c for c in cands if c.strategy is Strategy.NO_SHARD]
    assert {(c.wrap, c.checkpointing, c.forward_prefetch) for c in ddp} == {
        (WrapPolicy.BLOCK, CheckpointMode.NONE, 0),
        (WrapPolicy.BLOCK, CheckpointMode.FULL, 0),  # DDP can checkpoint activations too
        (WrapPolicy.BLOCK, CheckpointMode.SELECTIVE, 0),  # fully or selectively
    }
    hybrid = [c for c in cands if c.strategy is Strategy.HYBRID_SHARD]
    assert hybrid and {c.shard_group_size for c in hybrid} == {8}  # the node size
    one_node = load_scenario(small, ["parallel.world_size=8"])
    assert not any(c.strategy is Strategy.HYBRID_SHARD for c in candidates(one_node, 8))
    with pytest.raises(UserError, match="multiple of parallel.world_size"):
        per_rank_batch(scenario, 24)


def test_bounds_never_exceed_the_simulation(small: Path) -> None:
    """The memory and step-time bounds are below the simulated peak and step for every candidate
    (the brute-force search simulates each one, its bounds computed from the same step as
    ``bound`` computes them; one candidate checked here against its own step and a fresh run)."""
    scenario = load_scenario(small)
    brute, _ = searched(small, False)
    assert {e.candidate for e in brute.evaluated if e.report is not None} == set(
        candidates(scenario, global_batch(scenario))
    )
    for e in brute.evaluated:
        assert e.report is not None
        assert e.memory_bound_bytes <= e.report.to_json()["peak_memory_bytes"], e.candidate
        assert e.time_bound_s <= e.step_time_s * (1 + 1e-12), e.candidate
    profile = load_profile(scenario.cluster.profile)
    first = brute.evaluated[0]
    s = apply(scenario, first.candidate)
    step, _, _ = build_step(s, profile)
    report = build_report(simulate(s, profile)).to_json()
    assert memory_lower_bound_bytes(step) == first.memory_bound_bytes <= report["peak_memory_bytes"]
    assert step_time_lower_bound_s(step) == first.time_bound_s
    assert report["step_time_s"] == first.step_time_s


def test_pruning_never_drops_a_fitting_point(small: Path) -> None:
    pruned, limit = searched(small, True)
    brute, _ = searched(small, False)
    truth = {e.candidate: e for e in brute.evaluated}
    assert all(e.report is not None for e in brute.evaluated)
    memory_pruned = [e for e in pruned.evaluated if e.status is Status.PRUNED_MEMORY]
    assert memory_pruned and pruned.count(Status.PRUNED_TIME) > 0  # both bounds do work here
    assert not any(truth[e.candidate].fits(limit) for e in memory_pruned)
    # a point pruned by the step-time bound is slower than the 5th best
    fifth = brute.top[-1].sort_key()
    for e in pruned.evaluated:
        if e.status is Status.PRUNED_TIME:
            assert truth[e.candidate].sort_key() > fifth
    assert [(e.candidate, e.step_time_s) for e in pruned.top] == [
        (e.candidate, e.step_time_s) for e in brute.top
    ]


def test_best_is_the_best_simulated_that_fits(small: Path) -> None:
    result, limit = searched(small, True)
    fitting = [e for e in result.evaluated if e.report is not None and e.required_bytes <= limit]
    # to the tuner's own tolerance: a prefetch variant equal to 1e-9 is listed once (same_but_prefetch)
    assert result.top[0].step_time_s == pytest.approx(min(e.step_time_s for e in fitting), rel=1e-9)
    steps = [e.step_time_s for e in result.top]
    assert steps == sorted(steps) and len(result.top) == 5
    assert all(e.fits(limit) for e in result.top)


def test_output_is_deterministic_and_explains(small: Path) -> None:
    first, second = tune(str(small)), tune(str(small))
    text = format_table(first)
    assert text == format_table(second)
    assert json.dumps(to_json(first)) == json.dumps(to_json(second))
    for fragment in (
        "pruned by the memory bound",
        "simulated",
        "CPU offload",
        "why",
        "exposed comm",
        "best per choice",
        "reproduce #1",
    ):
        assert fragment in text, fragment


def test_reproduce_command_gives_the_tuners_numbers(small: Path) -> None:
    data = to_json(tune(str(small), global_sequences=32))
    assert data["global_batch"] == 32
    best = data["top"][0]
    args = [a for s in best["overrides"] for a in ("--set", s)]
    proc = fsdpsim("run", small, *args, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["step_time_s"] == best["step_time_s"]
    assert report["peak_memory_bytes"] == best["peak_memory_bytes"] <= data["limit_bytes"]


def test_no_fit_gets_a_change_that_fits_when_applied(small: Path) -> None:
    proc = fsdpsim("tune", small, *(a for s in NO_FIT for a in ("--set", s)), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["fits"] is False and data["top"] == [] and data["counts"]["fit"] == 0
    assert data["closest"]["required_bytes"] > data["limit_bytes"]
    suggestion = data["suggestion"]
    # one GPU's 88 GB of model state: the cheapest fix is more ranks (before the recipe changes)
    ranks = re.fullmatch(r"(\d+)x the ranks \((\d+)\)", suggestion["change"])
    assert suggestion["fits"] and ranks is not None and ranks[1] == ranks[2]
    args = [a for s in [*NO_FIT, *suggestion["overrides"]] for a in ("--set", s)]
    applied = fsdpsim("run", small, *args, "--format", "json")
    assert applied.returncode == 0, applied.stderr
    report = json.loads(applied.stdout)
    assert report["world_size"] == int(ranks[2])
    assert report["peak_memory_bytes"] == suggestion["peak_memory_bytes"]
    required = report["peak_reserved_bytes"] + report["device_overhead_bytes"]
    assert required == suggestion["required_bytes"] <= data["limit_bytes"]
    # every change listed before the suggestion was shown not to fit
    listed = [c["change"] for c in data["changes"]]
    assert all(not c["fits"] for c in data["changes"][: listed.index(suggestion["change"])])


def test_no_fit_table_names_the_cheapest_fix(small: Path) -> None:
    result = tune(str(small), NO_FIT)
    text = format_table(result)
    change = to_json(result)["suggestion"]["change"]
    assert "NOTHING FITS" in text and f"cheapest fix  {change}" in text and "apply" in text


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--margin", "1.5"], "--margin"),
        (["--margin", "x"], "--margin"),
        (["--top", "0"], "--top"),
        (["--global-batch", "7"], "--global-batch 7"),
        (["--format", "xml"], "--format"),
        (["--set", "parallel.wrp=block"], "parallel.wrp"),
        (["--bogus"], "--bogus"),
    ],
)
def test_user_mistakes_exit_2(small: Path, args: list[str], fragment: str) -> None:
    proc = fsdpsim("tune", small, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdpsim: error: ") and fragment in lines[0], proc.stderr
    assert proc.stdout == ""


def test_missing_file_exits_2() -> None:
    proc = fsdpsim("tune", "no-such-file.toml")
    assert proc.returncode == 2 and "not found" in proc.stderr
