"""The README's offload answers (its "FSDP2's CPU offload" block): the FSDP-QLoRA recipe of
Llama-2-70B on two RTX 3090s with FSDP1's CPU offload, and the offload-or-add-a-node sweep."""

from bench.answer_kit import ROOT, claim, n, para, peak_cell, report, result, scenario, t, table
from sim.core.events import OpKind
from sim.hardware.registry import load_profile
from sim.outputs.display import gib
from sim.outputs.report import StepReport
from sim.scenario.sections import Scenario
from sim.study.sweep.plan import make_plan
from sim.workload.options import CheckpointMode

QLORA, QLORA_OFFLOAD = (
    "scenarios/qlora-llama2-70b-2x3090.toml",
    "scenarios/qlora-llama2-70b-2x3090-offload.toml",
)
SWEEP_OFFLOAD = "scenarios/sweep-offload-7b.toml"


def _copies_s(path: str, stream: str) -> float:
    """Rank 0's time in offload copies on ``stream`` (``h2d`` / ``d2h``) per step."""
    ops = result(path).events.ops_of(0)
    return sum(o.duration_s for o in ops if o.kind is OpKind.OFFLOAD and o.stream.value == stream)


def qlora_offload() -> str:
    with_, without = report(QLORA_OFFLOAD), report(QLORA)
    host = next(o for o in result(QLORA_OFFLOAD).events.ops_of(0) if o.kind is OpKind.OPTIMIZER)
    rate = load_profile(scenario(QLORA_OFFLOAD).cluster.profile).node.cpu_torch_adamw_s_per_param
    assert rate is not None
    b = with_.breakdown
    unlimited = report(QLORA_OFFLOAD, "fsdp1.limit_all_gathers=false")
    prefetched = report(QLORA_OFFLOAD, "fsdp1.forward_prefetch=true")
    claim(
        unlimited.fits
        and unlimited.step_time_s < with_.step_time_s
        and unlimited.peak_memory_bytes > 1.5 * with_.peak_memory_bytes,
        "Without the limiter ... still fits",
    )
    claim(prefetched.fits and prefetched.step_time_s < with_.step_time_s, "forward_prefetch = true gives")
    claim(with_.fits and not without.fits, "with its CPU offload it fits (without, it does not)")
    claim(b.exposed_comm_s < 0.15 * with_.step_time_s, "most of the transfers hide behind the compute")
    return para(
        f"""**FSDP-QLoRA of Llama-2-70B on two RTX 3090s, as the recipe runs it** (`{QLORA_OFFLOAD}`,
        batch 2 × 512, rank 64, every block checkpointed; FSDP1 with `fsdp1.cpu_offload = true`,
        PEFT's wrap policy, no MixedPrecision): with its CPU offload it fits,
        {gib(with_.peak_memory_bytes)} allocated a card of {gib(with_.device_memory_bytes)} (without,
        `{QLORA}`: {gib(without.peak_memory_bytes)}, does not fit). Each rank keeps
        {gib(with_.host_memory_bytes)} of pinned host memory: its shard of the packed 4-bit base and
        the adapters' fp32 weights, gradients and AdamW states; the card keeps the quantization
        state, one block's gathered weights, the adapters' gradient shards until the backward ends,
        and the checkpoints. A step takes {t(with_.step_time_s, 0)} ({n(with_.tokens_per_s)} tokens/s
        for both cards): compute {t(b.compute_s, 0)}; over PCIe {gib(with_.offload_bytes["h2d"])}
        in (every flat parameter's shard before each of its all-gathers) and
        {gib(with_.offload_bytes["d2h"])} of gradients out a rank,
        {t(_copies_s(QLORA_OFFLOAD, "h2d"), 0)} and {t(_copies_s(QLORA_OFFLOAD, "d2h"), 0)} at the
        datasheet's PCIe 4.0 ×16, mostly behind the compute. {t(b.exposed_comm_s, 0)} of
        communication is exposed, the blocks' all-gathers, in forward and in backward alike: FSDP1
        counts each of the 960 adapter units as a unit: its rate limiter holds the host, before each
        all-gather, until the unit freed two frees earlier is freed, which for a block is the
        previous block's last adapter, near that block's end; and backward prefetch targets the
        unit that ran just before in forward, the block's own last adapter, so the block before it
        is gathered only when the block's first adapter starts its backward. Without the
        limiter the step takes {t(unlimited.step_time_s, 0)} but the host runs ahead, as far as the
        launch queue's thousand kernels let it, and the all-gathers with it:
        {gib(unlimited.peak_memory_bytes)} allocated a card, {gib(unlimited.peak_reserved_bytes)}
        reserved, which still fits;
        `fsdp1.forward_prefetch = true` gives {t(prefetched.step_time_s, 0)} at
        {gib(prefetched.peak_memory_bytes)}.        Then torch's AdamW over the rank's
        {host.duration_s / rate / 1e6:.0f}M adapter parameters on the CPU takes
        {t(host.duration_s, 0)} at this VM's measured {rate * 1e9:.1f} ns per parameter (one core a
        rank), the step's {t(b.idle_s, 0)} of GPU idle. The CPU step is the host's: on a host with
        more cores per GPU it shrinks accordingly (`fsdpsim calibrate host` measures it)."""
    )


