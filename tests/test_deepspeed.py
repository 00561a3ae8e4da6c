"""DeepSpeed ZeRO stages 1-3 (``sim.schedule.zero``, ``zero3``, ``zero3_trace``, ``zero_state``)
and ``--deepspeed`` configs. Where a test names a measured figure, it was read from a real
DeepSpeed 0.19.8 step on 2 gloo ranks here (counted at the c10d dispatcher), the same runs the
slow tests in ``test_validation.py`` repeat."""

import json
from pathlib import Path

import pytest
from simtest import make_profile, make_scenario

from sim.core.events import OpKind
from sim.errors import UserError
from sim.outputs.report import build_report
from sim.scenario.deepspeed_config import deepspeed_config, deepspeed_overrides
from sim.schedule.zero3_trace import segment_uses
from sim.schedule.zero_state import zero_state
from sim.simulate import build_step, scenario_profile, simulate
from sim.workload.model import n_params, preset

BF16 = {"param_dtype": "bf16"}


def _ds(stage: int, **zero: object) -> dict[str, object]:
    return {"enabled": True, "stage": stage, **zero}


def _collective_bytes(result, kind: OpKind) -> list[int]:
    return [o.bytes for o in result.program.ops if o.kind is kind]


def test_seed_7b_table_comes_out_of_the_zero_schedules() -> None:
    """The ZeRO paper's model states for 7B on 4 GPUs: ZeRO-2 2Φ + 14Φ/N, ZeRO-3 16Φ/N (the
    seeds' 38.5 GB and 28 GB at Φ = 7e9)."""
    phi = n_params(preset("llama2-7b"))
    for stage, expected in ((2, 2 * phi + 14 * phi // 4), (3, 16 * phi // 4)):
        s = make_scenario(
            model={"preset": "llama2-7b"},
            parallel={"world_size": 4},
            precision=BF16,
            deepspeed=_ds(stage, stage3_param_persistence_threshold=0),
        )
        step, _, _ = build_step(s, scenario_profile(s))
        assert zero_state(step).params + zero_state(step).grads + zero_state(step).optimizer == expected
    assert round((2 * 7e9 + 14 * 7e9 / 4) / 1e9, 1) == 38.5 and 16 * 7e9 / 4 / 1e9 == 28


@pytest.mark.parametrize("stage", [2, 3])
def test_model_state_with_the_step_fp32_gradient_equals_deepspeeds_estimator(stage: int) -> None:
    """DeepSpeed's estimators count 2Φ + 18Φ/N (ZeRO-2) and 18Φ/N + 4 B x the largest layer
    (ZeRO-3): the model state plus the fp32 gradient partition the step makes. For ZeRO-3 the
    estimator leaves out the 16-bit parameter partitions (2Φ/N), which a real DeepSpeed step
    does hold (the simulator's stage-3 peaks match real runs to 0.0 %, test_validation)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    model = preset("llama2-7b")
    s = make_scenario(
        model={"preset": "llama2-7b"},
        parallel={"world_size": 8},
        precision=BF16,
        deepspeed=_ds(stage, stage3_param_persistence_threshold=0),
    )
    step, _, _ = build_step(s, scenario_profile(s))
    z = zero_state(step)
    at_step = z.params + z.grads + z.optimizer + z.partition_numel * 4
    phi = n_params(model)
    if stage == 2:
        assert (
            at_step == estimate_zero2_model_states_mem_needs(phi, num_gpus_per_node=8, cpu_offload=False)[1]
        )
    else:
        largest = model.vocab * model.hidden
        _, gpu, largest_memory = estimate_zero3_model_states_mem_needs(
            phi, largest, num_gpus_per_node=8, cpu_offload=False
        )
        assert at_step == gpu - largest_memory + z.partition_numel * 2


def test_stage2_buckets_match_the_real_run() -> None:
    """reduce_bucket_size=20000 on the tiny model: each bucket all-reduced whole, oversized
    gradients alone (measured: 65536, 22144, 22016, 38528, 30336, 22016, 38528, 8320, 65536 B,
    then the 1-byte overflow flag and the 4-byte norm)."""
    s = make_scenario(precision=BF16, deepspeed=_ds(2, reduce_bucket_size=20000, overlap_comm=True))
    r = simulate(s, make_profile())
    assert _collective_bytes(r, OpKind.ALL_REDUCE) == [
        65536,
        22144,
        22016,
        38528,
        30336,
        22016,
        38528,
        8320,
        65536,
        1,
        4,
    ]
    assert _collective_bytes(r, OpKind.ALL_GATHER) == [312960]


def test_stage1_keeps_every_gradient_until_the_end_of_backward() -> None:
    r = simulate(make_scenario(precision=BF16, deepspeed=_ds(1, reduce_bucket_size=20000)), make_profile())
    ops = r.events.ops_of(0)
    last_backward = max(o.end_s for o in ops if o.kind is OpKind.BACKWARD)
    assert all(o.start_s >= last_backward for o in ops if o.kind is OpKind.ALL_REDUCE)
    assert sum(_collective_bytes(r, OpKind.ALL_REDUCE)) == 312960 + 1 + 4


def test_stage3_module_calls_follow_deepspeeds_order() -> None:
    """The 63 ``fetch_sub_module`` calls a real DeepSpeed step makes on the tiny Llama."""
    s = make_scenario(precision=BF16, deepspeed=_ds(3))
    step, _, _ = build_step(s, scenario_profile(s))
    calls = [(u.phase.value, c.module) for u in segment_uses(step) for c in u.calls]
    layer = [
        "input_layernorm",
        "self_attn",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "post_attention_layernorm",
        "mlp",
        "mlp.gate_proj",
        "mlp.act_fn",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    back = ["mlp", "mlp.down_proj", "mlp.up_proj", "mlp.act_fn", "mlp.gate_proj", "post_attention_layernorm"]
    back += ["self_attn", "self_attn.o_proj", "self_attn.v_proj", "self_attn.k_proj", "self_attn.q_proj"]
    back += ["input_layernorm"]
    forward = ["", "model", "model.embed_tokens", "model.rotary_emb"]
    for i in range(2):
        forward += [f"model.layers.{i}"] + [f"model.layers.{i}.{m}" for m in layer]
    forward += ["model.norm", "lm_head"]
    backward = ["", "lm_head", "model", "model.norm"]
    for i in (1, 0):
        backward += [f"model.layers.{i}"] + [f"model.layers.{i}.{m}" for m in back]
    backward += ["model.embed_tokens"]
    assert calls == [("forward", m) for m in forward] + [("backward", m) for m in backward]


def test_stage3_fetches_prefetches_and_reduces_like_the_real_run() -> None:
    """Persistence 100, reuse distance 0, prefetch 5000, bucket 50000 (measured: 20 all-gathers of
    403,072 B in all, reduce-scatters of 87,680 / 90,880 / 68,864 / 65,536 B, one 8-byte all-reduce)."""
    zero = _ds(
        3,
        stage3_param_persistence_threshold=100,
        stage3_max_reuse_distance=0,
        stage3_prefetch_bucket_size=5000,
        reduce_bucket_size=50000,
    )
    r = simulate(make_scenario(precision=BF16, deepspeed=zero), make_profile())
    gathers = _collective_bytes(r, OpKind.ALL_GATHER)
    assert (len(gathers), sum(gathers)) == (20, 403072)
    assert _collective_bytes(r, OpKind.REDUCE_SCATTER) == [87680, 90880, 68864, 65536]
    assert _collective_bytes(r, OpKind.ALL_REDUCE) == [8]


def test_stage3_default_prefetch_gathers_everything_at_the_first_call() -> None:
    """With every parameter below the default prefetch bucket, the root module's call prefetches
    them all in one all-gather (measured: 312,320 B), then the 5 persistent norms are gathered
    one by one after the step."""
    r = simulate(
        make_scenario(precision=BF16, deepspeed=_ds(3, stage3_param_persistence_threshold=100)),
        make_profile(),
    )
    assert _collective_bytes(r, OpKind.ALL_GATHER) == [312320] + [128] * 5


def test_deepspeed_config_round_trip_and_refusals(tmp_path: Path) -> None:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "train_batch_size": 16,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        "scheduler": {"type": "WarmupLR"},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e6},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    overrides, no_effect = deepspeed_overrides(path)
    assert set(no_effect) == {"scheduler", "optimizer.params.lr"}
    s = make_scenario()
    from sim.scenario.loader import scenario_from_dict

    s = scenario_from_dict({"model": {"preset": "tiny"}, "parallel": {"world_size": 2}}, "t", overrides)
    assert (s.deepspeed.stage, s.deepspeed.reduce_bucket_size, s.training.grad_accum) == (3, 50_000_000, 4)
    written = deepspeed_config(s)
    assert written["zero_optimization"]["stage3_prefetch_bucket_size"] == 5_000_000 and written["bf16"]
    for bad, message in (
        (
            {"zero_optimization": {"stage": 2, "bogus": 1}},
            "unknown or unsupported field zero_optimization.bogus",
        ),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, '"auto"'),
        ({"zero_optimization": {"stage": 2}, "pipeline": {}}, "unknown or unsupported field pipeline"),
        ({"zero_optimization": {"stage": 2, "use_multi_rank_bucket_allreduce": False}}, "not modelled"),
        ({"bf16": {"enabled": True}}, "zero_optimization.stage is missing"),
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(UserError, match=message):
            deepspeed_overrides(path)


def test_train_batch_size_must_match_the_ranks() -> None:
    with pytest.raises(UserError, match="train_batch_size = 7"):
        make_scenario(deepspeed={**_ds(2), "train_batch_size": 7})


def test_report_names_the_system() -> None:
    r = build_report(simulate(make_scenario(precision=BF16, deepspeed=_ds(2)), make_profile()))
    assert (r.system, r.strategy) == ("DeepSpeed ZeRO-2", "ZeRO-2")
    assert (
        build_report(simulate(make_scenario(parallel={"fsdp_version": 1}), make_profile())).system == "FSDP1"
    )


def test_stage3_recomputes_a_checkpointed_layer_inside_its_backward() -> None:
    """Measured with checkpointing: 93 calls; a layer's recomputation follows the backward calls of
    its wrapper, the layer, its MLP and ``down_proj``."""
    s = make_scenario(precision=BF16, deepspeed=_ds(3), checkpointing={"mode": "full"})
    step, _, _ = build_step(s, scenario_profile(s))
    calls = [(u.phase.value, c.module) for u in segment_uses(step) for c in u.calls]
    assert len(calls) == 93
    start = calls.index(("backward", "model.layers.1.mlp.down_proj"))
    assert calls[start - 3 : start + 3] == [
        ("backward", "model.layers.1"),
        ("backward", "model.layers.1"),
        ("backward", "model.layers.1.mlp"),
        ("backward", "model.layers.1.mlp.down_proj"),
        ("recompute", "model.layers.1"),
        ("recompute", "model.layers.1.input_layernorm"),
    ]


@pytest.mark.parametrize(("config", "stage"), [("zero2.json", 2), ("zero3.json", 3)])
def test_seed_configs_run_through_the_cli(
    config: str, stage: int, capsys: pytest.CaptureFixture[str]
) -> None:
    from sim.cli.main import main

    root = Path(__file__).resolve().parents[1]
    code = main(
        [
            "run",
            str(root / "scenarios/llama2-7b-8xh100-zero3.toml"),
            "--deepspeed",
            str(root / "scenarios/deepspeed" / config),
            "--format",
            "json",
        ]
    )
    out = capsys.readouterr()
    assert code == 0 and "no effect on one step" in out.err
    report = json.loads(out.out)
    phi = n_params(preset("llama2-7b"))
    assert report["system"] == f"DeepSpeed ZeRO-{stage}"
    expected = 2 * phi + 14 * phi // 8 if stage == 2 else None
    if expected is not None:
        assert report["model_state_bytes"] == expected
