"""The what-if scenario library: each file runs through ``fsdpsim run --format json`` (the CLI's own
``main``, in this process: its described models' measurements then share one fork server, where a
subprocess per run would start one each; ``tests/test_cli.py`` runs every scenario file in a
subprocess, as a user would), and its answer (the figures in the README) is checked as relations
and ranges."""

import contextlib
import io
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from sim.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = (
    "sft-vs-grpo-7b.toml",
    "grpo-7b.toml",
    "packing-vs-padding-7b.toml",
    "wrap-granularity-llama2-7b.toml",
    "scaleout-llama3-70b.toml",
    "slow-rank-7b.toml",
    "seed-t5-fsdp1.toml",
    "sweep-systems-7b.toml",
    "moe-expert-parallel-mixtral.toml",
)
GB = 1e9


@cache
def run(name: str, *sets: str) -> dict:
    """The JSON report of ``fsdpsim run scenarios/NAME --set ...`` (cached: each variant runs once)."""
    args = [a for s in sets for a in ("--set", s)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", f"scenarios/{name}", *args, "--format", "json"])
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


@pytest.mark.parametrize("name", LIBRARY)
def test_file_states_its_question_and_runs(name: str) -> None:
    text = (ROOT / "scenarios" / name).read_text()
    assert text.startswith("# Question: ")
    report = run(name)
    assert report["fits"] and report["step_time_s"] > 0


def test_grpo_costs_eight_times_the_time_and_twice_the_activations() -> None:
    sft, grpo = run("sft-vs-grpo-7b.toml"), run("grpo-7b.toml")
    assert grpo["tokens_per_step"] == 8 * sft["tokens_per_step"]  # G = 8 responses per prompt
    # 8x the sequences: a little under 8x the time (the optimizer step is paid once)
    assert 7.0 < grpo["step_time_s"] / sft["step_time_s"] < 8.0
    ratio = grpo["memory_at_peak_bytes"]["activations"] / sft["memory_at_peak_bytes"]["activations"]
    assert ratio == pytest.approx(2.0, rel=0.01)  # micro-batch x 2
    assert grpo["peak_memory_bytes"] > sft["peak_memory_bytes"] + 20 * GB


def test_packing_beats_padding_in_useful_tokens_per_second() -> None:
    padded = run("packing-vs-padding-7b.toml")
    packed = run("packing-vs-padding-7b.toml", "training.micro_batch=1", "training.avg_seq_len=2048")
    assert (
        padded["padding"]["real_token_fraction"] == 0.25 and packed["padding"]["real_token_fraction"] == 1.0
    )
    assert packed["tokens_per_step"] == padded["tokens_per_step"]  # same real tokens per step
    assert packed["tokens_per_s"] > 3 * padded["tokens_per_s"]
    assert packed["peak_memory_bytes"] < 0.5 * padded["peak_memory_bytes"]


def test_wrap_granularity_sets_the_number_of_collectives() -> None:
    model, block, linear = (
        run("wrap-granularity-llama2-7b.toml", f"parallel.wrap={w}") for w in ("model", "block", "linear")
    )

    def counts(r: dict) -> tuple[int, int]:
        return int(r["collectives"]["all_gather"]["count"]), int(r["collectives"]["reduce_scatter"]["count"])

    layers, linears = 32, 32 * 7 + 2  # q, k, v, o, gate, up, down per layer + embedding + lm_head
    # a non-root unit is gathered in forward and backward and reduce-scattered once; the root once each
    assert counts(model) == (1, 1)
    assert counts(block) == (2 * layers + 1, layers + 1)
    assert counts(linear) == (2 * linears + 1, linears + 1)
    exposed = {
        w: r["breakdown_s"]["exposed_comm"]
        for w, r in (("model", model), ("block", block), ("linear", linear))
    }
    assert exposed["model"] > 10 * exposed["block"] > exposed["linear"]  # one unit cannot overlap
    assert model["peak_memory_bytes"] > block["peak_memory_bytes"] + 20 * GB > linear["peak_memory_bytes"]


def test_scale_out_keeps_per_gpu_throughput_and_hsdp_in_a_node_does_not_fit() -> None:
    base = run("scaleout-llama3-70b.toml")
    full = run("scaleout-llama3-70b.toml", "parallel.world_size=1024")
    hybrid = run("scaleout-llama3-70b.toml", "parallel.world_size=1024", "parallel.strategy=HYBRID_SHARD")
    hybrid64 = run(
        "scaleout-llama3-70b.toml",
        "parallel.world_size=1024",
        "parallel.strategy=HYBRID_SHARD",
        "parallel.shard_group_size=64",
    )
    assert full["ranks_simulated"] == 1  # no jitter: identical ranks simulated once
    # weak scaling: FULL_SHARD keeps its per-GPU throughput within 2 % from 64 to 1,024 ranks
    assert full["tokens_per_s_per_gpu"] == pytest.approx(base["tokens_per_s_per_gpu"], rel=0.02)
    # 8-way sharding leaves 141 GB of model state per GPU: it does not fit
    assert not hybrid["fits"] and hybrid["model_state_bytes"] > 140 * GB
    # HSDP adds a replicate all-reduce per unit; sharding over 64 ranks it fits, within 2 %
    assert hybrid64["fits"] and hybrid64["collectives"]["all_reduce"]["count"] == 81
    assert hybrid64["step_time_s"] == pytest.approx(full["step_time_s"], rel=0.02)


def test_the_slow_rank_slows_everyone() -> None:
    slow = run("slow-rank-7b.toml")
    healthy = run("slow-rank-7b.toml", "simulation.slow_rank_factor=1.0")
    assert slow["ranks_simulated"] == 8
    assert 1.05 < slow["step_time_s"] / healthy["step_time_s"] <= 1.10
    ranks = {r["rank"]: r for r in slow["per_rank"]}
    for rank, r in ranks.items():
        waiting = r["breakdown_s"]["idle"] + r["breakdown_s"]["exposed_comm"]
        if rank != 3:  # the fast ranks wait for rank 3 inside every collective
            assert waiting > 5 * (healthy["breakdown_s"]["idle"] + healthy["breakdown_s"]["exposed_comm"])


def test_avg_seq_len_counts_real_tokens_and_is_checked() -> None:
    padded = run("packing-vs-padding-7b.toml")
    full = run("packing-vs-padding-7b.toml", "training.avg_seq_len=2048")
    # the padding is computed all the same, and the collator's mask makes SDPA's attention
    # memory-efficient over every pair (tests/test_padding_mask.py): slower, and more memory
    assert padded["step_time_s"] > full["step_time_s"]
    assert padded["peak_memory_bytes"] > full["peak_memory_bytes"] and padded["mfu"] < full["mfu"]
    real = padded["tokens_per_step"] / padded["step_time_s"]  # tokens per step count real tokens
    assert padded["tokens_per_s"] == pytest.approx(real, rel=1e-12)
    assert padded["tokens_per_step"] == full["tokens_per_step"] / 4
    assert "note" in padded["padding"]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    for bad in ("training.avg_seq_len=4096", "training.avg_seq_len=0"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "sim.cli.main",
                "run",
                "scenarios/packing-vs-padding-7b.toml",
                "--set",
                bad,
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=60,
        )
        assert proc.returncode == 2 and "training.avg_seq_len" in proc.stderr, proc.stderr


def test_t5_under_fsdp1_gathers_each_flat_parameter_once() -> None:
    """SHARD_GRAD_OP keeps the 24 T5Blocks (12 encoder, 12 decoder) gathered from forward to
    backward: one all-gather and one reduce-scatter per flat parameter (and the root), all in bf16."""
    r = run("seed-t5-fsdp1.toml")
    assert r["system"] == "FSDP1" and r["n_params"] == 222_903_552  # the real t5-base
    assert r["collectives"]["all_gather"]["count"] == r["collectives"]["reduce_scatter"]["count"] == 25
    assert r["collectives"]["all_gather"]["bytes"] == 2 * r["n_params"]  # padded to 4 ranks: divisible
    full = run("seed-t5-fsdp1.toml", "parallel.strategy=FULL_SHARD")
    assert (
        full["collectives"]["all_gather"]["count"] == 49
        and full["peak_memory_bytes"] < r["peak_memory_bytes"]
    )


def test_one_sweep_compares_fsdp2_fsdp1_zero2_zero3() -> None:
    points = [
        run(
            "sweep-systems-7b.toml",
            f"parallel.fsdp_version={v}",
            f"deepspeed.enabled={e}",
            f"deepspeed.stage={st}",
        )
        for v, e, st in ((2, "false", 2), (1, "false", 2), (2, "true", 2), (2, "true", 3))
    ]
    assert [p["system"] for p in points] == ["FSDP2", "FSDP1", "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3"]
    fsdp2, fsdp1, zero2, zero3 = points
    # ZeRO-2 keeps the bf16 parameters whole: the largest peak; FSDP1 skips FSDP2's copy-out
    assert zero2["peak_memory_bytes"] > max(p["peak_memory_bytes"] for p in (fsdp2, fsdp1, zero3))
    assert fsdp1["step_time_s"] < fsdp2["step_time_s"]
    # the FSDPs fit on the H100s; ZeRO-3 holds less allocated than ZeRO-2, but its partition-sized
    # buffers fragment the caching allocator more (its reserved lands within 0.3 GiB of the device)
    assert fsdp2["fits"] and fsdp1["fits"]
    frag = {
        name: p["peak_reserved_bytes"] - p["peak_memory_bytes"] for name, p in (("z2", zero2), ("z3", zero3))
    }
    assert frag["z3"] > frag["z2"]


def test_lora_on_one_rtx_3090_fits_to_4096_tokens_with_checkpointing() -> None:
    """scenarios/lora-qwen2.5-7b-1x3090.toml: LoRA of Qwen2.5-7B fits one 24 GB card with every
    block checkpointed at 2,048 tokens per micro-batch (the bf16 base is 14 GiB; the loss's fp32
    logits grow with the tokens); at 4,096 its allocated peak fits but the loss's three 2.3 GiB fp32
    tensors of its backward fragment the caching allocator's segments past the card, which
    ``expandable_segments`` avoids; not without checkpointing, not at 8,192."""
    name = "lora-qwen2.5-7b-1x3090.toml"
    assert (ROOT / "scenarios" / name).read_text().startswith("# Question: ")
    base, longer, whole = run(name), run(name, "training.seq_len=4096"), run(name, "training.seq_len=8192")
    expandable = run(name, "training.seq_len=4096", "cluster.expandable_segments=true")
    assert base["fits"] and not longer["fits"] and expandable["fits"] and not whole["fits"]
    device, outside = longer["device_memory_bytes"], longer["device_overhead_bytes"]
    assert longer["peak_memory_bytes"] + outside < device < longer["peak_reserved_bytes"] + outside
    assert not run(name, "checkpointing.mode=none")["fits"]
    state = base["model_state_breakdown_bytes"]
    assert state["grads"] < 0.02 * state["params"]  # gradients and AdamW state for the adapters only
    assert longer["peak_memory_bytes"] > base["peak_memory_bytes"]


def _recipe_gathers(report: dict) -> int:
    """FSDP-QLoRA's all-gathers: 80 blocks with 12 adapter units each (lora_A and lora_B of six
    targets) under PEFT's wrap policy; each block in forward and again in backward, each adapter
    also in the checkpointed block's recompute, the root once."""
    return 80 * 2 + 80 * 12 * 3 + 1


def test_qlora_70b_on_two_rtx_3090s_needs_the_recipes_cpu_offload() -> None:
    """scenarios/qlora-llama2-70b-2x3090.toml: the 4-bit base sharded over two cards is about 17 GiB
    a card, but with the rank-64 adapters' fp32 AdamW state it does not fit 24 GB without the
    recipe's CPU offload (its sibling with the offload, below); the packed all-gathers over PCIe
    mostly hide behind compute, the adapters' small ones (no forward prefetch in FSDP1) do not."""
    name = "qlora-llama2-70b-2x3090.toml"
    assert (ROOT / "scenarios" / name).read_text().startswith("# Question: ")
    report = run(name)
    assert not report["fits"]
    assert 68e9 < report["n_params"] < 71e9  # counted as transformers counts them, not packed
    gathered = report["collectives"]["all_gather"]
    assert gathered["count"] == _recipe_gathers(report)
    assert report["breakdown_s"]["exposed_comm"] < 0.15 * report["step_time_s"]


def test_qlora_70b_on_two_rtx_3090s_fits_with_the_recipes_cpu_offload() -> None:
    """scenarios/qlora-llama2-70b-2x3090-offload.toml: the recipe as published. FSDP1's
    CPUOffload keeps every flat-parameter shard (the packed base, the adapters) and the adapters'
    fp32 gradients and AdamW state on the host: the card holds a few GiB; every all-gather's shard
    crosses PCIe first, the adapters' gradient shards come back, and torch's AdamW steps them on
    the CPU."""
    name = "qlora-llama2-70b-2x3090-offload.toml"
    assert (ROOT / "scenarios" / name).read_text().startswith("# Question: ")
    report, without = run(name), run("qlora-llama2-70b-2x3090.toml")
    assert report["fits"] and report["peak_memory_bytes"] < 0.3 * without["peak_memory_bytes"]
    assert report["model_state_breakdown_bytes"]["optimizer"] == 0
    gathered = report["collectives"]["all_gather"]
    assert gathered["count"] == _recipe_gathers(report)
    # what is gathered crossed PCIe first as this rank's shard, half of it on two ranks, each in
    # its own dtype (no MixedPrecision: the adapters gather in fp32 as they are stored)
    assert report["offload_bytes"]["h2d"] == gathered["bytes"] // 2
    assert report["host_memory_bytes"] > 15 * 2**30  # half the packed 4-bit base and the adapters' state
    assert report["breakdown_s"]["idle"] > 0.1 * report["step_time_s"]  # the CPU optimizer step


def test_one_sweep_answers_offload_or_add_a_node() -> None:
    """scenarios/sweep-offload-7b.toml: Llama-2-7B does not fit two H100s under FSDP2; every offload
    fits and is slower than a second node (the optimizer on the CPU)."""
    name = "sweep-offload-7b.toml"
    assert (ROOT / "scenarios" / name).read_text().startswith("# Question: ")
    base = run(name)
    offload = run(name, "parallel.cpu_offload=true")
    zero3 = run(name, "deepspeed.enabled=true", "deepspeed.stage=3", 'deepspeed.offload_optimizer="cpu"')
    node = run(name, "parallel.world_size=4")
    assert not base["fits"] and offload["fits"] and zero3["fits"] and node["fits"]
    assert offload["model_state_bytes"] == 0 and offload["host_memory_bytes"] == zero3["host_memory_bytes"]
    assert node["step_time_s"] < zero3["step_time_s"] < offload["step_time_s"]


def test_expert_parallelism_fits_mixtral_on_two_nodes_where_plain_fsdp2_does_not() -> None:
    """scenarios/moe-expert-parallel-mixtral.toml: plain FSDP2 pads the 8 experts' dim 0 to the 16
    ranks and all-gathers every expert across both nodes; with EP 8 each GPU gathers its one
    expert from the GPU holding it on the other node and exchanges tokens over NVLink."""
    name = "moe-expert-parallel-mixtral.toml"
    ep, plain = run(name), run(name, "parallel.expert_parallel=1")
    assert ep["fits"] and not plain["fits"]
    assert ep["step_time_s"] < 0.5 * plain["step_time_s"]
    assert ep["collectives"]["all_to_all"]["count"] == 4 * 32  # 2 forward + 2 backward per layer
    assert "all_to_all" not in plain["collectives"]
    assert ep["collectives"]["all_gather"]["bytes"] < 0.1 * plain["collectives"]["all_gather"]["bytes"]
