"""The README's answers about the shape of the training workload (in its "Scenarios and their
answers" block): SFT against GRPO's G responses per prompt, and packed sequences against padded
ones at the same real tokens per step."""

from bench.answer_kit import claim, n, para, report, scenario, t
from sim.core.events import MemoryCategory
from sim.outputs.display import gib
from sim.scenario.sections import Scenario

SFT, GRPO = "scenarios/sft-vs-grpo-7b.toml", "scenarios/grpo-7b.toml"
PACKING = "scenarios/packing-vs-padding-7b.toml"


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
    t_ = s.training
    assert t_.avg_seq_len is not None
    doc_set = f"training.avg_doc_len={t_.avg_seq_len}"  # the padded rows' documents, packed
    documents = report(PACKING, *packed_sets, doc_set)
    claim(
        padded.tokens_per_step == packed.tokens_per_step == documents.tokens_per_step,
        "the same real tokens per step",
    )
    claim(packed.step_time_s < documents.step_time_s < padded.step_time_s, "between the two")
    return para(
        f"""**Packing against padding** (`{PACKING}`; the same real tokens per step). Padded,
        {t_.micro_batch} rows of {n(t_.seq_len)} tokens with {t_.avg_seq_len} real each:
        {t(padded.step_time_s)}, {n(padded.tokens_per_s)} useful tokens/s, peak
        {gib(padded.peak_memory_bytes)} (the collator's padding mask sends SDPA to memory-efficient
        attention over every pair, and each layer keeps a converted mask). Packed into one row,
        its documents concatenated (`--set {packed_sets[0]} --set {packed_sets[1]}`):
        {t(packed.step_time_s)}, {n(packed.tokens_per_s)} tokens/s
        (×{packed.tokens_per_s / padded.tokens_per_s:.1f}), peak {gib(packed.peak_memory_bytes)};
        its attention crosses the documents (flash's causal flag over the whole row). Packed with
        positions restarting at each document, as `DataCollatorWithFlattening` passes them (`--set
        {doc_set}` as well): transformers gives SDPA the documents' block-diagonal mask, so
        attention stays within each document but runs memory-efficient over every pair of the
        row: {t(documents.step_time_s)}, {n(documents.tokens_per_s)} tokens/s
        (×{documents.tokens_per_s / padded.tokens_per_s:.1f}), peak {gib(documents.peak_memory_bytes)}.
        FlashAttention-2's variable-length kernel, which computes each document's pairs only, is not
        modelled."""
    )
