"""The human summary ``fsdpsim run`` prints (GiB and milliseconds; the JSON keeps bytes and seconds)."""

from sim.core.events import MemoryCategory
from sim.outputs.display import gib, ms
from sim.outputs.report import COLLECTIVE_KINDS, StepReport


def _padding_lines(r: StepReport) -> list[str]:
    if r.padding is None:
        return []
    p = r.padding
    return [
        f"  padding       real tokens only: {p.avg_seq_len:,} of {p.seq_len:,} per sequence "
        f"({p.avg_seq_len / p.seq_len:.0%}); MFU includes the padding"
    ]


def _packing_lines(r: StepReport) -> list[str]:
    if r.packing is None:
        return []
    p = r.packing
    masked = (
        "SDPA given their block-diagonal mask"
        if p.document_mask
        else "no document mask (KV cache or transformers < 4.36): attention crosses them"
    )
    return [
        f"  packing       {p.seq_len / p.avg_doc_len:.1f} documents of {p.avg_doc_len:,} tokens per row, "
        f"positions restarting: {masked}"
    ]


ORIGINS = {
    "measured": "curve published for this part",
    "borrowed": "curve borrowed from its architecture family, scaled by matmul rate",
    "derived": "curve derived from the A100's by FlashAttention-2's speedup, an assumption",
    None: "no curve: timed as its matmuls and softmax",
}
KERNEL_NAMES = {"flash": "flash", "efficient": "memory-efficient attention", "cudnn": "cuDNN"}


def _attention_lines(r: StepReport) -> list[str]:
    """How the kernel model times attention: the calls SDPA is given a mask, and each curve's origin."""
    a = r.attention
    if a is None:
        return []

    def timed(kernel: str, how: str = "") -> str:
        return f"{KERNEL_NAMES.get(kernel, kernel)}{how}, {ORIGINS[a.curves.get(kernel)]}"

    unmasked = [f"attention     {timed(a.kernel)}"] if a.kernel in a.curves else []
    if not a.masked_calls or a.masked_kernel is None:
        return unmasked
    masked = (
        f"{a.masked_calls} of {a.calls} calls given a mask ({', '.join(a.masked_by)}): "
        f"{timed(a.masked_kernel, ' over every pair')}"
    )
    return [*unmasked, f"  {masked}"] if unmasked else [f"attention     {masked}"]


def _peak_text(r: StepReport) -> str:
    """Allocated, and on a GPU what the caching allocator reserves and what lies outside it."""
    if r.required_bytes == r.peak_memory_bytes:
        return gib(r.peak_memory_bytes)
    return (
        f"{gib(r.peak_memory_bytes)} allocated, {gib(r.peak_reserved_bytes)} reserved "
        f"+ {gib(r.device_overhead_bytes)} context and NCCL ="
        f" {gib(r.required_bytes)}"
    )


def _share(part_s: float, step_s: float) -> str:
    return f"{part_s / step_s:.0%}" if step_s > 0 else "-"


def _offload_lines(r: StepReport) -> list[str]:
    lines = []
    if r.host_memory_bytes or r.nvme_bytes:
        lines.append(
            f"offload       host {gib(r.host_memory_bytes)} per rank, NVMe {gib(r.nvme_bytes)} per rank"
        )
    if r.offload_bytes:
        moved = ", ".join(f"{k} {gib(v)}" for k, v in r.offload_bytes.items())
        lines.append(f"  moved per step: {moved}")
    z = r.zero_infinity
    if z:
        lines.append(
            f"ZeRO-Infinity working memory (paper's formulas): model-state {gib(z['model_state_working_memory_bytes'])}, "
            f"activation {gib(z['activation_working_memory_bytes'])}, checkpoints {gib(z['activation_checkpoint_bytes'])}"
        )
    return lines


def format_table(r: StepReport) -> str:
    b, step = r.breakdown, r.step_time_s
    lines = [
        f"scenario      {r.scenario}",
        f"model         {r.model} ({r.n_params:,} params)",
        f"parallel      {r.system} {r.strategy}, wrap={r.wrap} ({r.n_units} units), {r.world_size} ranks"
        if not r.system.startswith("DeepSpeed")
        else f"parallel      {r.system}, {r.world_size} ranks",
        f"profile       {r.profile}" + ("" if r.profile_calibrated else " (datasheet, not calibrated)"),
        *(
            [f"ranks drift   compute jitter {r.compute_jitter:.1%} per op and rank"]
            if r.compute_jitter
            else []
        ),
        "",
        f"step time     {ms(step)}",
        f"  compute       {ms(b.compute_s)} ({_share(b.compute_s, step)})",
        f"  exposed comm  {ms(b.exposed_comm_s)} ({_share(b.exposed_comm_s, step)})",
        f"  idle          {ms(b.idle_s)} ({_share(b.idle_s, step)})",
        f"throughput    {r.tokens_per_s:,.0f} tokens/s ({r.tokens_per_s_per_gpu:,.0f} per rank), "
        f"MFU {r.mfu:.1%} (HFU {r.hfu:.1%})",
        *_padding_lines(r),
        *_packing_lines(r),
        *_attention_lines(r),
        "",
        f"peak memory   {gib(r.peak_memory_bytes)} allocated, {gib(r.peak_active_bytes)} active, "
        f"{gib(r.peak_reserved_bytes)} reserved "
        f"+ {gib(r.device_overhead_bytes)} outside the allocator, of {gib(r.device_memory_bytes)} "
        f"on rank {r.peak_memory_rank}: "
        + ("fits" if r.fits else f"DOES NOT FIT by {gib(-r.memory_headroom_bytes)}"),
    ]
    lines += [f"  {c.value:<12}{gib(r.memory_at_peak[c]):>14}" for c in MemoryCategory]
    state = r.model_state
    lines += [
        f"model state   {gib(state.total)} per rank (params {gib(state.params)}, grads {gib(state.grads)}, "
        f"optimizer {gib(state.optimizer)})",
        f"  ZeRO-paper convention (2+2+12 B/param): {gib(r.model_state_bytes_deepspeed_convention)}",
        *_offload_lines(r),
        "",
        "collectives per step (rank 0):",
    ]
    for kind in COLLECTIVE_KINDS:
        t = r.collectives.get(kind)
        if t:
            lines.append(f"  {kind.value:<15}{t.count:>6} x, {gib(t.bytes)} total, {ms(t.time_s)}")
    return "\n".join(lines)
