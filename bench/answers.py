"""The README's answers, recomputed: every figure of "Scenarios and their answers" and of the
``fsdpsim sweep`` and ``fsdpsim tune`` examples, from the simulator's Python API, as the README's
markdown (memory in GiB, times in ms).

    python -m bench.answers            # print the generated text
    python -m bench.answers --write    # rewrite it in README.md, between the answers markers

The README holds the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` for each
NAME of ``BLOCKS``; ``tests/test_readme_answers.py`` fails when the two differ. Sentences that
interpret the figures ("... fits", "... costs almost nothing") are checked with ``claim``: when a
change to the cost model makes one false, generation stops and names it, so that it is rewritten
here instead of left wrong in the README. The seed documents' own figures are quoted as they give
them, in GB (10^9 B).
"""

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from bench.answer_kit import (
    NODE_7B,
    README,
    SCALEOUT,
    claim,
    collective_s,
    layer_op,
    n,
    op_seconds,
    para,
    pct,
    peak_cell,
    report,
    result,
    scenario,
    t,
    table,
    world_busbw,
)
from bench.answers_offload import offload_section
from bench.answers_tools import sweep_example, tune_example
from sim.core.events import MemoryCategory, OpKind
from sim.costs.compute import OPTIMIZER_BYTES_PER_ELEMENT
from sim.fileio import write_text_atomic
from sim.outputs.display import gib
from sim.outputs.memory_curve import memory_curve
from sim.outputs.report import StepReport
from sim.scenario.sections import Scenario
from sim.workload.options import OptimizerName, Strategy

SEED_7B = "scenarios/seed-7b-model-state.toml"
DS_ZERO2 = ("deepspeed.enabled=true", "deepspeed.stage=2")
DS_ZERO3 = ("deepspeed.enabled=true", "deepspeed.stage=3")
SEED_CKPT = "scenarios/seed-llama-7b-4gpu-zero3-ckpt.toml"
SFT, GRPO = "scenarios/sft-vs-grpo-7b.toml", "scenarios/grpo-7b.toml"
PACKING = "scenarios/packing-vs-padding-7b.toml"
WRAP = "scenarios/wrap-granularity-llama2-7b.toml"
SLOW = "scenarios/slow-rank-7b.toml"
SEED_ESTIMATE_BYTES = 62e9  # the seed's "~62 GB" for the 4-GPU, micro-batch 32 run


# ---- "Scenarios and their answers" ----


def intro() -> str:
    return para(
        """Figures from `fsdpsim run` on the datasheet profiles (not calibrated), memory in GiB and
        times in ms; the seed documents' own figures are quoted as they give them, in GB (10⁹ B).
        `python -m bench.answers --write` regenerates them; the commands shown give each one."""
    )


