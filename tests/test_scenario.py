"""Scenario files: typed values, defaults, presets, and one clear error per user mistake."""

import dataclasses
from pathlib import Path

import pytest

from sim.errors import UserError
from sim.scenario.loader import load_scenario, parse_override
from sim.scenario.sections import Scenario
from sim.workload.model import PRESETS
from sim.workload.options import CheckpointMode, OptimizerName, Strategy, WrapPolicy

FULL = """
[model]
preset = "llama3-8b"

[training]
micro_batch = 4
seq_len = 8192
grad_accum = 2

[parallel]
world_size = 16
strategy = "HYBRID_SHARD"
wrap = "linear"
shard_group_size = 8
reshard_after_forward = false
forward_prefetch = 2
backward_prefetch = 3
ddp_bucket_mb = 50

[precision]
param_dtype = "bfloat16"
reduce_dtype = "fp32"

[optimizer]
name = "sgd"

[checkpointing]
mode = "full"

[cluster]
profile = "a100-sxm-80g"
gpus_per_node = 4

[simulation]
seed = 7
compute_jitter = 0.05
slow_rank = 3
slow_rank_factor = 1.5
"""


def write(tmp_path: Path, text: str, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_text(tmp_path: Path, text: str, overrides: tuple[str, ...] = ()) -> Scenario:
    return load_scenario(write(tmp_path, text), overrides)


def error_of(tmp_path: Path, text: str, overrides: tuple[str, ...] = ()) -> str:
    path = write(tmp_path, text)
    with pytest.raises(UserError) as info:
        load_scenario(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_full_scenario_has_typed_values(tmp_path: Path) -> None:
    s = load_text(tmp_path, FULL)
    assert s.model == PRESETS["llama3-8b"]
    assert (s.training.micro_batch, s.training.seq_len, s.training.grad_accum) == (4, 8192, 2)
    p = s.parallel
    assert p.world_size == 16 and p.strategy is Strategy.HYBRID_SHARD and p.wrap is WrapPolicy.LINEAR
    assert (p.shard_group_size, p.reshard_after_forward, p.forward_prefetch, p.backward_prefetch) == (
        8,
        False,
        2,
        3,
    )
    assert p.ddp_bucket_mb == 50.0 and isinstance(p.ddp_bucket_mb, float)
    assert s.param_dtype == "bfloat16" and s.reduce_dtype == "fp32"
    assert s.optimizer.name is OptimizerName.SGD
    assert s.checkpointing.mode is CheckpointMode.FULL
    assert s.cluster.profile == "a100-sxm-80g" and s.gpus_per_node == 4
    assert s.shard_group_size == 8 and s.reshard_after_forward is False
    sim = s.simulation
    assert (sim.seed, sim.compute_jitter, sim.slow_rank, sim.slow_rank_factor) == (7, 0.05, 3, 1.5)
    assert s.tokens_per_step == 4 * 8192 * 2 * 16
    assert s.source == str(tmp_path / "s.toml")


def test_defaults(tmp_path: Path) -> None:
    s = load_text(tmp_path, '[model]\npreset = "tiny"\n')
    assert (s.training.micro_batch, s.training.seq_len, s.training.grad_accum) == (1, 2048, 1)
    assert s.parallel.world_size == 8 and s.parallel.strategy is Strategy.FULL_SHARD
    assert s.parallel.wrap is WrapPolicy.BLOCK
    assert (s.parallel.forward_prefetch, s.parallel.backward_prefetch) == (0, 1)
    assert s.reshard_after_forward is True and s.shard_group_size == 8
    assert s.param_dtype == "fp32" and s.reduce_dtype == "fp32"
    assert s.optimizer.name is OptimizerName.ADAMW and s.checkpointing.mode is CheckpointMode.NONE
    assert s.cluster.profile == "h100-sxm" and s.gpus_per_node == 8  # from the built-in profile
    assert s.simulation.seed == 0 and s.simulation.slow_rank is None


@pytest.mark.parametrize(
    ("strategy", "world", "group", "reshard"),
    [
        ("NO_SHARD", 8, 1, True),
        ("SHARD_GRAD_OP", 8, 8, False),
        ("FULL_SHARD", 8, 8, True),
        ("HYBRID_SHARD", 32, 8, True),
    ],
)
def test_derived_values_per_strategy(
    tmp_path: Path, strategy: str, world: int, group: int, reshard: bool
) -> None:
    text = f'[model]\npreset = "tiny"\n[parallel]\nstrategy = "{strategy}"\nworld_size = {world}\n'
    s = load_text(tmp_path, text)
    assert s.shard_group_size == group and s.reshard_after_forward is reshard


def test_enum_values_are_case_insensitive(tmp_path: Path) -> None:
    s = load_text(tmp_path, '[model]\npreset = "tiny"\n[parallel]\nstrategy = "full_shard"\nwrap = "MODEL"\n')
    assert s.parallel.strategy is Strategy.FULL_SHARD and s.parallel.wrap is WrapPolicy.MODEL


def test_preset_with_dim_overrides(tmp_path: Path) -> None:
    s = load_text(tmp_path, '[model]\npreset = "llama2-7b"\nn_layers = 4\ntie_embeddings = true\n')
    assert s.model == dataclasses.replace(
        PRESETS["llama2-7b"], n_layers=4, tie_embeddings=True, name="llama2-7b*"
    )


def test_custom_dims_without_preset(tmp_path: Path) -> None:
    text = "[model]\nn_layers = 3\nhidden = 96\nn_heads = 6\nn_kv_heads = 2\nffn_hidden = 250\nvocab = 1000\n"
    m = load_text(tmp_path, text).model
    assert (m.name, m.n_layers, m.hidden, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.vocab) == (
        "custom",
        3,
        96,
        6,
        2,
        250,
        1000,
    )
    assert m.tie_embeddings is False


def test_custom_dims_incomplete_names_the_missing_ones(tmp_path: Path) -> None:
    message = error_of(tmp_path, "[model]\nn_layers = 3\nhidden = 96\n")
    assert "model needs model.preset or all of: n_heads, n_kv_heads, ffn_hidden, vocab" in message


def test_unknown_preset(tmp_path: Path) -> None:
    message = error_of(tmp_path, '[model]\npreset = "llama2-8b"\n')
    assert message.startswith(f"{tmp_path / 's.toml'}: unknown model.preset 'llama2-8b'")
    assert "llama3-8b" in message


def test_unknown_key_did_you_mean(tmp_path: Path) -> None:
    message = error_of(tmp_path, '[model]\npreset = "tiny"\n[parallel]\nwrold_size = 8\n')
    assert message == f"{tmp_path / 's.toml'}: unknown key parallel.wrold_size (did you mean 'world_size'?)"


def test_unknown_key_far_from_any_lists_the_allowed(tmp_path: Path) -> None:
    message = error_of(tmp_path, '[model]\npreset = "tiny"\n[training]\nzzz = 1\n')
    assert (
        message
        == f"{tmp_path / 's.toml'}: unknown key training.zzz; allowed: micro_batch, seq_len, grad_accum, avg_seq_len, avg_doc_len, loss, norm, sync_every_microbatch, decoder_seq_len, attention, keep_outputs, max_grad_norm"
    )


def test_unknown_section(tmp_path: Path) -> None:
    message = error_of(tmp_path, '[model]\npreset = "tiny"\n[paralel]\nworld_size = 8\n')
    assert message == f"{tmp_path / 's.toml'}: unknown section [paralel] (did you mean 'parallel'?)"


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    message = error_of(tmp_path, 'model = "tiny"\n')
    assert message == f"{tmp_path / 's.toml'}: [model] must be a table"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('world_size = "8"', "parallel.world_size must be an integer, got '8'"),
        ("world_size = 8.0", "parallel.world_size must be an integer, got 8.0"),
        ("world_size = true", "parallel.world_size must be an integer, got True"),
        ('reshard_after_forward = "2"', "parallel.reshard_after_forward must be an integer, got '2'"),
        (
            "reshard_after_forward = 3",
            "parallel.reshard_after_forward = 3 must be true, false or an integer that divides the "
            "shard group size (8)",
        ),
        (
            "reshard_after_forward = 0",
            "parallel.reshard_after_forward = 0 must be true, false or an integer that divides the "
            "shard group size (8)",
        ),
        ("ddp_bucket_mb = false", "parallel.ddp_bucket_mb must be a number, got False"),
    ],
)
def test_wrong_type(tmp_path: Path, line: str, expected: str) -> None:
    message = error_of(tmp_path, f'[model]\npreset = "tiny"\n[parallel]\n{line}\n')
    assert message == f"{tmp_path / 's.toml'}: {expected}"


