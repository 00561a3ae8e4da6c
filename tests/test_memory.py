"""Memory accounting: byte-exact model state, ledger invariants, and what each strategy holds."""

import pytest
from simtest import make_scenario

from sim.core.events import MemoryCategory
from sim.outputs.memory_curve import memory_curve
from sim.outputs.report import build_report
from sim.simulate import simulate
from sim.workload.model import PRESETS, n_params
from sim.workload.units import padded_numel

PHI_7B = 6_738_415_616
BIG = {"preset": "llama2-7b"}
SHORT = {"micro_batch": 1, "seq_len": 256}


def _persistent(result, prefix):
    return sum(
        m.delta_bytes for m in result.events.memory_of(0) if m.label.startswith(prefix) and m.delta_bytes > 0
    )


@pytest.mark.parametrize("k", [4, 8])
def test_full_shard_holds_16_bytes_per_param_over_k(k):
    """fp32 master params + fp32 grads + two fp32 AdamW states, bf16 compute, sharded K ways
    (llama2-7b's dims are divisible by 4 and 8, so FSDP2 adds no padding)."""
    r = simulate(
        make_scenario(
            model=BIG, training=SHORT, parallel={"world_size": k}, precision={"param_dtype": "bf16"}
        )
    )
    assert n_params(PRESETS["llama2-7b"]) == PHI_7B
    assert _persistent(r, "param:") == 4 * PHI_7B // k
    assert _persistent(r, "optim:") == 8 * PHI_7B // k
    assert _persistent(r, "sharded_grads") == 4 * PHI_7B // k
    report = build_report(r).to_json()
    assert report["model_state_bytes"] == 16 * PHI_7B // k
    assert report["model_state_bytes_deepspeed_convention"] == 16 * PHI_7B // k


def test_shard_grad_op_keeps_unsharded_bf16_params_through_backward():
    k = 4
    r = simulate(
        make_scenario(
            model=BIG,
            training=SHORT,
            parallel={"world_size": k, "strategy": "SHARD_GRAD_OP"},
            precision={"param_dtype": "bf16"},
        )
    )
    report = build_report(r).to_json()
    assert report["model_state_bytes"] == 16 * PHI_7B // k
    assert report["model_state_bytes_deepspeed_convention"] == 2 * PHI_7B + 14 * PHI_7B // k
    at_peak = report["memory_at_peak_bytes"]
    # every unit's unsharded bf16 parameters are alive together in backward
    assert at_peak["params"] >= 2 * PHI_7B + 4 * PHI_7B // k - 2 * 131_072_000 * 2


def test_ddp_holds_full_state_and_bucket_copy():
    r = simulate(make_scenario(model=BIG, training=SHORT, parallel={"world_size": 8, "strategy": "NO_SHARD"}))
    report = build_report(r).to_json()
    assert report["model_state_bytes"] == 16 * PHI_7B
    assert report["model_state_bytes_deepspeed_convention"] == 16 * PHI_7B
    assert _persistent(r, "params") == 4 * PHI_7B
    assert _persistent(r, "ddp_buckets") == 4 * PHI_7B  # gradient_as_bucket_view=False
    assert _persistent(r, "grads:") == 4 * PHI_7B


def test_hybrid_shard_state_divides_by_shard_group_only():
    r = simulate(
        make_scenario(
            model=BIG,
            training=SHORT,
            precision={"param_dtype": "bf16"},
            parallel={"world_size": 16, "strategy": "HYBRID_SHARD", "shard_group_size": 8},
        )
    )
    assert build_report(r).to_json()["model_state_bytes"] == 16 * PHI_7B // 8


def test_fsdp2_pads_dim0_to_the_shard_group():
    """tiny on 3 ranks: vocab 512 rows pad to 513, ffn 172 rows pad to 174, and so on."""
    k = 3
    r = simulate(make_scenario(parallel={"world_size": k}))
    from sim.workload.model import param_specs

    padded = sum(padded_numel(s, k) for s in param_specs(PRESETS["tiny"]))
    assert padded > n_params(PRESETS["tiny"])
    assert _persistent(r, "param:") == padded // k * 4
    assert build_report(r).to_json()["model_state_bytes"] == 16 * padded // k


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"])
@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_ledger_never_negative_and_step_returns_to_resident_state(strategy, ckpt):
    extra = {"shard_group_size": 2} if strategy == "HYBRID_SHARD" else {}
    r = simulate(
        make_scenario(
            parallel={"world_size": 4, "strategy": strategy, **extra},
            checkpointing={"mode": ckpt},
            training={"micro_batch": 2, "seq_len": 64, "grad_accum": 2},
            precision={"param_dtype": "bf16"},
        )
    )
    curve = memory_curve(r.events, 0)
    for category in MemoryCategory:
        assert curve.by_category[category].min() >= 0
    initial = sum(a.bytes for a in r.program.initial)
    assert int(curve.total[-1]) == initial  # every transient buffer was freed by the end
    assert build_report(r).to_json()["peak_memory_bytes"] == int(curve.total.max())


def test_checkpointed_7b_keeps_one_block_input_per_layer():
    """The seed's 34 GB: 32 layers x micro-batch 32 x seq 4096 x hidden 4096 x 2 B."""
    r = simulate(
        make_scenario(
            model=BIG,
            training={"micro_batch": 32, "seq_len": 4096},
            parallel={"world_size": 4},
            precision={"param_dtype": "bf16"},
            checkpointing={"mode": "full"},
        )
    )
    block_inputs = _persistent(r, "block_input")
    assert block_inputs == 32 * 32 * 4096 * 4096 * 2
    assert build_report(r).to_json()["memory_at_peak_bytes"]["activations"] >= block_inputs * 31 // 32
