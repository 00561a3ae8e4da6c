"""``training.max_grad_norm``: clip_grad_norm_ before the optimizer step, as torchtitan and HF's
Trainer run it: the norms read every gradient element a rank holds, a sharded norm is all-reduced
over the shard group, the scale reads and writes every element; then the optimizer steps."""

import pytest
from simtest import make_profile, make_scenario

from sim.core.events import OpKind
from sim.errors import UserError
from sim.outputs.report import build_report
from sim.schedule.model_state import numel_per_rank
from sim.simulate import build_step, simulate
from sim.workload.model import param_specs

TWO_LAYERS = {"preset": "tiny", "n_layers": 2}
NORMS, SCALE, TOTAL = "clip_grad_norm_ norms", "clip_grad_norm_ scale", "all_reduce gradient norm"


def _ops(result, rank=0):
    return sorted(result.events.ops_of(rank), key=lambda o: (o.start_s, o.op_id))


def _step(parallel: dict | None = None, max_grad_norm: float = 1.0):
    scenario = make_scenario(
        model=TWO_LAYERS,
        training={"micro_batch": 2, "seq_len": 64, "max_grad_norm": max_grad_norm},
        **({"parallel": parallel} if parallel else {}),
    )
    profile = make_profile()
    return scenario, profile, simulate(scenario, profile)


@pytest.mark.parametrize(
    "parallel",
    [None, {"world_size": 8, "strategy": "SHARD_GRAD_OP"}, {"world_size": 8, "fsdp_version": 1}],
    ids=["fsdp2-full-shard", "fsdp2-shard-grad-op", "fsdp1-full-shard"],
)
def test_the_norms_are_all_reduced_then_the_gradients_scaled_before_the_step(parallel) -> None:
    scenario, profile, result = _step(parallel)
    ops = _ops(result)
    names = [o.name for o in ops]
    norms, total, scale = (next(o for o in ops if o.name == n) for n in (NORMS, TOTAL, SCALE))
    step = next(o for o in ops if o.kind is OpKind.OPTIMIZER)
    # the order the training loop runs them in, each waiting for the one before
    assert norms.end_s <= total.start_s and total.end_s <= scale.start_s and scale.end_s <= step.start_s
    # FSDP1 all-reduces its one fp32 total; FSDP2's DTensor gradients their stacked per-parameter
    # norms, one fp32 each (a real 2-rank gloo step of llama-5m: 156 B for its 39 parameters)
    per_parameter = (parallel or {}).get("fsdp_version", 2) == 2
    assert names.count(TOTAL) == 1
    assert total.bytes == 4 * (len(param_specs(scenario.model)) if per_parameter else 1)
    # every reduce-scatter is done before the norms read the reduced gradients
    last_reduction = max(o.end_s for o in ops if o.kind is OpKind.REDUCE_SCATTER)
    assert norms.start_s >= last_reduction
    cfg = build_step(scenario, profile)[0]
    grad_bytes = numel_per_rank(cfg) * cfg.master_bytes
    # the norms read the gradients once; the scale reads and writes them
    assert norms.end_s - norms.start_s == pytest.approx(cfg.costs.copy_s(grad_bytes) / 2)
    assert scale.end_s - scale.start_s == pytest.approx(cfg.costs.copy_s(grad_bytes))


def test_clipping_lengthens_the_step_by_at_least_its_two_passes() -> None:
    *_, clipped = _step()
    *_, unclipped = _step(max_grad_norm=0.0)
    assert not any(o.name in (NORMS, SCALE, TOTAL) for o in _ops(unclipped))
    passes = sum(o.end_s - o.start_s for o in _ops(clipped) if o.name in (NORMS, SCALE))
    assert passes > 0
    assert build_report(clipped).step_time_s >= build_report(unclipped).step_time_s + passes * (1 - 1e-9)


def test_ddp_clips_whole_gradients_without_a_collective() -> None:
    _, _, result = _step({"world_size": 8, "strategy": "NO_SHARD"})
    names = [o.name for o in _ops(result)]
    assert NORMS in names and SCALE in names and TOTAL not in names


def test_deepspeed_clips_inside_its_own_step() -> None:
    """ZeRO's step already all-reduces the overflow flag and the norm: no second clipping."""
    scenario = make_scenario(
        model=TWO_LAYERS,
        training={"micro_batch": 2, "seq_len": 64, "max_grad_norm": 1.0},
        deepspeed={"enabled": True, "stage": 3},
    )
    names = [o.name for o in _ops(simulate(scenario, make_profile()))]
    assert NORMS not in names and "all_reduce overflow flag and gradient norm" in names


@pytest.mark.parametrize(
    "sections, message",
    [
        (
            {"training": {"max_grad_norm": -1.0}},
            "training.max_grad_norm must be >= 0 (0: no clipping), got -1.0",
        ),
        (
            {"training": {"max_grad_norm": 1.0}, "parallel": {"cpu_offload": True}},
            "training.max_grad_norm with CPU offload",
        ),
        ({"training": {"max_grad_norm": "one"}}, "training.max_grad_norm"),
    ],
)
def test_bad_max_grad_norm_is_one_clear_error(sections, message) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_scenario(model=TWO_LAYERS, **sections)


def test_a_grad_scaler_unscales_before_the_clip_reads_the_gradients() -> None:
    """HF's and torch's AMP recipe: ``scaler.unscale_(optimizer)``, then ``clip_grad_norm_``; the
    found-inf flag is all-reduced (one fp32) over the shard group before the norms read."""
    scenario = make_scenario(
        model=TWO_LAYERS,
        training={"micro_batch": 2, "seq_len": 64, "max_grad_norm": 1.0},
        precision={"param_dtype": "fp16", "grad_scaler": True},
    )
    ops = _ops(simulate(scenario, make_profile()))
    unscale, flag, norms = (
        next(o for o in ops if o.name == n) for n in ("grad scaler unscale_", "all_reduce found_inf", NORMS)
    )
    assert flag.bytes == 4
    assert unscale.end_s <= flag.start_s and flag.end_s <= norms.start_s