def test_bad_enum_lists_allowed_values(tmp_path: Path) -> None:
    message = error_of(tmp_path, '[model]\npreset = "tiny"\n[parallel]\nstrategy = "ZERO3"\n')
    assert message == (
        f"{tmp_path / 's.toml'}: parallel.strategy = 'ZERO3' is not allowed; "
        "allowed: NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, _HYBRID_SHARD_ZERO2"
    )


def test_bad_dtype_names_the_field(tmp_path: Path) -> None:
    message = error_of(tmp_path, '[model]\npreset = "tiny"\n[precision]\nparam_dtype = "int4"\n')
    assert message.startswith(f"{tmp_path / 's.toml'}: precision.param_dtype: unknown dtype 'int4'; allowed:")


def test_hybrid_world_size_not_divisible(tmp_path: Path) -> None:
    text = '[model]\npreset = "tiny"\n[parallel]\nstrategy = "HYBRID_SHARD"\nworld_size = 12\nshard_group_size = 8\n'
    message = error_of(tmp_path, text)
    assert message == (
        f"{tmp_path / 's.toml'}: parallel.world_size (12) must be divisible by parallel.shard_group_size (8)"
    )


def test_hybrid_default_group_is_a_node(tmp_path: Path) -> None:
    text = '[model]\npreset = "tiny"\n[parallel]\nstrategy = "HYBRID_SHARD"\nworld_size = 12\n'
    assert "must be divisible by parallel.shard_group_size (8)" in error_of(tmp_path, text)
    s = load_text(tmp_path, text + "[cluster]\ngpus_per_node = 4\n")
    assert s.shard_group_size == 4