def seed_model_state() -> str:
    rows = (
        ("DDP (NO_SHARD)", "112 GB", ("parallel.strategy=NO_SHARD",), ("parallel.strategy=NO_SHARD",)),
        ("ZeRO-2 (SHARD_GRAD_OP)", "38.5 GB", ("parallel.strategy=SHARD_GRAD_OP",), DS_ZERO2),
        ("ZeRO-3 (FULL_SHARD)", "28 GB", (), DS_ZERO3),
    )
    zero2, zero3 = report(SEED_7B, *rows[1][2]), report(SEED_7B, *rows[2][2])
    ds2, ds3 = report(SEED_7B, *DS_ZERO2), report(SEED_7B, *DS_ZERO3)
    s = scenario(SEED_7B)
    k, phi = s.parallel.world_size, zero3.n_params
    text = (
        "FSDP2 keeps fp32 master parameters and fp32 sharded gradients, so its persistent state is "
        "16 B/param divided by the shard group for both ZeRO-2 and ZeRO-3"
    )
    claim(zero2.model_state.total == zero3.model_state.total, text)
    claim(abs(zero3.model_state.total / (16 * zero3.n_params / k) - 1) < 0.01, text)
    claim(zero2.peak_memory_bytes > zero3.peak_memory_bytes, "what ZeRO-2 adds ... show up in the peak")
    at_7b = [round(r.model_state.total * 7e9 / phi / 1e9, 1) for r in (ds2, ds3)]
    claim(at_7b == [38.5, 28.0], "the ZeRO-2 and ZeRO-3 schedules give the seeds' 38.5 and 28 GB at 7e9")
    head = para(
        f"""**The seed documents' 7B model-state table** (`{SEED_7B}`, {k} GPUs,
        `--set parallel.strategy=...`; DeepSpeed: `--set deepspeed.enabled=true --set
        deepspeed.stage=2|3`). The seeds count 7e9 × (2 + 2 + 12) B. The DeepSpeed ZeRO-2 and
        ZeRO-3 schedules allocate exactly that (bf16 parameters whole or partitioned, bf16 gradient
        partitions, fp32 master and AdamW states partitioned): {gib(ds2.model_state.total)} and
        {gib(ds3.model_state.total)} at Φ = {phi / 1e9:.2f}e9, which is {at_7b[0]} GB and
        {at_7b[1]} GB at 7e9. {text}; what ZeRO-2 adds is the unsharded bf16 parameters kept from
        forward to the end of backward, which show up in the peak, not in the model state."""
    )
    header = (
        "strategy",
        "seed (Φ = 7e9, the seeds' GB)",
        f"ZeRO convention, Φ = {phi / 1e9:.2f}e9",
        "DeepSpeed schedule's model state",
        "FSDP2 model state",
        f"FSDP2 peak (mb {s.training.micro_batch}, seq {s.training.seq_len})",
    )
    body = []
    for label, seed, sets, ds_sets in rows:
        r, ds = report(SEED_7B, *sets), report(SEED_7B, *ds_sets)
        body.append(
            (
                label,
                seed,
                gib(r.model_state_bytes_deepspeed_convention),
                gib(ds.model_state.total) + ("" if ds.system.startswith("DeepSpeed") else " (DDP)"),
                gib(r.model_state.total),
                gib(r.peak_memory_bytes),
            )
        )
    return head + "\n\n" + table(header, body)


def _peak_starts_backward(path: str, *sets: str) -> str | None:
    """The name of the first backward op when rank 0's peak is reached as it starts, else None."""
    r = result(path, *sets)
    curve = memory_curve(r.events, 0)
    backward = next(o for o in r.events.ops_of(0) if o.kind is OpKind.BACKWARD)
    return backward.name if curve.times_s[curve.peak_index()] == backward.start_s else None


def seed_checkpointing() -> str:
    s, r, r16 = scenario(SEED_CKPT), report(SEED_CKPT), report(SEED_CKPT, "training.micro_batch=16")
    m, t_ = s.model, s.training
    tokens = t_.micro_batch * t_.seq_len
    claim(s.param_dtype == "bf16", "block inputs: ... × 2 B (bf16)")
    blocks = m.n_layers * tokens * m.hidden * 2  # the checkpointed input of every decoder block
    log_softmax, grads = tokens * m.vocab * 4, 2 * tokens * m.vocab * 4
    loss, norm = layer_op(SEED_CKPT, "loss"), layer_op(SEED_CKPT, "model.norm")
    claim(abs(loss.saved_bytes / log_softmax - 1) < 1e-3, "the fp32 log-softmax the cross-entropy saves")
    claim(loss.backward_transient_bytes == grads, "the two fp32 logits-sized gradients of its backward")
    first_backward = _peak_starts_backward(SEED_CKPT) or ""
    claim(first_backward.endswith("loss"), "The peak is at the start of backward, in the loss")
    at_peak = r.memory_at_peak
    claim(at_peak[MemoryCategory.OTHER] >= grads, "... holds there: ... the two fp32 gradients")
    claim(
        at_peak[MemoryCategory.ACTIVATIONS] >= blocks + loss.saved_bytes + norm.saved_bytes,
        "... holds there: the block inputs, the log-softmax, the final norm's saved tensors",
    )
    claim(not r.fits and r16.fits, "it does not fit ...; Micro-batch 16 fits")
    claim(r.model_state.params == r.model_state.grads, "FSDP2 keeps fp32 (... each)")
    claim(log_softmax + grads > 0.5 * (r.peak_memory_bytes - SEED_ESTIMATE_BYTES), "remove most of the gap")
    return para(
        f"""**LLaMA-7B, FULL_SHARD on {s.parallel.world_size} GPUs, bf16, checkpointing, micro-batch
        {t_.micro_batch}, seq {t_.seq_len}** (`{SEED_CKPT}`). The seed estimate is ~62 GB (3.5
        params + 3.5 grads + 21 optimizer + 0.44 gathered layer + 34 checkpointed activations, the
        seed's GB). The simulator agrees on the {gib(blocks)} of block inputs ({m.n_layers} layers ×
        {t_.micro_batch} × {t_.seq_len} × {m.hidden} × 2 B) and on the optimizer state, but predicts
        a peak of **{gib(r.peak_memory_bytes)}: it does not fit an H100's
        {gib(r.device_memory_bytes)}**. The peak is at the start of backward, in the loss, and the
        seed formula leaves out what HF's `LlamaForCausalLM` holds there: the fp32 log-softmax the
        cross-entropy saves ({n(tokens)} tokens × {n(m.vocab)} × 4 B = {gib(log_softmax)}), the two
        fp32 logits-sized gradients of its backward ({gib(grads)}), and the final norm's saved
        tensors ({gib(norm.saved_bytes)}); it also counts the sharded parameters and gradients in
        bf16 where FSDP2 keeps fp32 ({gib(r.model_state.params)} each instead of the seed's 3.5 GB).
        Micro-batch 16 fits ({gib(r16.peak_memory_bytes)}, `--set training.micro_batch=16`); a
        chunked or fused cross-entropy would remove most of the gap."""
    )


