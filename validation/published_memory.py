"""The development set's peak-memory runs (``shared/published-dev.md``: llama-cookbook PR #41's
LoRA rows and issue #120's 70B row), predicted with the built-in profiles: allocated and active
against the figures the sources printed, and reserved through the caching allocator's model
(``sim.outputs.allocator``), beside the sources' own code run here and its allocations replayed
(``validation.legacy_transformers``, ``validation.allocator_replay``). ``memory_section`` writes
the table and its notes into the published section of VALIDATION.md (``validation.published``).
"""

import json
from dataclasses import dataclass
from typing import Any

from sim.outputs.report import build_report
from sim.scenario.loader import scenario_from_dict
from sim.schedule.optimizer import optimizer_temp_pieces
from sim.simulate import SimResult, simulate

COOKBOOK = (
    "meta-llama/llama-cookbook PR #41 (awgu, 2023-07-25, commit e5970e2e), 4 x A100-40GB: "
    "`torchrun --nproc_per_node 4 llama_finetuning.py --enable_fsdp --use_peft --peft_method lora "
    "--model_name llama-2-7b-hf --pure_bf16`"
)
COOKBOOK_NOTE = (
    "as the PR's code ran it: FSDP1 FULL_SHARD with mixed_precision=None over model.to(bf16) and PEFT's "
    "fp32 adapters (LoRA r8, alpha 32, dropout 0.05, q_proj/v_proj; the llama-recipes wrap of every "
    "trainable leaf module and each LlamaDecoderLayer), limit_all_gathers=True, every decoder layer "
    "checkpointed (apply_activation_checkpointing, non-reentrant), batch 4 x 2048 tokens (samsum packed "
    "by Concatenator(chunk_size=2048)), torch.optim.AdamW, `loss = model(**batch).loss`; transformers "
    "4.31's Llama (no SDPA: eager attention; its KV cache per-layer tuples, its logits fp32) with the "
    "config's use_cache = True. Simulated with today's transformers' Llama in eager mode (same ops: q@k^T, "
    "the float mask added, fp32 softmax cast back, @v) and model.output_format = \"legacy\". The PR's 'GB' "
    "read as GiB (2^30 B): the PR's own code, run here (`validation.legacy_transformers`), measures "
    "16,357,050,880 B and 21,700,594,180 B for its 15.22 and 20.20, 0.1 % from them as GiB and 7.4 % "
    "(the factor 2^30 / 10^9) as 10^9"
)
MEMORY_TARGET = 0.05
GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class PublishedMemoryRun:
    name: str
    source: str
    tables: dict[str, dict[str, Any]]
    active_gib: float  # the source's peak active (allocated, in whole caching-allocator blocks)
    reserved_gib: float  # the source's peak reserved
    note: str = ""
    # the source's peak allocated (``torch.cuda.max_memory_allocated``), where it gives one
    allocated_gib: float | None = None
    # the source prints whole GiB rounded down (llama-recipes' ``byte2gb``: ``int(x / 2**30)``):
    # its figure N stands for [N, N + 1), and a prediction inside that is no error
    whole_gib: bool = False
    # the source's own code run here (fake mode, storage bytes: ``validation.legacy_transformers``)
    measured_here_bytes: int | None = None
    # that code's own allocations, in order, replayed through the allocator model
    # (``validation.allocator_replay``): its peak reserved
    replayed_reserved_bytes: int | None = None