@pytest.mark.parametrize("group", [0, -4])
def test_hybrid_group_size_must_be_positive(tmp_path: Path, group: int) -> None:
    text = f'[model]\npreset = "tiny"\n[parallel]\nstrategy = "HYBRID_SHARD"\nworld_size = 16\nshard_group_size = {group}\n'
    message = error_of(tmp_path, text)
    assert message.startswith(f"{tmp_path / 's.toml'}: parallel.shard_group_size must be > 0")


def test_shard_group_size_needs_hybrid(tmp_path: Path) -> None:
    text = '[model]\npreset = "tiny"\n[parallel]\nstrategy = "FULL_SHARD"\nshard_group_size = 4\n'
    message = error_of(tmp_path, text)
    assert (
        message
        == f"{tmp_path / 's.toml'}: parallel.shard_group_size applies only to strategies HYBRID_SHARD and _HYBRID_SHARD_ZERO2"
    )


@pytest.mark.parametrize(
    ("section", "line", "field"),
    [
        ("training", "micro_batch = 0", "training.micro_batch must be > 0"),
        ("parallel", "world_size = -8", "parallel.world_size must be > 0"),
        ("parallel", "backward_prefetch = -1", "parallel.forward_prefetch and parallel.backward_prefetch"),
        ("simulation", "slow_rank = 8", "simulation.slow_rank must be in [0, 7], got 8"),
        ("simulation", "compute_jitter = -0.1", "simulation.compute_jitter must be >= 0"),
    ],
)
def test_out_of_range_values(tmp_path: Path, section: str, line: str, field: str) -> None:
    message = error_of(tmp_path, f'[model]\npreset = "tiny"\n[{section}]\n{line}\n')
    assert message.startswith(f"{tmp_path / 's.toml'}: {field}")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"nope\.toml: scenario file not found$"):
        load_scenario(tmp_path / "nope.toml")


def test_directory_is_not_a_scenario(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="scenario file not found"):
        load_scenario(tmp_path)


