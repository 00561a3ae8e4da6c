"""``make validate-published``: the published GPU training runs of the development set
(``shared/published-dev.md`` §1) predicted with the built-in profiles and clusters, against the
figures their authors published. Nothing here is fitted: the runs are the validation set, and the
model's constants come from kernel-, link- and hardware-level measurements only.

Each run is described as its source describes it; where the source is silent (the network of
torchtitan's 2024 A100 cluster), the assumption is named in the run's ``note``. The section is
written between markers in VALIDATION.md, so the rest of the file is kept.
"""

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.outputs.report import StepReport, build_report
from sim.scenario.loader import scenario_from_dict
from sim.simulate import simulate
from validation.marked_sections import markers, write_between_markers
from validation.published_memory import GIB, memory_section
from validation.published_network import network_section

TARGET_MEDIAN, TARGET_WORST = 0.10, 0.20
TORCHTITAN = (
    "pytorch/torchtitan docs/performance.md (2024), 64 x A100-80GB SXM, FSDP2, bf16 params, fp32 reduce"
)
IBM = "PyTorch/IBM blog 'Maximizing training throughput using PyTorch FSDP' (2024), 128 x A100, 400 Gb/s network"
TORCHTITAN_NOTE = (
    "network not published: the built-in dgx-a100 cluster (8 x 200 Gb/s HDR per node, rail-optimized) is assumed; "
    "the norm each config named then (torchtitan@157a12c56 train_configs: Llama 3 8B and Llama 2 13B "
    '"fused_rmsnorm", training.norm = "fused"; the 70Bs "rmsnorm", eager); gradients clipped to norm 1.0 '
    "(train_configs max_norm, training.max_grad_norm)"
)
IBM_NOTE = (
    "FSDP1 as the source ran it (foundation-model-stack/fms-fsdp@b9df76a, the blog's code: "
    "FullyShardedDataParallel with MixedPrecision bf16 param, reduce and buffer dtypes, limit_all_gathers, "
    "use_orig_params=False, the default BACKWARD_PRE); the 400 Gb/s network read as 400 Gb/s per node: "
    "dgx-a100 nodes with 4 x 100 Gb/s NICs (cluster.nics_per_node, cluster.nic_gbps); gradients clipped to "
    "norm 1.0 (grad_clip_thresh, model.clip_grad_norm_; training.max_grad_norm)"
)


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    name: str
    source: str
    tables: dict[str, dict[str, Any]]  # the scenario, as TOML tables
    tokens_per_s_per_gpu: float | None  # None: the source reports out-of-memory
    note: str = ""
    overrides: list[str] = field(default_factory=list)


def _llama(
    preset: str, ranks: int, micro_batch: int, seq: int, ckpt: str, selective: Any = "op"
) -> dict[str, Any]:
    return {
        "model": {"preset": preset},
        # both sources clip the gradients' norm to 1.0 (torchtitan@157a12c56 train_configs
        # ``max_norm = 1.0``; fms-fsdp@b9df76a ``grad_clip_thresh = 1.0``, ``model.clip_grad_norm_``)
        "training": {"micro_batch": micro_batch, "seq_len": seq, "max_grad_norm": 1.0},
        "parallel": {"world_size": ranks, "strategy": "FULL_SHARD", "wrap": "block"},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
        "checkpointing": {"mode": ckpt, "selective": selective},
        "cluster": {"profile": "a100-sxm-80g", "gpus_per_node": 8},
    }


# the norm each model's torchtitan config named when performance.md was written (157a12c56,
# train_configs/*.toml ``norm_type``): Llama 3 8B and Llama 2 13B "fused_rmsnorm" (a Triton
# kernel), the 70Bs "rmsnorm" (eager)
TITAN_NORM = {"llama3-8b": "fused", "llama2-13b": "fused", "llama3-70b": "eager", "llama2-70b": "eager"}


def _titan(name: str, preset: str, mb: int, seq: int, ckpt: str, sel: Any, tps: float | None) -> PublishedRun:
    tables = _llama(preset, 64, mb, seq, ckpt, sel)
    tables["training"]["norm"] = TITAN_NORM[preset]
    return PublishedRun(
        name=f"torchtitan {name}",
        source=TORCHTITAN,
        tables=tables,
        tokens_per_s_per_gpu=tps,
        note=TORCHTITAN_NOTE,
    )


def _ibm(name: str, tables: dict[str, Any], tps: float) -> PublishedRun:
    tables["cluster"].update(nics_per_node=4, nic_gbps=100.0)
    tables["parallel"].update(fsdp_version=1)  # fms-fsdp main_training.py: FSDP(...)
    tables["precision"].update(reduce_dtype="bf16", buffer_dtype="bf16")  # fms_fsdp/policies bfSixteen
    tables["fsdp1"] = {
        "limit_all_gathers": True,
        "use_orig_params": False,
        "backward_prefetch": "BACKWARD_PRE",
    }
    return PublishedRun(
        name=f"IBM {name}", source=IBM, tables=tables, tokens_per_s_per_gpu=tps, note=IBM_NOTE
    )


