"""A fake-mode memory step of a scenario's Llama on an older transformers (and PEFT), as 2023's
fine-tuning recipes ran it: ``fsdpsim``'s ``--memory-only`` measurement with the model built by
that version's own ``LlamaForCausalLM``.

    python -m validation.legacy_transformers SCENARIO --site DIR [--set k=v ...]
    python -m validation.legacy_transformers --memory-row N --site DIR

(``--memory-row N``: the scenario of row N of ``make validate-published``'s memory table,
``validation.published_memory.MEMORY_RUNS``.)

``DIR`` holds the old packages, e.g. ``pip install --no-deps --target DIR transformers==4.31.0
huggingface-hub==0.16.4 tokenizers==0.13.3 peft==0.4.0``; it goes first on ``sys.path`` after the
scenario is loaded (its model description is measured by today's transformers, as the simulator
reads it). Prints one JSON object: ``validation.fake_memory.measure_fake_memory``'s, plus the
versions that ran. Why: transformers before 4.36 kept the KV cache as per-layer ``(k, v)`` tuples
returned in the model's output (``model.kv_cache = "legacy"``); this is the real code whose cache
lifetime that key models (llama-cookbook PR #41 ran transformers 4.31). Llama only; the
attention is that version's eager attention (it had no SDPA path), the causal mask built by its
``_prepare_decoder_attention_mask`` on every forward.
"""

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

from sim.errors import UserError
from sim.scenario.loader import load_scenario
from sim.scenario.sections import Scenario
from sim.workload.options import AttentionImpl, OutputFormat


def build_legacy_llama(scenario: Scenario) -> Any:
    """The scenario's Llama from the old ``transformers`` on ``sys.path``; LoRA by the old PEFT, its
    adapters fp32 over the base as that PEFT made them."""
    import torch
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    from calibrate.sweep import TORCH_DTYPES
    from validation.build import finetune_settings

    d = scenario.model.description
    if d is None or json.loads(d.config_json).get("model_type") != "llama":
        raise UserError(f"{scenario.source}: validation.legacy_transformers builds Llama configs only")
    config = LlamaConfig(**json.loads(d.config_json))
    config.use_cache = scenario.use_cache
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    # built in the stored dtype (``model.to`` swaps parameters, which fake mode forbids)
    torch.set_default_dtype(TORCH_DTYPES[d.dtype])
    try:
        model = LlamaForCausalLM(config).train()
    finally:
        torch.set_default_dtype(previous)
    if d.finetune is None:
        return model
    from peft import LoraConfig, get_peft_model

    settings = finetune_settings(scenario.model)
    lora = LoraConfig(
        r=settings["rank"],
        lora_alpha=settings["alpha"],
        lora_dropout=settings["dropout"],
        target_modules=list(settings["target_modules"]),
        bias="none",
        task_type="CAUSAL_LM",
    )
    # adapters in the default dtype, fp32; PEFT's moves of new modules to the base layer's device
    # are no-ops here (all fake CPU tensors) and are skipped, as hfmodel.finetune.apply_lora does:
    # fake mode forbids the parameter swap they would make
    to = nn.Module.to
    nn.Module.to = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        peft_model = get_peft_model(model, lora)
    finally:
        nn.Module.to = to  # type: ignore[method-assign]
    return peft_model.base_model.model  # the HF module names the scenario's units use


@contextlib.contextmanager
def _no_mask_patch(model: Any, **_: Any) -> Iterator[None]:
    """The old Llama builds its causal mask with no data-dependent step: nothing to decide."""
    yield


def measure(scenario: Scenario, log: Any = None) -> dict[str, Any]:
    """``measure_fake_memory`` on the old code; ``log``: its ``AllocationLog`` (FSDP1)."""
    import transformers

    import validation.fake_memory as fake_memory

    fake_memory.build_scenario_model = build_legacy_llama
    fake_memory.one_sequence_per_row = _no_mask_patch
    result = fake_memory.measure_fake_memory(scenario, log=log)
    import peft

    return {**result, "versions": {"transformers": transformers.__version__, "peft": peft.__version__}}


def _scenario(path: str | None, row: int | None, overrides: list[str]) -> Scenario:
    scenario = load_scenario_or_row(path, row, overrides)
    # the old Llama has one attention (eager) and one cache (tuples): the scenario must say so
    if scenario.training.attention is not AttentionImpl.EAGER:
        raise UserError(
            f'{scenario.source}: the old Llama runs eager attention: set training.attention = "eager"'
        )
    if scenario.use_cache and scenario.output_format is not OutputFormat.LEGACY:
        raise UserError(
            f'{scenario.source}: the old Llama\'s cache is per-layer tuples: set model.output_format = "legacy"'
        )
    return scenario


def use_site(site: str) -> None:
    """Put ``site``'s old packages first on ``sys.path``, before anything imports transformers."""
    if "transformers" in sys.modules:
        raise UserError(f"transformers was imported before --site {site} was added")
    sys.path.insert(0, site)


def load_scenario_or_row(path: str | None, row: int | None, overrides: list[str]) -> Scenario:
    """A scenario file, or row ``row`` of the published memory runs (``--memory-row``)."""
    if (path is None) == (row is None):
        raise UserError("validation.legacy_transformers: give a SCENARIO or --memory-row N, not both")
    if path is not None:
        return load_scenario(path, overrides)
    from sim.scenario.loader import scenario_from_dict
    from validation.published_memory import MEMORY_RUNS

    assert row is not None
    if not 0 <= row < len(MEMORY_RUNS):
        raise UserError(f"--memory-row: allowed 0..{len(MEMORY_RUNS) - 1}, got {row}")
    run = MEMORY_RUNS[row]
    return scenario_from_dict(run.tables, run.name, overrides)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m validation.legacy_transformers")
    parser.add_argument("scenario", nargs="?")
    parser.add_argument("--memory-row", type=int, help="a row of validation.published_memory.MEMORY_RUNS")
    parser.add_argument("--site", required=True, help="a directory holding the old transformers and peft")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args(argv)
    try:
        scenario = _scenario(args.scenario, args.memory_row, args.overrides)
        use_site(args.site)
        print(json.dumps(measure(scenario), default=str))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
