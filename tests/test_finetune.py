"""LoRA and QLoRA (issue 14): PEFT-measured descriptions, frozen parameters in the model state and
the FSDP2 schedule, bitsandbytes' 4-bit storage and quantization state, the dequantization's cost,
and memory against real FSDP2 (fake process group) with PEFT and bitsandbytes."""

import math
from pathlib import Path

import pytest
from simtest import description_cache

from sim.core.events import OpKind
from sim.errors import UserError
from sim.outputs.report import build_report
from sim.scenario.loader import load_scenario
from sim.schedule.model_state import model_state
from sim.simulate import simulate
from sim.workload.finetune import (
    dequant_bytes,
    packed_rows,
    quant_state_bytes,
    total_quant_state_bytes,
)
from sim.workload.model import PRESETS, n_params

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "hf"
LORA = '[finetune]\nmethod = "lora"\nrank = 8\nalpha = 16\ntarget_modules = ["q_proj", "v_proj"]\n'


folder = description_cache("finetune-cache")


@pytest.fixture(autouse=True)
def _cache(folder: Path) -> None:
    """One description cache for the module: a model described at the same dims and settings is
    measured once (the cache is keyed by the config's content, not its path)."""


def _scenario(tmp_path: Path, finetune: str, *, config: str = "tiny-llama", extra: str = "") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / f"{config}.json").write_text((DATA / f"{config}.json").read_text())
    path = tmp_path / "s.toml"
    path.write_text(
        f'[model]\nconfig = "{config}.json"\n[training]\nmicro_batch = 2\nseq_len = 128\n'
        '[parallel]\nworld_size = 4\n[precision]\nparam_dtype = "bf16"\nreduce_dtype = "fp32"\n'
        f"{finetune}{extra}"
    )
    return path