def _hsdp(tables: dict[str, Any]) -> dict[str, Any]:
    tables["parallel"].update(strategy="HYBRID_SHARD", shard_group_size=8)
    return tables


# torchtitan's "selective layer" is its integer option (every 2nd block in its configs), "op" its op policy
RUNS: list[PublishedRun] = [
    _titan("Llama 3 8B, selective layer", "llama3-8b", 1, 8192, "selective", 2, 2904),
    _titan("Llama 3 8B, selective op", "llama3-8b", 1, 8192, "selective", "op", 2973),
    _titan("Llama 3 70B, full AC", "llama3-70b", 1, 8192, "full", "op", 331),
    _titan("Llama 2 13B, no AC", "llama2-13b", 2, 4096, "none", "op", 2162),
    _titan("Llama 2 13B, selective layer", "llama2-13b", 2, 4096, "selective", 2, 1914),
    _titan("Llama 2 13B, selective op", "llama2-13b", 2, 4096, "selective", "op", 1904),
    _titan("Llama 2 70B, selective op, batch 1", "llama2-70b", 1, 4096, "selective", "op", 355),
    _titan("Llama 2 70B, full AC, batch 2", "llama2-70b", 2, 4096, "full", "op", 353),
    _titan("Llama 2 70B, selective layer, batch 2", "llama2-70b", 2, 4096, "selective", 2, None),
    _titan("Llama 2 70B, selective op, batch 2", "llama2-70b", 2, 4096, "selective", "op", None),
    _ibm("7B, HSDP in 8-GPU groups, no AC", _hsdp(_llama("llama2-7b", 128, 2, 4096, "none")), 3700),
    _ibm("13B, selective AC", _llama("llama2-13b", 128, 2, 4096, "selective", 2), 1800),
    _ibm("34B, full AC", _llama("codellama-34b", 128, 2, 4096, "full"), 700),
    _ibm("70B, full AC", _llama("llama2-70b", 128, 2, 4096, "full"), 370),
]


def predict_tables(
    name: str, tables: dict[str, dict[str, Any]], overrides: list[str] | None = None
) -> StepReport:
    return build_report(simulate(scenario_from_dict(tables, name, overrides or [])))


def predict(run: PublishedRun) -> StepReport:
    return predict_tables(run.name, run.tables, run.overrides)


def _row(run: PublishedRun, r: StepReport) -> tuple[str, float | None]:
    if run.tokens_per_s_per_gpu is None:
        verdict = "agrees" if not r.fits else "DISAGREES"
        predicted = "fits" if r.fits else f"does not fit ({r.required_bytes / GIB:.1f} GiB)"
        return f"| {run.name} | {predicted} | out of memory | {verdict} | {r.mfu:.1%} |", None
    error = r.tokens_per_s_per_gpu / run.tokens_per_s_per_gpu - 1
    fit = "" if r.fits else f" (predicted not to fit: {r.required_bytes / GIB:.1f} GiB)"
    return (
        f"| {run.name} | {r.tokens_per_s_per_gpu:,.0f}{fit} | {run.tokens_per_s_per_gpu:,.0f} | {error:+.1%} | {r.mfu:.1%} |",
        error,
    )


def published_section(runs: list[PublishedRun] = RUNS) -> str:
    """The VALIDATION.md section: one row per run, the summary against the targets, the sources."""
    lines = [
        "## Published GPU runs (development set, `make validate-published`)",
        "",
        "Predicted with the built-in profiles (`sim/hardware/profiles/`), never fitted to these figures.",
        "",
        "| run | predicted tokens/s/GPU | published | error | predicted MFU |",
        "|---|---|---|---|---|",
    ]
    errors = []
    for run in runs:
        line, error = _row(run, predict(run))
        lines.append(line)
        if error is not None:
            errors.append(abs(error))
    median, worst = statistics.median(errors), max(errors)
    met = median <= TARGET_MEDIAN and worst <= TARGET_WORST
    lines += [
        "",
        f"Tokens/s per GPU: median |error| {median:.1%}, worst {worst:.1%} (targets {TARGET_MEDIAN:.0%} / "
        f"{TARGET_WORST:.0%}: {'met' if met else 'NOT met'}).",
        "",
        "Sources and assumptions:",
    ]
    lines += sorted({f"- {run.source}; {run.note}" for run in runs})
    from validation.eager_bandwidth import kernel_section
    from validation.fused_bandwidth import kernel_paragraph

    return (
        "\n".join(lines)
        + "\n\n"
        + kernel_section()
        + "\n"
        + kernel_paragraph()
        + "\n"
        + memory_section()
        + "\n"
        + network_section()
    )


def write_published(path: str | Path = "VALIDATION.md") -> str:
    """Replace the section between the markers in ``path`` (appending it the first time)."""
    section = published_section()
    write_between_markers(str(path), "published", section)
    begin, end = markers("published")
    return f"{begin}\n{section}{end}"