def _cookbook_lora(tables_update: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    tables: dict[str, dict[str, Any]] = {
        "model": {"preset": "meta-llama/Llama-2-7b-hf", "use_cache": True, "output_format": "legacy"},
        "training": {"micro_batch": 4, "seq_len": 2048, "attention": "eager"},
        "parallel": {"world_size": 4, "strategy": "FULL_SHARD", "fsdp_version": 1, "wrap": "peft"},
        "fsdp1": {"mixed_precision": False, "limit_all_gathers": True},
        "precision": {"param_dtype": "bf16"},
        "checkpointing": {"mode": "full"},
        "finetune": {
            "method": "lora",
            "rank": 8,
            "alpha": 32,
            "dropout": 0.05,
            "target_modules": ["q_proj", "v_proj"],
        },
        "optimizer": {"name": "adamw"},
        "cluster": {"profile": "a100-sxm-40g", "gpus_per_node": 4},
    }
    for name, values in (tables_update or {}).items():
        tables[name].update(values)
    return tables


COOKBOOK_70B = (
    "meta-llama/llama-cookbook issue #120 (2023-08), Llama-2-70B trained whole on 16 x A100-80GB by the "
    "recipe's 70B instructions (`llama_finetuning.py --enable_fsdp --low_cpu_fsdp --pure_bf16 "
    "--batch_size_training 1 --micro_batch_size 1`, README of commit fcc817e9): its printed max CUDA "
    "memory allocated / peak active / reserved 42 / 59 / 63 GB (with AnyPrecisionAdamW 42 / 52 / 58)"
)
COOKBOOK_70B_NOTE = (
    "as llama-recipes of August 2023 ran it: FSDP1 FULL_SHARD, mixed_precision=None over model.to(bf16) "
    "(AdamW's states bf16), each LlamaDecoderLayer a unit, limit_all_gathers=True, every decoder layer "
    "checkpointed, batch 1 x 2048 tokens (samsum packed by Concatenator(chunk_size=2048)), "
    "torch.optim.AdamW, transformers 4.31's eager Llama; the two nodes assumed AWS p4d (allocated memory does "
    "not depend on the network; active does: it holds what the device has not yet reduced). Its figures are "
    "byte2gb's, whole GiB rounded down. Peak active exceeds allocated by 17 GiB: blocks the host has "
    "freed whose reuse waits, by record_stream, for the device's compute and post-backward streams to "
    "pass them (fake mode has no streams to show it). `--low_cpu_fsdp` refuses any torch but a nightly of "
    "2023-07-01 or later (commit 895dfcea), so the run's FSDP1 is torch 2.1's, which holds what torch 2.13's "
    "does here: its post-backward pads a flat gradient (`F.pad`, a copy) only where its numel is not a "
    "multiple of the world size (every unit's divides by 16), and its pre-backward unshards only what was "
    "not prefetched. The AnyPrecisionAdamW row: the recipe's `--optimizer anyprecision` "
    "(`AnyPrecisionAdamW(momentum_dtype=bf16, variance_dtype=bf16, use_kahan_summation=False)`), a loop "
    "over the parameters whose temporaries are the for-loop AdamW's (`optimizer.implementation = "
    '"for-loop"`)'
)


def _cookbook_70b() -> dict[str, dict[str, Any]]:
    return {
        "model": {"preset": "meta-llama/Llama-2-70b-hf", "use_cache": True, "output_format": "legacy"},
        "training": {"micro_batch": 1, "seq_len": 2048, "attention": "eager"},
        "parallel": {"world_size": 16, "strategy": "FULL_SHARD", "fsdp_version": 1},
        "fsdp1": {"mixed_precision": False, "limit_all_gathers": True},
        "precision": {"param_dtype": "bf16"},
        "checkpointing": {"mode": "full"},
        "optimizer": {"name": "adamw"},
        "cluster": {"profile": "a100-sxm-80g", "name": "aws-p4d"},
    }


# The PR's own code measured here: transformers 4.31.0 and PEFT 0.4.0 (July 2023) over torch 2.13's
# FSDP1 under the fake process group, one rank of 4, storage bytes (`python -m
# validation.legacy_transformers --memory-row N --site DIR`, 2026-12-02). The rate limiter's effect
# cannot show there (the fake group's collectives return at once: nothing is in flight).
MEMORY_RUNS: list[PublishedMemoryRun] = [
    PublishedMemoryRun(
        name="llama-recipes Llama-2-7B LoRA, pure bf16, full AC, 4 x A100-40GB (PR #41, final: "
        "`loss = model(**batch).loss`)",
        source=COOKBOOK,
        tables=_cookbook_lora(),
        active_gib=15.22,
        reserved_gib=19.36,
        note=COOKBOOK_NOTE,
        measured_here_bytes=16_357_050_880,
        replayed_reserved_bytes=18_635_292_672,
    ),
    PublishedMemoryRun(
        name="the same with `outputs = model(**batch)` kept through backward (`training.keep_outputs`)",
        source=COOKBOOK,
        tables=_cookbook_lora({"training": {"keep_outputs": True}}),
        active_gib=20.20,
        reserved_gib=27.36,
        note=COOKBOOK_NOTE,
        measured_here_bytes=21_700_594_180,
        replayed_reserved_bytes=27_225_227_264,
    ),
    PublishedMemoryRun(
        name="the same, also without limit_all_gathers",
        source=COOKBOOK,
        tables=_cookbook_lora({"training": {"keep_outputs": True}, "fsdp1": {"limit_all_gathers": False}}),
        active_gib=25.86,
        reserved_gib=32.67,
        note=COOKBOOK_NOTE,
    ),
    PublishedMemoryRun(
        name="llama-recipes Llama-2-70B trained whole, pure bf16, full AC, 16 x A100-80GB (issue #120)",
        source=COOKBOOK_70B,
        tables=_cookbook_70b(),
        allocated_gib=42,
        active_gib=59,
        reserved_gib=63,
        whole_gib=True,
        note=COOKBOOK_70B_NOTE,
        measured_here_bytes=44_481_965_388,
        replayed_reserved_bytes=50_845_450_240,
    ),
    PublishedMemoryRun(
        name="the same with the recipe's AnyPrecisionAdamW (bf16 states, no Kahan summation; issue #120)",
        source=COOKBOOK_70B,
        tables={**_cookbook_70b(), "optimizer": {"name": "adamw", "implementation": "for-loop"}},
        allocated_gib=42,
        active_gib=52,
        reserved_gib=58,
        whole_gib=True,
        note=COOKBOOK_70B_NOTE,
    ),
]
NOT_PREDICTED = [
    "PR #165 (14.93 / 19.52 GB): a prototype per-parameter FSDP on 8 GPUs, not a released system",
]


def _error(predicted_gib: float, published: float, whole_gib: bool) -> float:
    """The relative error against a published figure; against [N, N + 1) where the source prints
    whole GiB rounded down (zero inside it)."""
    if whole_gib and published <= predicted_gib < published + 1:
        return 0.0
    reference = published + 1 if whole_gib and predicted_gib >= published + 1 else published
    return predicted_gib / reference - 1


def _shown(published: float, whole_gib: bool) -> str:
    return f"[{published:.0f}, {published + 1:.0f})" if whole_gib else f"{published:.2f}"


_SIMULATED: dict[tuple[str, str], SimResult] = {}


def _simulated(run: PublishedMemoryRun) -> SimResult:
    """The run's simulated step, once per run (keyed by its name and tables) for its row, its
    notes and the initialisation check."""
    key = (run.name, json.dumps(run.tables, sort_keys=True))
    if key not in _SIMULATED:
        _SIMULATED[key] = simulate(scenario_from_dict(run.tables, run.name, []))
    return _SIMULATED[key]


def _memory_row(run: PublishedMemoryRun) -> tuple[str, list[float]]:
    r = build_report(_simulated(run))
    allocated, active = r.peak_memory_bytes / GIB, r.peak_active_bytes / GIB
    reserved = r.peak_reserved_bytes / GIB
    whole = run.whole_gib
    errors = [_error(active, run.active_gib, whole), _error(reserved, run.reserved_gib, whole)]
    if run.allocated_gib is not None:
        errors.append(_error(allocated, run.allocated_gib, whole))
        published_allocated = f"{_shown(run.allocated_gib, whole)} | {errors[-1]:+.1%}"
    else:
        published_allocated = "— | —"
    here = (
        f"{run.measured_here_bytes / GIB:.2f} | {r.peak_memory_bytes / run.measured_here_bytes - 1:+.1%}"
        if run.measured_here_bytes is not None
        else "— | —"
    )
    return (
        f"| {run.name} | {allocated:.2f} | {here} | {published_allocated} | {active:.2f} | "
        f"{_shown(run.active_gib, whole)} | {errors[0]:+.1%} | {reserved:.2f} | {_shown(run.reserved_gib, whole)} | "
        f"{errors[1]:+.1%} |",
        errors,
    )


def active_peak_holdings(run: PublishedMemoryRun) -> tuple[str, dict[str, int]]:
    """What FSDP1's ``record_stream`` buffers hold at the caching allocator's active peak of rank 0
    (``sim.outputs.allocator.allocator_order``): bytes of flat gradients and of unsharded flat
    parameters; and the label of the request that makes the peak."""
    from sim.outputs.allocator import allocator_order

    result = _simulated(run)
    live: dict[str, int] = {}
    peak, held, at = 0, dict(live), ""
    for rec in allocator_order(list(result.events.memory_of(0))):
        live[rec.label] = live.get(rec.label, 0) + rec.delta_bytes
        if (total := sum(live.values())) > peak:
            peak, held, at = total, dict(live), rec.label
    kinds = ("flat_grad", "unsharded_flat_param")
    return at, {k: sum(v for label, v in held.items() if label.startswith(k + ":")) for k in kinds}


# NIC rates (Gb/s, each of the node's NICs) the 70B row's active peak is predicted at: from well
# below any training cluster's to the 400 Gb/s NICs of current ones; the source gives no network
NIC_RATES_GBPS = (6.25, 25.0, 100.0, 400.0)


def active_across_networks(run: PublishedMemoryRun, rates: tuple[float, ...] = NIC_RATES_GBPS) -> list[int]:
    """The run's predicted peak active bytes with each NIC rate of ``rates`` in place of its
    cluster's: how far the network it does not give can move that figure."""
    return [
        build_report(
            simulate(scenario_from_dict(run.tables, run.name, [f"cluster.nic_gbps={rate}"]))
        ).peak_active_bytes
        for rate in rates
    ]


def _here_against_published(run: PublishedMemoryRun) -> str:
    """The source's code run here against the source's allocated (else its active)."""
    assert run.measured_here_bytes is not None
    published = run.allocated_gib if run.allocated_gib is not None else run.active_gib
    return f"{_error(run.measured_here_bytes / GIB, published, run.whole_gib):+.1%}"


def _with_fsdp1_init(run: PublishedMemoryRun) -> tuple[int, int]:
    """The run's simulated peak reserved with FSDP1's initialisation in front, and without."""
    from validation.fsdp1_init import simulated_reserved_bytes

    result = _simulated(run)
    return (
        simulated_reserved_bytes(result, fsdp1_init=True)[1],
        simulated_reserved_bytes(result, fsdp1_init=False)[1],
    )


def _fsdp1_init_text(runs: list[PublishedMemoryRun]) -> str:
    pairs = [_with_fsdp1_init(r) for r in runs]
    apart = max(abs(a - b) for a, b in pairs) / GIB
    return (
        ", ".join(f"{a / GIB:.2f} against {b / GIB:.2f} GiB" for a, b in pairs)
        + f" (with, against without, the rows in order): at most {apart:.2f} GiB apart"
    )


def _against_real_sequence(runs: list[PublishedMemoryRun]) -> str:
    """The simulated peak reserved against the real sequence's replay, in the rows whose replay is
    the whole of their reserved (LoRA: no blocks held back for the device)."""
    pairs = [
        (build_report(_simulated(r)).peak_reserved_bytes, r.replayed_reserved_bytes)
        for r in runs
        if r.replayed_reserved_bytes and r.allocated_gib is None
    ]
    return (
        ", ".join(
            f"{predicted / GIB:.2f} against {replayed / GIB:.2f} GiB ({predicted / replayed - 1:+.1%})"
            for predicted, replayed in pairs
            if replayed
        )
        + " (predicted against the replay, the rows in order),"
    )


def memory_section(runs: list[PublishedMemoryRun] = MEMORY_RUNS) -> str:
    lines = [
        "### Peak memory (development set)",
        "",
        "Predicted peak allocated (what the kernels hold as the device runs them) against the published "
        "peak allocated and the source's own code run here; predicted peak active and reserved (the caching "
        "allocator's view: its requests in the order the host makes them, a block freed while another stream "
        "still uses it held until that stream passes, `sim/core/host_clock.py`; the allocator's model, "
        "`sim/outputs/allocator.py`) against the published active and reserved; GiB.",
        "",
        "| run | predicted allocated | the source's code run here | error | published allocated | error | "
        "predicted active | published active | error | predicted reserved | published reserved | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    errors: list[float] = []
    for run in runs:
        line, e = _memory_row(run)
        lines.append(line)
        errors += e
    worst = max(abs(e) for e in errors)
    lines += [
        "",
        f"Worst |error| {worst:.1%} (target {MEMORY_TARGET:.0%} where published: "
        f"{'met' if worst <= MEMORY_TARGET else 'NOT met'}).",
        "",
        _measured_here_paragraph(runs),
        "",
        _optimizer_pair_paragraph(runs),
        "",
        _replay_paragraph(runs),
        "",
        "Not predicted:",
        *[f"- {line}" for line in NOT_PREDICTED],
        "",
        "Sources and assumptions:",
        *sorted({f"- {run.source}; {run.note}" for run in runs}),
    ]
    return "\n".join(lines) + "\n"


def _measured_here_paragraph(runs: list[PublishedMemoryRun]) -> str:
    """How far the source's own code, run here, is from the published peaks, and what holds the
    70B row's active memory above its allocated."""
    here = [r for r in runs if r.measured_here_bytes is not None]
    whole = next(r for r in runs if r.allocated_gib is not None)  # the 70B row, foreach AdamW
    at, held = active_peak_holdings(whole)
    across = active_across_networks(whole)
    return (
        "The source's code run here: `python -m validation.legacy_transformers --memory-row N --site DIR` "
        "(DIR from `pip install --no-deps --target DIR transformers==4.31.0 huggingface-hub==0.16.4 "
        "tokenizers==0.13.3 peft==0.4.0`): that transformers' Llama and PEFT's LoRA under torch 2.13's FSDP1, "
        "one rank (of 4; of 16 in the 70B row) under the fake process group (storage bytes, the tracker of the FSDP1 runs). It is "
        + ", ".join(_here_against_published(r) for r in here)
        + " from the published allocated, else active (the rows in order; against [N, N + 1) where the "
        "source prints whole GiB): the allocations of that code reproduce the published peaks, so the "
        "remaining error is the simulator's. The third row's rate-limiter effect cannot be run here (the "
        "fake group's collectives return at once). The 70B row's active is 17 GiB above its allocated, "
        "which no allocated figure, the code run here included, reaches: FSDP1 frees its unsharded flat "
        "parameters and flat gradients with `record_stream` (the compute and post-backward streams), so a "
        "block the host has dropped stays active until the device gets there, and the host runs ahead of "
        "the device as far as the rate limiter and the launch queue let it (`LAUNCH_QUEUE_DEPTH`, "
        "`sim/schedule/emit.py`). The simulator's active peak of that row is at "
        f"`{at.split(':')[0]}` (the optimizer step's foreach temporaries), issued while the device "
        f"is still reducing the last units: {held['flat_grad'] / GIB:.2f} GiB of flat gradients and "
        f"{held['unsharded_flat_param'] / GIB:.2f} GiB of unsharded parameters held for the device (the "
        "source's 17 in all, on a network it does not give; the two nodes assumed AWS p4d). Nor does the "
        f"network close the gap: with each node's NICs at {_rates(NIC_RATES_GBPS)} Gb/s the row's "
        f"predicted active is {_gib_list(across)} GiB, against the published "
        f"[{whole.active_gib:.0f}, {whole.active_gib + 1:.0f}): the predicted figure stops growing as the "
        "network slows, and what holds the rest is not identified. The LoRA rows have "
        "almost no gradients to hold: their "
        "active is their allocated in the host's order, which the code run here measures."
    )


def _optimizer_pair_paragraph(runs: list[PublishedMemoryRun]) -> str:
    """The 70B rows with foreach AdamW and with the recipe's AnyPrecisionAdamW: what the source's
    figures and the simulator's each lose with the foreach temporaries."""
    foreach, loop = (r for r in runs if r.allocated_gib is not None)
    reports = [build_report(_simulated(r)) for r in (foreach, loop)]
    foreach_at, _ = active_peak_holdings(foreach)
    at, _ = active_peak_holdings(loop)
    temp = sum(optimizer_temp_pieces(_simulated(foreach).step)) / GIB
    active = [r.peak_active_bytes / GIB for r in reports]
    reserved = [r.peak_reserved_bytes / GIB for r in reports]
    return (
        f"The two 70B rows differ in the optimizer alone: with AnyPrecisionAdamW the source prints "
        f"{foreach.active_gib - loop.active_gib:.0f} GiB less active and "
        f"{foreach.reserved_gib - loop.reserved_gib:.0f} GiB less reserved (to a GiB either way, the figures "
        f"being rounded down), the foreach step's temporaries ({temp:.2f} GiB, one per flat parameter) gone. "
        f"The simulator's active falls by {active[0] - active[1]:.2f} GiB, to {active[1]:.2f}, its peak moving "
        f"from `{foreach_at.split(':')[0]}` (the optimizer step's first request) to `{at.split(':')[0]}` in the "
        f"backward of `{at.split(':')[1]}`, and its "
        f"reserved by {reserved[0] - reserved[1]:.2f} GiB (its reserved peak is in backward in both): so the "
        "GPU gave the foreach temporaries some new segments where the simulated step finds them cached "
        "holes, and the AnyPrecision run held more active blocks than the simulator's peak either at its "
        "optimizer step or in backward. The held blocks' shortfall is not the foreach step's."
    )


def _rates(rates: tuple[float, ...]) -> str:
    return ", ".join(f"{r:g}" for r in rates)


def _gib_list(values: list[int]) -> str:
    return ", ".join(f"{v / GIB:.2f}" for v in values)


def _replay_paragraph(runs: list[PublishedMemoryRun]) -> str:
    """The source's own allocation sequence through the allocator model, what was ruled out, and
    how the simulated step asks the allocator."""
    return (
        "The source's own allocations through the allocator model: `python -m validation.allocator_replay "
        "--memory-row N --site DIR` logs every storage that code allocates and frees in its step, in order "
        "(unsharded flat parameters on the unshard stream, `_reduce_grad`'s on the post-backward stream), and "
        "replays the log through `sim/outputs/allocator.py` with the two cuBLAS workspaces first (the forward's thread's and the autograd engine's, `CUBLAS_WORKSPACE_THREADS`). Its peak reserved: "
        + "; ".join(
            f"{r.replayed_reserved_bytes / GIB:.2f} GiB ({r.replayed_reserved_bytes / GIB / r.reserved_gib - 1:+.1%} "
            "from the published reserved)"
            for r in runs
            if r.replayed_reserved_bytes
        )
        + " (the rows in order, measured 2026-12-08; the 70B row's with its replayed allocated 41.43 GiB, the "
        "fake run's). The 70B row's replay is 25 % below its published reserved, as its allocated is 17 GiB "
        "below its published active: the blocks held back from reuse are not in any sequence the host logs "
        "(see that row's note). So the allocator model, fed the real sequence, reserves 7-11 % less than the "
        "GPU did in the LoRA rows; replaying the step two or three times changes nothing in either (measured 2026-12-04), so what it "
        "misses is not the step's own reuse; nor is it reuse deferred by `record_stream`: holding every free of the "
        "unshard and post-backward streams' blocks until up to three more unsharded flat parameters have been "
        "allocated (a host one to three units ahead) leaves the first row's replay where it was (17.34 GiB, "
        "measured 2026-12-04 with one cuBLAS workspace); nor the segments FSDP1's initialisation leaves cached: the simulated step after it "
        "(per unit each parameter moved to the GPU, the FlatParameter made and the parameters freed, the "
        "shard cloned out and the full one freed, then `empty_cache()` and the peak reset, as the recipe's "
        "`MemoryTrace` does; `validation/fsdp1_init.py`) reserves "
        + _fsdp1_init_text(runs)
        + "; nor the CUDA dropout kernel: with PEFT's LoRA dropout run as CUDA runs it (ATen's fused "
        "`native_dropout`, an output and a bool mask, where the CPU composite makes an fp32 noise tensor; "
        "in the first row 128 of the step's 128 MiB requests become 32 MiB ones) the replays stay where they were "
        "(17.34 and 25.34 GiB, measured 2026-12-04 with one cuBLAS workspace). The candidate left: allocations fake mode cannot see. "
        "How the simulated step asks the allocator: each segment's forward and backward in its ops' own "
        "order of requests (`SegmentFigures.forward_order` and `backward_order`, `sim/costs/request_order.py`): "
        "the tracer's allocations and frees of every storage, op by op (`hfmodel/trace.py`: a call's outputs "
        "made before what it was the last to read is dropped; what autograd saves kept, and released in "
        "backward where autograd drops it), the eager attention's s² tensors op by op "
        "(`sim/workload/eager_attention.py`), FSDP's buffers and the gradients where the schedule allocates "
        "them, each record on the stream that allocates it; and the steady state's step (the second of two, "
        "`sim.outputs.allocator.steady_state_replay`), which starts with the first step's segments and with "
        "the output that step kept where its requests put it. So asked, the simulated step reserves what "
        "the real sequence does: "
        + _against_real_sequence(runs)
        + " from the same large segments (five of 2 GiB and two of 1 GiB in the first row, nine and two in "
        "the second; counted 2026-12-04, `tests/test_allocator.py`). The error left in the LoRA rows is the "
        "allocator model's on the real sequence (above). Before (2026-12-04 too), a segment's saved tensors "
        "were asked for at its start, its transient as the tensors alive at its peak, all at once, and its "
        "backward's likewise: the rows reserved 18.32, 22.00, 27.69 and 54.78 GiB, the first row's agreement "
        "with the published figure partly a compensation (its eager backward's 2.12 GiB a block asked for as "
        "one tensor, which no 2 GiB hole takes: a segment the real sequence does not reserve) and the second "
        "row's six 2 GiB segments where the real sequence takes nine (the 64 MiB tensors the forward keeps, "
        "asked for between its ops' transients, split the holes the scores leave)."
    )