NODE_ROWS = (
    ("DDP", ("parallel.strategy=NO_SHARD",), "100 % / 28 GB"),
    ("ZeRO-2", ("parallel.strategy=SHARD_GRAD_OP",), "92 % / 18 GB"),
    ("ZeRO-3", (), "77 % / 4 GB"),
    ("ZeRO-3 + checkpointing", ("checkpointing.mode=full",), "62 % / 3 GB"),
)


def node_strategies() -> str:
    s = scenario(NODE_7B)
    zero3 = report(NODE_7B)
    rows = []
    for label, sets, seed in NODE_ROWS:
        r = report(NODE_7B, *sets)
        rel = r.tokens_per_s_per_gpu / zero3.tokens_per_s_per_gpu
        rows.append((label, t(r.step_time_s), n(r.tokens_per_s_per_gpu), pct(rel, 0), peak_cell(r), seed))
    head = (
        f"**Llama-2-7B on {s.parallel.world_size}×H100** (`{NODE_7B}`, micro-batch "
        f"{s.training.micro_batch}, seq {s.training.seq_len}):"
    )
    header = (
        "strategy",
        "step",
        "tokens/s per GPU",
        "relative",
        "peak memory",
        "seed (throughput / memory, the seeds' GB)",
    )
    return head + "\n\n" + table(header, rows) + "\n\n" + node_prose()


def node_prose() -> str:
    ddp, zero2, zero3 = (report(NODE_7B, *row[1]) for row in NODE_ROWS[:3])
    ckpt = report(NODE_7B, *NODE_ROWS[3][1])
    ag = zero3.collectives[OpKind.ALL_GATHER]
    ar = ddp.collectives[OpKind.ALL_REDUCE]
    zero3_cost = zero3.step_time_s / zero2.step_time_s - 1
    ddp_cost = ddp.step_time_s / zero3.step_time_s - 1
    opt_ddp = op_seconds(NODE_7B, OpKind.OPTIMIZER, *NODE_ROWS[0][1])
    opt_zero3 = op_seconds(NODE_7B, OpKind.OPTIMIZER)
    recompute = ckpt.breakdown.compute_s / zero3.breakdown.compute_s - 1
    claim(zero3.breakdown.exposed_comm_s < 0.02 * zero3.step_time_s, "the all-gathers hide behind compute")
    claim(0 <= zero3_cost < 0.02, "ZeRO-3 costs almost nothing over ZeRO-2")
    claim(0 < ddp_cost < 0.1 and ddp.step_time_s > zero2.step_time_s, "DDP is slightly *slower*")
    claim(ddp.step_time_s - zero3.step_time_s <= opt_ddp - opt_zero3, "slower because its optimizer ...")
    claim(
        ddp.breakdown.exposed_comm_s <= zero3.breakdown.exposed_comm_s + 1e-3,
        "its all-reduce ... hides behind the backward",
    )
    claim(0.25 < recompute < 0.4, "the recomputation (one extra forward, ≈ 1/3 of the compute)")
    adamw = OPTIMIZER_BYTES_PER_ELEMENT[OptimizerName.ADAMW]
    return para(
        f"""Where the seeds differ: within one NVLink node the {ag.count} all-gathers
        ({t(ag.time_s, 0)} per step in all, about {t(ag.time_s / ag.count, 1)} each) hide behind
        compute ({t(zero3.breakdown.exposed_comm_s)} exposed), so ZeRO-3 costs almost nothing over
        ZeRO-2 ({pct(zero3_cost, sign=True)}), and DDP is slightly *slower*
        ({pct(ddp_cost, sign=True)}) because its optimizer updates all
        {ddp.n_params / 1e9:.1f} B parameters on every GPU (AdamW at {adamw} B/param ≈
        {t(opt_ddp, 0)}, against {t(opt_zero3, 0)} for a ZeRO-3 shard); its all-reduce of
        {gib(ar.bytes)} of fp32 gradients hides behind the backward
        ({t(ddp.breakdown.exposed_comm_s)} exposed). The seeds' memory figures (28/18/4/3 GB, the
        seeds' GB) cannot be peak memory: DDP alone holds 16 B/param = {gib(ddp.model_state.total)}
        of model state, so they are at best model state for a different setting. Checkpointing costs
        the recomputation (one extra forward: {pct(recompute, 0, sign=True)} compute). These figures
        use the datasheet profile; the strategy ranking inside a node depends mostly on the compute
        efficiency assumed, which calibration replaces."""
    )