def test_invalid_toml(tmp_path: Path) -> None:
    message = error_of(tmp_path, '[model]\npreset = "tiny\n')
    assert message.startswith(f"{tmp_path / 's.toml'}: not valid TOML (")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("parallel.world_size=64", ("parallel", "world_size", 64)),
        (" parallel.world_size = 64 ", ("parallel", "world_size", 64)),
        ("parallel.reshard_after_forward=false", ("parallel", "reshard_after_forward", False)),
        ("parallel.strategy=NO_SHARD", ("parallel", "strategy", "NO_SHARD")),
        ('model.preset="llama3-8b"', ("model", "preset", "llama3-8b")),
        ("model.preset=llama3-8b", ("model", "preset", "llama3-8b")),
        ("simulation.compute_jitter=0.25", ("simulation", "compute_jitter", 0.25)),
        ("cluster.profile=/a/b=c.json", ("cluster", "profile", "/a/b=c.json")),
    ],
)
def test_parse_override(text: str, expected: tuple) -> None:
    result = parse_override(text)
    assert result == expected
    assert type(result[2]) is type(expected[2])


@pytest.mark.parametrize("text", ["parallel.world_size", "world_size=64", "=64", ""])
def test_parse_override_bad_syntax(text: str) -> None:
    with pytest.raises(UserError, match=r"expected section\.key=value"):
        parse_override(text)


def test_override_goes_through_cross_field_checks(tmp_path: Path) -> None:
    message = error_of(tmp_path, FULL, ("parallel.strategy=full_shard",))
    assert (
        message
        == f"{tmp_path / 's.toml'}: parallel.shard_group_size applies only to strategies HYBRID_SHARD and _HYBRID_SHARD_ZERO2"
    )


def test_override_values(tmp_path: Path) -> None:
    path = write(tmp_path, '[model]\npreset = "tiny"\n')
    s = load_scenario(
        path,
        [
            "parallel.world_size=64",
            "parallel.reshard_after_forward=false",
            "optimizer.name=sgd",
            "simulation.compute_jitter=1",
            "model.n_layers=5",
            "training.seq_len=128",
        ],
    )
    assert s.parallel.world_size == 64 and s.parallel.reshard_after_forward is False
    assert s.optimizer.name is OptimizerName.SGD
    assert s.simulation.compute_jitter == 1.0 and isinstance(s.simulation.compute_jitter, float)
    assert s.model.n_layers == 5 and s.model.hidden == PRESETS["tiny"].hidden
    assert s.training.seq_len == 128


def test_override_later_wins_and_file_untouched(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    s = load_scenario(path, ["parallel.world_size=8", "parallel.world_size=32"])
    assert s.parallel.world_size == 32
    assert load_scenario(path).parallel.world_size == 16


def test_override_wrong_type(tmp_path: Path) -> None:
    message = error_of(tmp_path, FULL, ("parallel.world_size=many",))
    assert message == f"{tmp_path / 's.toml'}: parallel.world_size must be an integer, got 'many'"


def test_override_unknown_section(tmp_path: Path) -> None:
    message = error_of(tmp_path, FULL, ("paralel.world_size=64",))
    assert message == "--set 'paralel.world_size=64': unknown section 'paralel' (did you mean 'parallel'?)"


def test_override_unknown_key(tmp_path: Path) -> None:
    message = error_of(tmp_path, FULL, ("parallel.world=64",))
    assert message == f"{tmp_path / 's.toml'}: unknown key parallel.world (did you mean 'world_size'?)"


def test_override_breaking_a_cross_field_rule(tmp_path: Path) -> None:
    message = error_of(tmp_path, FULL, ("parallel.world_size=20",))
    assert "parallel.world_size (20) must be divisible by parallel.shard_group_size (8)" in message


def test_scenario_is_frozen(tmp_path: Path) -> None:
    s = load_text(tmp_path, FULL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.parallel = s.parallel  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.parallel.world_size = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.model.n_layers = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.training.seq_len = 1  # type: ignore[misc]


def test_override_into_a_section_that_is_not_a_table(tmp_path: Path) -> None:
    message = error_of(tmp_path, 'model = "tiny"\n', ("model.preset=tiny",))
    assert message == f"{tmp_path / 's.toml'}: [model] must be a table"
