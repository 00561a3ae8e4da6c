"""Models from a Hugging Face config.json: the bundled library, the description measured under
FakeTensorMode, the scenario keys, the cache, and the simulator's use of it (issue 14)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sim.core.events import OpKind
from sim.errors import UserError
from sim.scenario.hf_model import library
from sim.scenario.loader import load_scenario
from sim.workload.description import parse_description
from sim.workload.flops import matmul_params
from sim.workload.forward import layer_ops
from sim.workload.layer_op import LayerKind
from sim.workload.model import PRESETS, ModelConfig, n_params
from sim.workload.options import WrapPolicy
from sim.workload.shapes import Workload
from sim.workload.units import build_units

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "hf"

# published totals the library must reproduce (model cards / papers; T5's as transformers counts
# them, the shared embedding once: the "60M" and "220M" of the T5 paper)
PUBLISHED = {
    "llama-2-7b": 6_738_415_616,
    "mistral-7b": 7_241_732_096,  # the hub page's 7.24B, the paper's dims to the parameter
    "mixtral-8x7b": 46_702_792_704,
    "t5-small": 60_506_624,
    "t5-base": 222_903_552,
}


def _transformers_count(config: dict) -> int:
    """Parameters of the transformers class on the meta device, built here independently."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    data = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
    cfg = AutoConfig.for_model(data.pop("model_type"), **data)
    auto = AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(library()))
def test_library_parameters_equal_transformers(name: str) -> None:
    """The description's parameters (what the simulator shards) count as transformers builds them."""
    from hfmodel.build import hf_config
    from hfmodel.describe import _meta_facts

    entry = library()[name]
    config = json.loads(entry.path.read_text())
    facts = _meta_facts(hf_config(config), torch.float32)
    described = sum(math.prod(shape) for _, shape in facts["params"])
    assert described == _transformers_count(config)
    # one stack of blocks; an encoder-decoder's two, the encoder's first
    stacks = list(dict.fromkeys(b.rpartition(".")[0] for b in facts["blocks"]))
    assert stacks in (["encoder.block", "decoder.block"],) or len(stacks) == 1
    if name in PUBLISHED:
        assert described == PUBLISHED[name]


def _describe(path: Path, micro_batch: int = 2, seq_len: int = 32, dtype: str = "bf16") -> ModelConfig:
    from hfmodel.describe import describe

    data = describe(
        json.loads(path.read_text()), micro_batch=micro_batch, seq_len=seq_len, dtype=dtype, name=path.stem
    )
    return ModelConfig.of(parse_description(json.loads(json.dumps(data)), str(path)))