def sft_vs_grpo() -> str:
    sft_s, grpo_s = scenario(SFT), scenario(GRPO)

    def sequences(s: Scenario) -> int:
        return s.training.micro_batch * s.training.grad_accum * s.parallel.world_size

    group = sequences(grpo_s) // sequences(sft_s)
    sft, grpo = report(SFT), report(GRPO)
    act = MemoryCategory.ACTIVATIONS
    slower = grpo.step_time_s / sft.step_time_s
    claim(slower < group, "(×...; the optimizer step is paid once)")
    return para(
        f"""**SFT against GRPO** (`{SFT}`, `{GRPO}`; Llama-2-7B, 8×H100, FULL_SHARD, bf16). GRPO's
        G = {group} responses per prompt turn {sequences(sft_s)} prompts into {sequences(grpo_s)}
        sequences per step (the files express it as micro-batch
        ×{grpo_s.training.micro_batch // sft_s.training.micro_batch} and gradient accumulation
        ×{grpo_s.training.grad_accum // sft_s.training.grad_accum}). SFT: {t(sft.step_time_s)},
        {n(sft.tokens_per_s)} tokens/s, peak {gib(sft.peak_memory_bytes)}
        ({gib(sft.memory_at_peak[act])} activations). GRPO: {t(grpo.step_time_s)} (×{slower:.1f};
        the optimizer step is paid once), {n(grpo.tokens_per_s)} tokens/s, peak
        {gib(grpo.peak_memory_bytes)} ({gib(grpo.memory_at_peak[act])} activations,
        ×{grpo.memory_at_peak[act] / sft.memory_at_peak[act]:.2f}). Generation and the reference
        model's forward pass are not included."""
    )


def packing() -> str:
    packed_sets = ("training.micro_batch=1", "training.avg_seq_len=2048")
    s, padded, packed = scenario(PACKING), report(PACKING), report(PACKING, *packed_sets)
    claim(padded.tokens_per_step == packed.tokens_per_step, "the same real tokens per step")
    t_ = s.training
    return para(
        f"""**Packing against padding** (`{PACKING}`; the same real tokens per step). Padded,
        {t_.micro_batch} rows of {n(t_.seq_len)} tokens with {t_.avg_seq_len} real each:
        {t(padded.step_time_s)}, {n(padded.tokens_per_s)} useful tokens/s, peak
        {gib(padded.peak_memory_bytes)}. Packed (`--set {packed_sets[0]} --set {packed_sets[1]}`):
        {t(packed.step_time_s)}, {n(packed.tokens_per_s)} tokens/s
        (×{packed.tokens_per_s / padded.tokens_per_s:.1f}), peak {gib(packed.peak_memory_bytes)}.
        Packing is charged attention across document boundaries, so its figure is conservative."""
    )


def _gathers(r: StepReport) -> str:
    count = r.collectives[OpKind.ALL_GATHER].count
    units = r.n_units - 1  # all but the root, gathered in forward and again in backward
    if units == 0:
        return str(count)
    claim(count == 2 * units + 1, "all-gathers = 2 × units + 1 (the root once)")
    return f"{count} (2×{units}+1)"