def test_lora_freezes_the_base_and_trains_the_adapters(tmp_path: Path) -> None:
    """PEFT's adapters on q and v: rank x in and out x rank, trainable; everything else frozen
    and stored in the compute dtype."""
    model = load_scenario(_scenario(tmp_path, LORA)).model
    specs = {p.name: p for p in model.description.params}
    a = specs["model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    b = specs["model.layers.0.self_attn.v_proj.lora_B.default.weight"]
    assert (a.shape, b.shape) == ((8, 64), (32, 8)) and a.trainable and b.trainable
    base = specs["model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert not base.trainable and base.dtype == "bf16"
    trainable = [p for p in specs.values() if p.trainable]
    assert len(trainable) == 2 * 2 * 2  # two layers, q and v, A and B
    assert all("lora_" in p.name for p in trainable)


def test_the_backward_runs_only_the_matmuls_autograd_needs(tmp_path: Path) -> None:
    """A frozen weight has no weight gradient; in the first block, whose input comes from the
    frozen embedding, a frozen linear has no backward matmul at all."""
    d = load_scenario(_scenario(tmp_path, LORA)).model.description
    ops = {op.name: op for op in d.ops}
    q0 = ops["model.layers.0.self_attn.q_proj.base_layer"]
    o0, o1 = ops["model.layers.0.self_attn.o_proj"], ops["model.layers.1.self_attn.o_proj"]
    assert q0.backward_gemms == () and q0.backward_flops == 0
    (_, n, k, _), tokens = o1.gemms[0], 2 * 128
    assert o0.backward_gemms == o1.backward_gemms == ((tokens, k, n, 1),)  # the input's gradient only
    assert o1.backward_flops == o1.flops
    lora_a0 = ops["model.layers.0.self_attn.q_proj.lora_A.default"]
    assert lora_a0.backward_gemms == ((8, 64, tokens, 1),)  # its weight's gradient only
    assert len(ops["model.layers.1.self_attn.q_proj.lora_A.default"].backward_gemms) == 2


def test_lora_model_state_holds_state_for_the_adapters_only(tmp_path: Path) -> None:
    result = simulate(load_scenario(_scenario(tmp_path, LORA)))
    step = result.step
    w = 4
    adapters = [p for u in step.units for p in u.params if p.trainable]
    frozen = [p for u in step.units for p in u.params if not p.trainable]
    numel = sum(math.ceil(p.shape[0] / w) * w * math.prod(p.shape[1:]) for p in adapters) // w
    frozen_bytes = sum(math.ceil(p.shape[0] / w) * w * math.prod(p.shape[1:]) // w * 2 for p in frozen)
    state = model_state(step)
    assert state.grads == numel * 4 and state.optimizer == 2 * numel * 4
    assert state.params == numel * 4 + frozen_bytes


def test_fsdp2_gathers_frozen_weights_and_reduces_only_adapter_gradients(tmp_path: Path) -> None:
    """Each block all-gathers all its parameters in bf16 (frozen ones uncast, adapters cast from
    fp32), reduce-scatters only its adapters' gradients in fp32; the root, all frozen, reduces
    nothing; block 0, whose input needs no gradient, reduces in the final callback, after block 1."""
    result = simulate(load_scenario(_scenario(tmp_path, LORA)))
    ops = [o for o in result.events.ops if o.rank == 0]
    rs = [o for o in ops if o.kind is OpKind.REDUCE_SCATTER]
    assert [o.unit for o in rs] == ["model.layers.1", "model.layers.0"]
    block = next(u for u in result.step.units if u.name == "model.layers.1")
    adapters = sum(p.numel for p in block.params if p.trainable)
    assert all(o.bytes == adapters * 4 for o in rs)  # fp32 reduce, adapters only (dims divide by 4)
    gathered = {o.unit: o.bytes for o in ops if o.kind is OpKind.ALL_GATHER}
    assert gathered["model.layers.1"] == sum(p.numel for p in block.params) * 2


def _qlora(tmp_path: Path, extra: str = "") -> Path:
    return _scenario(
        tmp_path,
        LORA.replace('"lora"', '"qlora"').replace('["q_proj", "v_proj"]', '"all-linear"'),
        config="tiny-qwen2",
        extra=extra,
    )


def test_qlora_stores_the_base_packed_and_its_quantization_state_whole(tmp_path: Path) -> None:
    scenario = load_scenario(_qlora(tmp_path))
    d = scenario.model.description
    quantized = [p for p in d.params if p.quantized_numel]
    assert quantized and all(p.shape == (packed_rows(p.quantized_numel, "bf16"), 1) for p in quantized)
    assert all(".layers." in p.name for p in quantized)  # the embedding and the head stay bf16
    # parameter count: the elements the packed weights hold, as transformers counts them
    assert n_params(scenario.model) == sum(p.quantized_numel or p.numel for p in d.params)
    result = simulate(scenario)
    assert result.step.quant_state_bytes == total_quant_state_bytes(d.params, True)
    resident = {a.label: a.bytes for a in result.program.initial}
    assert resident["quant_state"] == result.step.quant_state_bytes


def test_bitsandbytes_formulas_match_its_tensors() -> None:
    """Packed storage and quantization state as bitsandbytes 0.50 makes them on this CPU."""
    bnb = pytest.importorskip("bitsandbytes")
    from hfmodel.finetune import quant_state_bytes as measured_state

    for out, inp, double in ((96, 64, True), (200, 128, True), (64, 64, False)):
        layer = bnb.nn.Linear4bit(inp, out, bias=False, compress_statistics=double, quant_type="nf4",
                                  quant_storage=torch.bfloat16)  # fmt: skip
        layer.weight = bnb.nn.Params4bit(
            torch.randn(out, inp), requires_grad=False, compress_statistics=double, quant_type="nf4",
            quant_storage=torch.bfloat16, module=layer,
        )  # fmt: skip
        layer = layer.to("cpu")
        assert tuple(layer.weight.shape) == (packed_rows(out * inp, "bf16"), 1)
        holder = torch.nn.Sequential(layer)
        assert measured_state(holder) == quant_state_bytes(out * inp, double)


def test_qlora_dequantizes_before_each_matmul_that_needs_the_weight(tmp_path: Path) -> None:
    """The forward of a 4-bit linear moves the dequantization's bytes and holds the bf16 weight;
    its backward dequantizes again only when it computes its input's gradient."""
    from sim.simulate import build_step

    scenario = load_scenario(_qlora(tmp_path))
    lora = load_scenario(_scenario(tmp_path / "b", LORA.replace('["q_proj", "v_proj"]', '"all-linear"'),
                                   config="tiny-qwen2"))  # fmt: skip
    profile = simulate(scenario).profile
    q_ops = {op.name: op for op in build_step(scenario, profile)[2]}
    l_ops = {op.name: op for op in build_step(lora, profile)[2]}
    name = "model.layers.1.mlp.down_proj.base_layer"
    q, base = q_ops[name], l_ops[name]
    n = q.params[0].quantized_numel
    out_bytes = 2 * q.gemm[0] * q.gemm[1] * 2  # PEFT's clone of the base output, read and written
    assert q.memory_bytes == base.memory_bytes + dequant_bytes(n, 2, True) + out_bytes
    assert q.forward_transient_bytes >= base.forward_transient_bytes + 2 * n
    assert q.backward_memory_bytes == base.backward_memory_bytes + dequant_bytes(n, 2, True) + out_bytes
    first = q_ops["model.layers.0.self_attn.q_proj.base_layer"]  # no input gradient in block 0
    assert first.backward_gemms == () and first.backward_transient_bytes == (
        l_ops["model.layers.0.self_attn.q_proj.base_layer"].backward_transient_bytes
    )
    busy_q, busy_l = (build_report(simulate(s)).breakdown.compute_s for s in (scenario, lora))
    assert busy_q > busy_l


def test_finetune_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="finetune.quant_storage = 'fp16' differs"):
        load_scenario(_qlora(tmp_path, 'quant_storage = "fp16"\n'))
    with pytest.raises(UserError, match="finetune.dropout must be in"):
        load_scenario(_scenario(tmp_path, LORA + "dropout = 1.5\n"))
    with pytest.raises(UserError, match="not DeepSpeed"):
        load_scenario(_scenario(tmp_path, LORA), ["deepspeed.enabled=true"])
    with pytest.raises(UserError, match="finetune.method = 'dora' is not allowed"):
        load_scenario(_scenario(tmp_path, '[finetune]\nmethod = "dora"\n'))
    with pytest.raises(UserError, match="precision.param_dtype = 'uint8' is not allowed"):
        load_scenario(_scenario(tmp_path, "", extra='[cluster]\nprofile = "h100-sxm"\n').parent / "s.toml",
                      ["precision.param_dtype=uint8"])  # fmt: skip


def test_a_hand_written_preset_is_described_for_lora(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        '[model]\npreset = "tiny"\n[training]\nmicro_batch = 2\nseq_len = 64\n[parallel]\nworld_size = 2\n'
        '[precision]\nparam_dtype = "bf16"\n' + LORA
    )
    model = load_scenario(path).model
    assert model.description is not None and model.name == "tiny"
    adapters = 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)  # q and v of two layers, rank 8
    assert n_params(model) == n_params(PRESETS["tiny"]) + adapters


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_memory_matches_real_fsdp2_with_peft(tmp_path: Path, method: str) -> None:
    """PEFT on the real transformers model under FSDP2, one rank of 4 on the fake process group
    (QLoRA on real bitsandbytes tensors): the predicted peak within 1 % of the measured one."""
    pytest.importorskip("bitsandbytes")
    from validation.memory_only import validate_memory_only

    path = _scenario(tmp_path, LORA.replace('"lora"', f'"{method}"'), extra="")
    path.write_text(path.read_text().replace("seq_len = 128", "seq_len = 512"))
    comparison, _ = validate_memory_only(str(path), [], timeout_s=300)
    peak = next(r for r in comparison.rows if r.metric == "peak memory")
    assert abs(peak.predicted / peak.measured - 1) < 0.01
