"""Parameter counts and shapes of every preset against transformers' LlamaForCausalLM.

The HF model is built on the meta device (no memory, no weights, no download), so even the 70B
presets take well under a second each.
"""

from dataclasses import replace

import pytest

from sim.errors import UserError
from sim.workload.model import PRESETS, ModelConfig, n_params, param_specs, preset

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_model(cfg: ModelConfig):
    """The model validation and calibration build, on the meta device."""
    from calibrate.hf_llama import llama_config

    with torch.device("meta"):
        return transformers.LlamaForCausalLM(llama_config(cfg, seq_len=128))


CASES = [
    pytest.param(name, tie, id=f"{name}-{'tied' if tie else 'untied'}")
    for name in PRESETS
    for tie in (False, True)
]


@pytest.mark.parametrize(("name", "tie"), CASES)
def test_params_equal_transformers(name: str, tie: bool) -> None:
    cfg = replace(PRESETS[name], tie_embeddings=tie)
    model = hf_model(cfg)
    hf = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    ours = [(s.name, s.shape) for s in param_specs(cfg)]
    assert ours == hf
    assert n_params(cfg) == sum(p.numel() for p in model.parameters())


def test_llama2_7b_published_count() -> None:
    assert n_params(PRESETS["llama2-7b"]) == 6_738_415_616


def test_published_counts_of_the_large_presets() -> None:
    # Totals transformers reports for meta-llama's checkpoints (untied embeddings).
    assert n_params(PRESETS["llama2-13b"]) == 13_015_864_320
    assert n_params(PRESETS["llama2-70b"]) == 68_976_648_192
    assert n_params(PRESETS["llama3-8b"]) == 8_030_261_248
    assert n_params(PRESETS["llama3-70b"]) == 70_553_706_496


def test_tying_removes_exactly_the_head() -> None:
    cfg = PRESETS["llama3-8b"]
    tied = replace(cfg, tie_embeddings=True)
    assert n_params(cfg) - n_params(tied) == cfg.vocab * cfg.hidden
    assert [s.name for s in param_specs(tied)][-1] == "model.norm.weight"


def test_custom_gqa_dims_match_transformers() -> None:
    cfg = ModelConfig(n_layers=3, hidden=96, n_heads=6, n_kv_heads=2, ffn_hidden=250, vocab=1000)
    model = hf_model(cfg)
    assert [(s.name, s.shape) for s in param_specs(cfg)] == [
        (n, tuple(p.shape)) for n, p in model.named_parameters()
    ]


def test_unknown_preset_lists_the_allowed_ones() -> None:
    with pytest.raises(UserError, match=r"scen\.toml: unknown model.preset 'llama9'.*llama2-7b"):
        preset("llama9", "scen.toml")


@pytest.mark.parametrize(
    ("dims", "field"),
    [
        ({"hidden": 100, "n_heads": 8}, "model.hidden"),
        ({"n_heads": 8, "n_kv_heads": 3}, "model.n_heads"),
        ({"n_layers": 0}, "model.n_layers"),
    ],
)
def test_impossible_dims_are_refused(dims: dict, field: str) -> None:
    cfg = replace(PRESETS["tiny"], **dims)
    with pytest.raises(UserError, match=rf"^f\.toml: {field}"):
        cfg.check("f.toml")