def wrap_granularity() -> str:
    s = scenario(WRAP)
    wraps = ("model", "block", "linear")
    reports = {w: report(WRAP, f"parallel.wrap={w}") for w in wraps}
    rows = [
        (
            w,
            _gathers(r),
            str(r.collectives[OpKind.REDUCE_SCATTER].count),
            t(r.step_time_s),
            t(r.breakdown.exposed_comm_s),
            gib(r.peak_memory_bytes),
        )
        for w, r in reports.items()
    ]
    model, block, linear = (reports[w] for w in wraps)
    claim(
        model.breakdown.exposed_comm_s >= model.collectives[OpKind.ALL_GATHER].time_s,
        "Model wrap cannot overlap its single all-gather with compute",
    )
    claim(
        model.memory_at_peak[MemoryCategory.PARAMS] >= model.n_params * 2,
        "Model wrap ... holds the whole gathered model",
    )
    claim(
        collective_s(linear) > collective_s(block)
        and linear.breakdown.exposed_comm_s <= block.breakdown.exposed_comm_s,
        "linear wrap's extra latency ... stays hidden",
    )
    head = para(
        f"""**Wrap granularity** (`{WRAP}`, micro-batch {s.training.micro_batch}, seq
        {s.training.seq_len}, `--set parallel.wrap=...`):"""
    )
    tail = para(
        f"""Model wrap cannot overlap its single all-gather with compute and holds the whole gathered
        model; linear wrap's extra latency ({t(collective_s(linear), 0)} of collectives against
        {t(collective_s(block), 0)} for block) stays hidden."""
    )
    header = ("wrap", "all-gathers", "reduce-scatters", "step", "exposed comm", "peak")
    return head + "\n\n" + table(header, rows) + "\n\n" + tail


SCALEOUT_ROWS = (
    ("parallel.strategy=FULL_SHARD",),
    ("parallel.world_size=1024",),
    ("parallel.world_size=1024", "parallel.strategy=HYBRID_SHARD"),
    ("parallel.world_size=1024", "parallel.strategy=HYBRID_SHARD", "parallel.shard_group_size=32"),
    ("parallel.world_size=1024", "parallel.strategy=HYBRID_SHARD", "parallel.shard_group_size=64"),
)


def _scaleout_label(s: Scenario) -> str:
    ranks = f"{s.parallel.world_size:,} ranks"
    if s.parallel.strategy is not Strategy.HYBRID_SHARD:
        return f"{s.parallel.strategy.value}, {ranks}"
    g = s.shard_group_size
    node = " (one node)" if g == s.gpus_per_node else ""
    return f"HYBRID_SHARD, shard {g}{node}, {ranks}"


def scale_out() -> str:
    base = scenario(SCALEOUT)
    rows = []
    for sets in SCALEOUT_ROWS:
        r = report(SCALEOUT, *sets)
        rows.append(
            (
                _scaleout_label(scenario(SCALEOUT, *sets)),
                n(r.tokens_per_s_per_gpu),
                t(r.step_time_s, 0),
                t(r.breakdown.exposed_comm_s, 0),
                peak_cell(r, model_state=True),
            )
        )
    head = para(
        f"""**Scale-out, Llama-3-70B on 64 to 1,024 H100s** (`{SCALEOUT}`; {n(base.training.seq_len)}
        tokens per rank, checkpointing, `--set parallel.world_size=... --set
        parallel.strategy=...`):"""
    )
    header = ("configuration", "tokens/s per GPU", "step", "exposed comm", "peak")
    return head + "\n\n" + table(header, rows) + "\n\n" + scale_out_prose()


def scale_out_prose() -> str:
    fs64, fs, node = (report(SCALEOUT, *sets) for sets in SCALEOUT_ROWS[:3])
    flat = fs.tokens_per_s_per_gpu / fs64.tokens_per_s_per_gpu - 1
    at_scale = [(report(SCALEOUT, *sets), scenario(SCALEOUT, *sets)) for sets in SCALEOUT_ROWS[1:]]
    best, best_s = min(((r, s) for r, s in at_scale if r.fits), key=lambda rs: rs[0].step_time_s)
    ring = world_busbw(SCALEOUT, "parallel.world_size=1024")
    claim(abs(flat) < 0.05, "FULL_SHARD keeps its per-GPU throughput nearly flat")
    claim(fs.breakdown.exposed_comm_s < 0.02 * fs.step_time_s, "its collectives hide behind compute")
    claim(not node.fits, "sharding within a node does not fit")
    gain = best.tokens_per_s_per_gpu / fs.tokens_per_s_per_gpu - 1
    claim(abs(gain) < 0.02, "within ... of FULL_SHARD")
    return para(
        f"""FULL_SHARD keeps its per-GPU throughput nearly flat ({pct(flat)}): a step of 70B with
        full checkpointing at {n(scenario(SCALEOUT).training.seq_len)} tokens is long enough that
        its all-gathers and reduce-scatters, rings over all eight NICs of each node (NCCL's model
        gives a 1 GiB all-gather over the 1,024 ranks {ring / 1e9:.0f} GB/s bus bandwidth, its 1,023
        steps included), hide behind compute ({t(fs.breakdown.exposed_comm_s, 0)} exposed).
        Sharding within a node does not fit; the fastest configuration that fits at 1,024 ranks is
        {_scaleout_label(best_s)}, {pct(gain, sign=True)} against FULL_SHARD."""
    )


