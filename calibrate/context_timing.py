"""The units' times inside the real model, where a training step runs them.

A decoder layer timed alone is faster than the same layer inside ``LlamaForCausalLM``: alone it
reuses the memory it just freed and finds its inputs in cache; in the model every layer
allocates fresh activations on top of the ones kept for backward, and the model adds work no
unit owns (rotary tables, the causal-mask decision, the loss glue). So the block's time is
measured as the difference between two plain (unwrapped, no FSDP) models of the scenario's
dimensions that differ only in depth, and the embed + head time as what is left of the
shallower one. The isolated measurements keep their role for memory and for splitting the ends
between embed and head. Both models run in the same repetitions, interleaved, so the machine's
drift reaches both alike.
"""

import statistics
from dataclasses import replace

import torch

from calibrate.cache_state import evict
from calibrate.compute import ComputeTarget
from calibrate.hf_llama import llama_config
from calibrate.sweep import TORCH_DTYPES
from calibrate.unit_timing import synced_now
from sim.hardware.compute_section import UnitMeasurement

DEPTHS = (1, 3)  # decoder layers of the shallow and the deep model


def _model(target: ComputeTarget, n_layers: int, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = llama_config(target.model, target.seq_len, n_layers=n_layers)
    model: torch.nn.Module = LlamaForCausalLM(config)
    return model.to(device=device, dtype=TORCH_DTYPES[target.param_dtype]).train()


def _step(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """(forward, backward) seconds of one training step of ``model`` on ``ids``."""
    evict(device)
    t0 = synced_now(device)
    loss = model(input_ids=ids, labels=ids).loss
    t1 = synced_now(device)
    loss.backward()
    t2 = synced_now(device)
    model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def model_times(target: ComputeTarget, device: torch.device, reps: int) -> dict[int, tuple[float, float]]:
    """Mean (forward, backward) seconds of a plain model of each depth in DEPTHS."""
    models = {depth: _model(target, depth, device) for depth in DEPTHS}
    samples: dict[int, list[tuple[float, float]]] = {depth: [] for depth in DEPTHS}
    for rep in range(reps + 1):  # the first round is a warm-up
        ids = torch.randint(0, target.model.vocab, (target.micro_batch, target.seq_len), device=device)
        for depth, model in models.items():
            times = _step(model, ids, device)
            if rep > 0:
                samples[depth].append(times)
    return {
        depth: (statistics.fmean(t[0] for t in s), statistics.fmean(t[1] for t in s))
        for depth, s in samples.items()
    }


def in_model(
    isolated: dict[str, UnitMeasurement], times: dict[int, tuple[float, float]]
) -> tuple[dict[str, UnitMeasurement], dict[str, float]]:
    """The units with their times taken from the models' difference; memory stays as measured
    alone. Returns the units and the ratio in-model / alone of each block time (for the source).

    The block's recompute is the isolated recompute scaled like its forward. When the difference
    is not positive (noise larger than a layer, which only a tiny model shows) the isolated
    figures stay."""
    (shallow, deep) = DEPTHS
    layers = deep - shallow
    out = dict(isolated)
    ratios: dict[str, float] = {}
    block = isolated["block"]
    ends_alone = {
        "forward_s": isolated["embed"].forward_s + isolated["head"].forward_s,
        "backward_s": isolated["embed"].backward_s + isolated["head"].backward_s,
    }
    for index, field in enumerate(("forward_s", "backward_s")):
        per_block = (times[deep][index] - times[shallow][index]) / layers
        ends = times[shallow][index] - shallow * per_block
        if per_block <= 0 or ends <= 0 or getattr(block, field) <= 0 or ends_alone[field] <= 0:
            ratios[field] = 1.0
            continue
        ratios[field] = per_block / getattr(block, field)
        out["block"] = replace(out["block"], **{field: per_block})  # type: ignore[arg-type]
        for name in ("embed", "head"):
            share = getattr(isolated[name], field) / ends_alone[field]
            out[name] = replace(out[name], **{field: ends * share})
    out["block"] = replace(out["block"], recompute_s=block.recompute_s * ratios["forward_s"])
    return out, ratios