def test_a_described_llama_matches_the_hand_written_one() -> None:
    """tests/data/hf/tiny-llama.json has the dimensions of the ``tiny`` preset: same parameters,
    units and matmul FLOPs and shapes; saved activations per block within 0.1 %."""
    described, preset = _describe(DATA / "tiny-llama.json"), PRESETS["tiny"]
    assert n_params(described) == n_params(preset)
    w = Workload(micro_batch=2, seq_len=32, act_bytes=2, attention_kernel="flash")
    d_ops, p_ops = layer_ops(described, w), layer_ops(preset, w)
    gemms = lambda ops: sorted(op.gemm for op in ops if op.gemm)  # noqa: E731
    assert gemms(d_ops) == gemms(p_ops)
    for kind in (LayerKind.LINEAR, LayerKind.ATTENTION):
        assert sum(o.flops for o in d_ops if o.kind is kind) == sum(o.flops for o in p_ops if o.kind is kind)
    for block in (0, 1):
        saved = [sum(o.saved_bytes for o in ops if o.block == block) for ops in (d_ops, p_ops)]
        assert saved[0] == pytest.approx(saved[1], rel=1e-3)
    units = [[u.name for u in build_units(m, WrapPolicy.BLOCK)] for m in (described, preset)]
    assert units[0] == units[1]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_hand_written_ops_backward_peaks_are_the_traced_modules(dtype: str) -> None:
    """The preset's eager RMSNorm, SwiGLU product and head (``sim.workload.layers``) against HF's
    LlamaRMSNorm, LlamaMLP and lm_head as the tracer measures them, but for the loss's 4-byte
    gradient, which every traced backward figure also holds: RMSNorm's four fp32 tensors of its
    input's shape (and in a block the residual's gradient in bf16), its output released by the
    next op's backward; the MLP's three ffn-wide gradients beside the residual's, its product
    released by down_proj's backward; the head's logits' and input's gradients. Without them the
    preset's held backward of a checkpointed block was 0.24 % below the real no-sync step
    (``tests/test_no_sync_memory.py``) and Llama-2-7B's on 8 ranks 0.4 % below its real step."""
    described, preset = _describe(DATA / "tiny-llama.json", dtype=dtype), PRESETS["tiny"]
    a = 2 if dtype == "bf16" else 4
    t, h, f = 2 * 32, preset.hidden, preset.ffn_hidden
    w = Workload(micro_batch=2, seq_len=32, act_bytes=a, attention_kernel="flash")
    d_ops, p_ops = ({o.name: o for o in layer_ops(m, w)} for m in (described, preset))
    norms = [n for n in p_ops if n.endswith(("input_layernorm", "post_attention_layernorm", "model.norm"))]
    assert len(norms) == 2 * 2 + 1
    for name in norms:
        p, d = p_ops[name], d_ops[name]
        assert p.saved_released_ahead[0][1] == d.saved_released_ahead[0][1] == t * h * a
        assert p.backward_transient_bytes == d.backward_transient_bytes - 4, name
    for block in (0, 1):
        act, product = p_ops[f"model.layers.{block}.mlp.act"], d_ops[f"model.layers.{block}.mlp"]
        traced = max(
            product.backward_transient_bytes,
            d_ops[f"model.layers.{block}.mlp.act_fn"].backward_transient_bytes,
        )
        assert act.backward_transient_bytes == traced - 4 == 3 * t * f * a + t * h * a
        assert act.saved_released_ahead == product.saved_released_ahead == ((1, t * f * a),)
    assert p_ops["lm_head"].backward_transient_bytes == d_ops["lm_head"].backward_transient_bytes - 4


def test_a_save_is_released_by_its_first_savers_backward(tmp_path: Path) -> None:
    """The input norm's output (2 x 32 tokens x 64 bf16) is saved by q, k and v projections: the
    last of their backwards to run, q_proj's, frees it (``saved_released_ahead``); a description
    whose pairs are not positive or exceed the op's saved bytes is one clear line."""
    from hfmodel.describe import describe

    path = DATA / "tiny-llama.json"
    data = describe(json.loads(path.read_text()), micro_batch=2, seq_len=32, dtype="bf16", name="t")
    ops = data["ops"]
    norm = next(i for i, o in enumerate(ops) if o["module"] == "model.layers.0.input_layernorm")
    assert [(ops[norm + d]["module"], n) for d, n in ops[norm]["saved_released_ahead"]] == [
        ("model.layers.0.self_attn.q_proj", 2 * 32 * 64 * 2)
    ]
    assert all(sum(n for _, n in o["saved_released_ahead"]) <= o["saved_bytes"] for o in ops)
    for bad, message in (([[0, 8]], "positive integers"), ([[1, 10**9]], "more bytes than saved_bytes")):
        broken = json.loads(json.dumps(data))
        broken["ops"][norm]["saved_released_ahead"] = bad
        with pytest.raises(UserError, match=rf"t.json: ops\[{norm}\]: saved_released_ahead.*{message}"):
            parse_description(broken, "t.json")


@pytest.mark.parametrize(("dtype", "kept"), [("fp32", True), ("bf16", False)])
def test_what_ops_after_a_block_save_of_it_is_measured(dtype: str, kept: bool) -> None:
    """Each block's output is saved by the next block's (or the final) RMSNorm in fp32, where its
    upcast is a no-op: exactly tokens x hidden x 4 bytes of the block's last op, nothing else. In
    bf16 the norm saves its own fp32 copy: nothing after the block keeps the block's storages."""
    described = _describe(DATA / "tiny-llama.json", dtype=dtype)
    ops = layer_ops(described, Workload(micro_batch=2, seq_len=32, act_bytes=4, attention_kernel="flash"))
    output_bytes = 2 * 32 * described.hidden * 4
    for block in (0, 1):
        mine = [o for o in ops if o.block == block]
        assert [o.saved_after_block_bytes for o in mine[:-1]] == [0] * (len(mine) - 1)
        assert mine[-1].saved_after_block_bytes == (output_bytes if kept else 0)
    assert all(o.saved_after_block_bytes == 0 for o in ops if o.block is None)