def _sets(point: tuple[tuple[str, object], ...]) -> tuple[str, ...]:
    """A sweep point as ``--set`` strings."""

    def toml(v: object) -> str:
        return str(v).lower() if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else str(v)

    return tuple(f"{k}={toml(v)}" for k, v in point)


def _offload_system(r: StepReport, s: Scenario) -> str:
    nodes = s.parallel.world_size // s.gpus_per_node
    what = f"{r.system} on {s.parallel.world_size} GPUs ({nodes} node{'s' if nodes > 1 else ''})"
    if s.parallel.cpu_offload:
        return what + ", `CPUOffloadPolicy`"
    if s.fsdp1.cpu_offload:
        return what + ", `CPUOffload`"
    if s.deepspeed.enabled and s.deepspeed.offload_optimizer.value != "none":
        return what + ", `offload_optimizer` cpu"
    return what + (", checkpointing" if s.checkpointing.mode is not CheckpointMode.NONE else "")


def offload_sweep() -> str:
    plan = make_plan(str(ROOT / SWEEP_OFFLOAD), [], [], False)
    points = [_sets(p) for p in plan.points]
    reports = [report(SWEEP_OFFLOAD, *sets) for sets in points]
    base, fsdp2, fsdp1, zero2, zero3, node, ckpt = reports
    rows = [
        [
            _offload_system(r, scenario(SWEEP_OFFLOAD, *sets)),
            t(r.step_time_s),
            n(r.tokens_per_s_per_gpu),
            peak_cell(r),
            gib(r.host_memory_bytes),
        ]
        for r, sets in zip(reports, points, strict=True)
    ]
    claim(not base.fits and all(r.fits for r in reports[1:]), "does not fit; every other point fits")
    claim(
        min(node.step_time_s, ckpt.step_time_s) < min(r.step_time_s for r in (fsdp2, fsdp1, zero2, zero3)),
        "a second node or checkpointing is faster than any offload",
    )
    claim(
        max(zero2.step_time_s, zero3.step_time_s) < min(fsdp2.step_time_s, fsdp1.step_time_s),
        "DeepSpeed's CPU Adam beats torch's AdamW",
    )
    head = para(
        f"""**Offload or add a node? Llama-2-7B on two H100s** (`{SWEEP_OFFLOAD}`, micro-batch 2 × 4096,
        bf16, AdamW; `fsdpsim sweep` on the file):"""
    )
    prose = para(
        f"""FSDP2 alone needs {gib(base.peak_memory_bytes)} a GPU. Every offload fits by moving the
        {gib(fsdp2.host_memory_bytes)} of fp32 state a rank holds to the host, but the optimizer then
        runs on the CPU: torch's AdamW (FSDP2's `CPUOffloadPolicy`, FSDP1's `CPUOffload`) makes the
        step {fsdp2.step_time_s / node.step_time_s:.0f}× that of a second node, DeepSpeed's CPU Adam
        {zero3.step_time_s / node.step_time_s:.0f}× (this VM's host, one core a rank; on a host with more cores
        a GPU both shrink). A second node ({t(node.step_time_s)}) or checkpointing every block
        ({t(ckpt.step_time_s)}) is the answer here."""
    )
    return "\n\n".join(
        [head, table(["system", "step", "tokens/s per GPU", "peak", "host memory per rank"], rows), prose]
    )


def offload_section() -> str:
    return "\n\n".join([qlora_offload(), offload_sweep()])