def slow_rank() -> str:
    s = scenario(SLOW)
    slow, healthy = report(SLOW), report(SLOW, "simulation.slow_rank_factor=1.0")
    sim = s.simulation
    assert sim.slow_rank is not None
    fast = next(f for f in slow.per_rank if f.rank != sim.slow_rank).breakdown
    claim(healthy.breakdown.idle_s < 5e-5, "rises from (exposed only, no idle when healthy)")
    claim(fast.exposed_comm_s > healthy.breakdown.exposed_comm_s, "rises from ... to ...")
    return para(
        f"""**A slow rank** (`{SLOW}`, rank {sim.slow_rank} computes
        {pct(sim.slow_rank_factor - 1, 0)} slower, jitter off): {t(slow.step_time_s)} against
        {t(healthy.step_time_s)} healthy ({pct(slow.step_time_s / healthy.step_time_s - 1, sign=True)});
        on the fast ranks the time spent in collectives waiting for rank {sim.slow_rank} rises from
        {t(healthy.breakdown.exposed_comm_s)} to {t(fast.exposed_comm_s)} exposed plus
        {t(fast.idle_s)} idle."""
    )


SECTIONS: tuple[Callable[[], str], ...] = (
    intro,
    seed_model_state,
    seed_checkpointing,
    node_strategies,
    sft_vs_grpo,
    packing,
    wrap_granularity,
    scale_out,
    slow_rank,
)


def scenarios_section() -> str:
    return "\n\n".join(section() for section in SECTIONS)


# ---- FSDP2's CPU offload (README "FSDP2's CPU offload") ----

# ---- the README ----


BLOCKS: dict[str, Callable[[], str]] = {
    "answers": scenarios_section,  # README "## Scenarios and their answers"
    "answers:sweep": sweep_example,  # README "fsdpsim sweep": the scenarios/sweep-7b-strategies.toml example
    "answers:tune": tune_example,  # README "fsdpsim tune": the examples
    "answers:offload": offload_section,  # README "FSDP2's CPU offload": the QLoRA recipe and the sweep
}
"""Each README marker name and the function that writes the text between its markers."""


def generate() -> dict[str, str]:
    """The text between each pair of README markers, by marker name."""
    return {name: block() for name, block in BLOCKS.items()}


def _span(text: str, name: str) -> tuple[int, int]:
    """Where the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` lies (its own
    lines: the newline after the begin marker and the one before the end marker excluded)."""
    begin, end = f"<!-- {name}:begin -->\n", f"\n<!-- {name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"README.md needs exactly one {begin.strip()} ... {end.strip()} pair, in that order")
    return text.index(begin) + len(begin), text.index(end)


def between(text: str, name: str) -> str:
    start, stop = _span(text, name)
    return text[start:stop]


def splice(text: str, blocks: dict[str, str]) -> str:
    for name, body in blocks.items():
        start, stop = _span(text, name)
        text = text[:start] + body + text[stop:]
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.answers", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--write", action="store_true", help="rewrite the text between the markers in README.md"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    blocks = generate()
    elapsed = time.perf_counter() - start
    if not args.write:
        for name, body in blocks.items():
            print(f"<!-- {name}:begin -->\n{body}\n<!-- {name}:end -->\n")
    else:
        old = README.read_text()
        new = splice(old, blocks)
        if new == old:
            print(f"{README.name}: up to date")
        else:
            write_text_atomic(README, new)
            changed = [name for name, body in blocks.items() if between(old, name) != body]
            print(f"{README.name}: rewrote {', '.join(changed)}")
    print(f"generated in {elapsed:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