@pytest.mark.parametrize(
    ("config", "dtype", "saved_as_is"),
    [("tiny-llama", "fp32", True), ("tiny-llama", "bf16", False), ("tiny-gpt-neox", "bf16", True)],
)
def test_the_input_a_block_saves_as_it_is_is_measured_where_it_is_made(
    config: str, dtype: str, saved_as_is: bool
) -> None:
    """The embedding's output and each block's output are the next region's input: an fp32
    RMSNorm (its upcast a no-op) and a LayerNorm in any dtype save it as it is, a bf16 RMSNorm its
    own fp32 copy. Counted at the op that made it (``next_block_input_bytes``): the embedding
    lookup and each block's last op, tokens x hidden x the dtype's bytes; nothing else."""
    described = _describe(DATA / f"{config}.json", dtype=dtype)
    nbytes = 4 if dtype == "fp32" else 2
    ops = layer_ops(
        described, Workload(micro_batch=2, seq_len=32, act_bytes=nbytes, attention_kernel="flash")
    )
    tensor = 2 * 32 * described.hidden * nbytes if saved_as_is else 0
    makers = [0] + [max(i for i, o in enumerate(ops) if o.block == b) for b in (0, 1)]
    assert [ops[i].next_block_input_bytes for i in makers] == [tensor] * 3
    assert "embed" in ops[0].name
    assert all(o.next_block_input_bytes == 0 for i, o in enumerate(ops) if i not in makers)


@pytest.mark.parametrize(("mode", "selective", "kept_blocks"), [("full", "op", [1]), ("selective", 2, [1])])
def test_a_checkpointed_block_keeps_what_the_region_after_it_saves(
    tmp_path: Path, mode: str, selective: object, kept_blocks: list[int]
) -> None:
    """Full checkpointing: block 0's output is block 1's kept input, so only the last block's,
    which the final norm saves, is kept; every 2nd block (block 1 of 2): block 1's, the same. One
    allocation per checkpointed block whose next region is not a checkpoint, freed as its
    recompute starts."""
    from sim.simulate import simulate

    path = _scenario(
        tmp_path,
        f'config = "{DATA / "tiny-llama.json"}"',
        f'[checkpointing]\nmode = "{mode}"\nselective = {json.dumps(selective)}\n',
    )
    result = simulate(load_scenario(path, ["precision.param_dtype=fp32"]))
    program = result.program
    allocs = [
        (i, a)
        for i, op in enumerate(program.ops)
        for a in op.allocs
        if a.label.startswith("kept_after_block")
    ]
    assert [program.ops[i].unit for i, _ in allocs] == [f"model.layers.{b}" for b in kept_blocks]
    hidden = result.step.segments[0].ops[0].params[0].shape[1]
    tokens = result.scenario.training.micro_batch * result.scenario.training.seq_len
    assert all(a.bytes == tokens * hidden * 4 for _, a in allocs)
    for i, a in allocs:
        freed_at = next(op for op in program.ops if a.label in op.start_frees)
        assert freed_at.kind is OpKind.RECOMPUTE and freed_at.unit == program.ops[i].unit


def test_experts_compute_for_the_active_ones_and_shard_all_of_them() -> None:
    """A mixture of experts: its matmul FLOPs per token follow top-k of the experts, its
    parameters all of them; the experts' stacked weights belong to their decoder block's unit."""
    model = _describe(DATA / "tiny-mixtral.json")
    d = model.description
    assert d is not None and d.moe is not None and (d.moe.experts, d.moe.top_k) == (4, 2)
    h, f, e, k = 128, 256, 4, 2
    experts = [op for op in d.ops if op.kind == "experts"]
    tokens = 2 * 32
    assert sum(op.flops for op in experts) == 2 * tokens * k * 3 * h * f * 2  # gate_up and down, 2 layers
    assert all(count == e for op in experts for *_, count in op.gemms)
    expert_params = 3 * h * f * e
    units = build_units(model, WrapPolicy.BLOCK)
    assert sum(p.numel for p in units[0].params if "experts" in p.name) == expert_params
    # FLOPs per token (MFU's N) count active experts only
    assert matmul_params(model) < n_params(model) - 2 * expert_params // 2


