"""``make validate-gpu`` is run only where a GPU is lent, with minutes counted: what can be checked
without one is checked here, so that a lent machine's minutes are not spent on a typo. Every
configuration it runs loads and is predicted to fit the GPUs it is meant for, the GPU is matched
to its built-in profile by the name CUDA reports, and its first item is the development set's
LoRA row (validation.published_memory) at one rank."""

import pytest

from sim.outputs.report import build_report
from sim.scenario.loader import load_scenario
from sim.simulate import simulate
from validation.gpu import BASE, COMMON, CONFIGS, LORA_ROW, builtin_for
from validation.published_memory import MEMORY_RUNS

# the names torch.cuda.get_device_name gives on the machines the device tool lends
LENT = {"NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H200": "h200"}


@pytest.mark.parametrize("reported", sorted(LENT))
def test_the_gpu_is_matched_to_its_builtin_profile(reported: str) -> None:
    assert builtin_for(reported) == LENT[reported]


def _items() -> list[tuple[str, str, list[str]]]:
    return [(LORA_ROW[0], BASE, LORA_ROW[1])] + [
        (name, scenario, [*COMMON, *sets, "parallel.world_size=1"]) for name, scenario, sets in CONFIGS
    ]


@pytest.mark.parametrize("profile", sorted(set(LENT.values())))
def test_every_item_loads_and_fits_the_lent_gpus(profile: str) -> None:
    for name, scenario, sets in _items():
        report = build_report(simulate(load_scenario(scenario, [*sets, f'cluster.profile="{profile}"'])))
        assert report.fits, (name, profile, report.required_bytes)
        assert report.step_time_s > 0


def test_the_first_item_is_the_published_lora_row_at_one_rank() -> None:
    """The row's settings, but one rank and no KV cache (today's transformers cannot keep it under
    checkpointing)."""
    row = load_scenario(BASE, LORA_ROW[1])
    published = MEMORY_RUNS[0].tables
    assert row.parallel.world_size == 1 and not row.use_cache
    assert LORA_ROW[1][0] == f'model.preset="{published["model"]["preset"]}"'
    assert row.parallel.fsdp_version == published["parallel"]["fsdp_version"] == 1
    assert row.training.micro_batch == published["training"]["micro_batch"]
    assert row.training.seq_len == published["training"]["seq_len"]
    assert row.training.attention.value == published["training"]["attention"] == "eager"
    assert row.checkpointing.mode.value == published["checkpointing"]["mode"]
    assert row.model.description is not None and row.model.description.finetune is not None
    settings = row.model.description.finetune.lora_settings()
    assert {k: settings[k] for k in published["finetune"]} == published["finetune"]


def test_the_window_and_padding_items_give_sdpa_its_mask() -> None:
    """The window item's keys reach its sliding window, so SDPA is given a mask there (the path of
    ``AttentionShape.sdpa_window_mask`` that a GPU alone can time); the last item's rows are padded,
    so every call is given the collator's padding mask."""
    from sim.hardware.registry import load_profile
    from sim.simulate import _workload
    from sim.workload.forward import layer_ops
    from sim.workload.shapes import Workload

    padded = load_scenario(CONFIGS[-1][1], [*COMMON, *CONFIGS[-1][2]])
    w_padded = _workload(padded, load_profile(padded.cluster.profile, where="test"))
    calls = [op.attention for op in layer_ops(padded.model, w_padded) if op.attention is not None]
    assert w_padded.padded and calls and all(a.padding_mask and a.sdpa_bool_mask for a in calls)
    name, scenario, sets = CONFIGS[-2]
    model = load_scenario(scenario, sets).model
    w = Workload(micro_batch=4, seq_len=2048, act_bytes=2, attention_kernel="flash")
    shapes = [op.attention for op in layer_ops(model, w) if op.attention is not None]
    assert shapes and all(a.sdpa_window_mask for a in shapes), name