def test_a_tied_heads_gradient_is_not_every_later_ops_transient(tmp_path: Path) -> None:
    """The head's share of a tied embedding's gradient waits in autograd until the embedding's
    arrives: it is the parameter's gradient (the schedule holds it from the head's backward on),
    so no op's backward transient counts it again. Every op but the head measures as in the same
    model untied (the head's lm_head weight gradient is 1024 x 128 bf16 either way)."""
    config = json.loads((DATA / "tiny-qwen2.json").read_text())
    (tmp_path / "untied.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    tied, untied = (_describe(p) for p in (DATA / "tiny-qwen2.json", tmp_path / "untied.json"))
    assert tied.description is not None and untied.description is not None

    def figures(m: ModelConfig) -> dict[str, tuple[int, int, int]]:
        assert m.description is not None
        return {
            op.name: (op.saved_bytes, op.forward_transient_bytes, op.backward_transient_bytes)
            for op in m.description.ops
        }

    assert figures(tied) == figures(untied)
    assert len(tied.description.params) == len(untied.description.params) - 1  # lm_head.weight


def _scenario(tmp_path: Path, model_lines: str, extra: str = "") -> Path:
    path = tmp_path / "s.toml"
    path.write_text(
        f"[model]\n{model_lines}\n[training]\nmicro_batch = 2\nseq_len = 32\n[parallel]\nworld_size = 2\n"
        f'[precision]\nparam_dtype = "bf16"\n{extra}'
    )
    return path


def test_model_config_in_a_scenario_is_measured_once_and_cached(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("FSDPSIM_CACHE_DIR", str(cache))
    (tmp_path / "config.json").write_text((DATA / "tiny-qwen2.json").read_text())
    path = _scenario(tmp_path, 'config = "config.json"')
    first = load_scenario(path)
    files = list(cache.iterdir())
    assert len(files) == 1 and first.model.description is not None
    assert first.model.tie_embeddings  # tied in the config: the head owns no parameter
    assert load_scenario(path).model == first.model and list(cache.iterdir()) == files
    other = load_scenario(path, ["training.seq_len=64"])  # other dims: measured again
    assert len(list(cache.iterdir())) == 2 and other.model.description.seq_len == 64


def test_a_hub_id_outside_the_library_is_one_clear_line(tmp_path: Path) -> None:
    path = _scenario(tmp_path, 'preset = "someorg/SomeModel-7B"')
    with pytest.raises(UserError, match="model.config"):
        load_scenario(path)
    proc = subprocess.run(
        [sys.executable, "-m", "sim.cli.main", "run", str(path)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "not in the bundled model library" in proc.stderr


def test_unknown_preset_lists_the_library(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="qwen2.5-7b"):
        load_scenario(_scenario(tmp_path, 'preset = "no-such-model"'))


def test_a_library_name_and_its_hub_id_give_one_model(tmp_path: Path) -> None:
    by_name = load_scenario(_scenario(tmp_path, 'preset = "olmo-2-1b"'))
    by_hub = load_scenario(_scenario(tmp_path, 'preset = "allenai/OLMo-2-0425-1B"'))
    assert by_name.model == by_hub.model
    assert n_params(by_name.model) == 1_484_916_736


def test_a_config_with_other_model_keys_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((DATA / "tiny-llama.json").read_text())
    with pytest.raises(UserError, match="takes no other model keys"):
        load_scenario(_scenario(tmp_path, 'config = "config.json"\nn_layers = 4'))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_moe_memory_matches_real_fsdp2_in_fake_mode(tmp_path: Path, name: str) -> None:
    """PyTorch's FSDP2 on the real transformers MoE model, one rank of 4 under the fake process
    group: the predicted peak equals the measured one (0.0 % when measured, see VALIDATION.md)."""
    from validation.memory_only import validate_memory_only

    path = tmp_path / "s.toml"
    path.write_text(
        f'[model]\nconfig = "{DATA / f"{name}.json"}"\n[training]\nmicro_batch = 2\nseq_len = 512\n'
        '[parallel]\nworld_size = 4\n[precision]\nparam_dtype = "bf16"\nreduce_dtype = "fp32"\n'
    )
    comparison, measured = validate_memory_only(str(path), [], timeout_s=300)
    peak = next(r for r in comparison.rows if r.metric == "peak memory")
    assert abs(peak.predicted / peak.measured - 1) < 0.01


def test_a_sequence_beyond_the_models_positions_warns(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FSDPSIM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "config.json").write_text((DATA / "tiny-llama.json").read_text())  # 256 positions
    path = _scenario(tmp_path, 'config = "config.json"')
    assert load_scenario(path).warnings == ()
    (warning,) = load_scenario(path, ["training.seq_len=512"]).warnings
    assert "max_position_embeddings (256)" in warning
    proc = subprocess.run(
        [sys.executable, "-m", "sim.cli.main", "run", str(path), "--set", "training.seq_len=512"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**__import__("os").environ, "FSDPSIM_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0 and "fsdpsim: warning:" in proc.stderr


def test_the_kernels_each_op_launches_are_counted_from_its_aten_calls() -> None:
    """A linear launches one matmul forward and two backward (its input's and its weight's
    gradients), plus one add where its input feeds several (q, k, v: two; gate, up: one);
    metadata calls (views, ``prim.device``, which autograd asks of every fake tensor) launch none;
    RMSNorm's eager forward is its eight calls (to fp32, pow, mean, add, rsqrt, mul, to, weight)."""
    described = _describe(DATA / "tiny-llama.json")
    w = Workload(micro_batch=2, seq_len=32, act_bytes=2, attention_kernel="flash")
    ops = [op for op in layer_ops(described, w) if op.block == 0]
    linears = [op for op in ops if op.kind is LayerKind.LINEAR]
    assert len(linears) == 7
    assert all(op.launches is not None and op.launches[0] == 1 for op in linears)
    backward = {op.module.rpartition(".")[2]: op.launches[1] for op in linears if op.launches}
    assert backward == {
        "q_proj": 3,
        "k_proj": 3,
        "v_proj": 2,
        "o_proj": 2,
        "gate_proj": 3,
        "up_proj": 2,
        "down_proj": 2,
    }
    norms = [op for op in ops if op.kind is LayerKind.NORM]
    assert [op.launches[0] for op in norms if op.launches] == [8, 8]


def test_the_hand_written_llama_launches_what_the_described_one_does() -> None:
    """``LAUNCHES`` groups the counts the tracer measures on transformers' Llama as the
    hand-written ops group its modules: per block and over the whole model, forward and backward,
    the same kernels."""
    w = Workload(micro_batch=2, seq_len=32, act_bytes=2, attention_kernel="flash")
    described = layer_ops(_describe(DATA / "tiny-llama.json"), w)
    preset = layer_ops(PRESETS["tiny"], w)

    def totals(ops, block):
        chosen = [op.launches for op in ops if block == "all" or op.block == block]
        assert all(launches is not None for launches in chosen)
        return tuple(sum(launches[i] for launches in chosen) for i in (0, 1))

    for block in (0, 1, "all"):
        assert totals(preset, block) == totals(described, block), block


def test_a_described_models_norms_run_as_its_code_runs_them() -> None:
    from sim.workload.options import NormKernel

    described = _describe(DATA / "tiny-llama.json")
    w = Workload(micro_batch=2, seq_len=32, act_bytes=2, attention_kernel="flash", norm=NormKernel.FUSED)
    with pytest.raises(UserError, match="training.norm"):
        layer_ops(described, w)


def test_the_readmes_library_table_is_the_index() -> None:
    """The README's table of the bundled library lists index.json's entries, in its order, with
    their hub ids and families."""
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme.split("The bundled library", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| ([^|]+) \|$", table, flags=re.MULTILINE)
    entries = library()
    assert [(name, hub) for name, hub, _ in rows] == [(e.name, e.hub_id) for e in entries.values()]
    assert all(family.strip() == entries[name].family for name, _, family in rows)
