"""FLOPs per token of a training step, as MFU and HFU count them.

MFU follows torchtitan (``torchtitan/models/utils.py`` ``get_dense_model_nparams_and_flops``)
and PaLM (Chowdhery et al. 2022, appendix B): model FLOPs per token = 6·N + 12·L·H·Q·T, where N
is the parameter count less the token embedding (a lookup, not a matmul; with tied embeddings the
shared weight is the head's matmul and counts), L the layers, H the
attention heads, Q the head dimension and T the sequence length. 6·N is the forward (2·N) and
backward (4·N) of every weight matmul; 12·L·H·Q·T the two attention matmuls (QKᵀ and AV, 2·T·H·Q
multiply-adds each per token) forward and backward, without discounting causal masking and
without the flash-attention backward's recomputation. HFU adds what the hardware computes again:
with full activation checkpointing every block's forward, 2·N_blocks + 4·L·H·Q·T per token
(and the matmuls selective checkpointing recomputes).
Both are divided by the dense peak of the compute dtype.

A described model (``model.config``) counts what its measured ops compute: N is the matmul FLOPs
of one forward per token over 2 — the parameters a token meets, so a mixture of experts counts
its active experts only (as MoE MFU is reported) — and the attention term sums each call's own
heads, head dimensions, queries and keys (an encoder-decoder's decoder and cross-attention run
``decoder_seq_len`` queries; its tokens per step are the encoder's, ``seq_len``).
"""

from sim.workload.checkpointing import CheckpointPlan
from sim.workload.description import ModelDescription
from sim.workload.model import ModelConfig, layer_params, n_params


def _tokens(d: ModelDescription) -> int:
    return d.micro_batch * d.seq_len


def matmul_params(model: ModelConfig) -> int:
    """N of the formula: every parameter but an untied token embedding (a described model: the
    parameters one token's matmuls use)."""
    d = model.description
    if d is not None:
        return round(sum(op.flops for op in d.ops) / (2 * _tokens(d)))
    return n_params(model) - (0 if model.tie_embeddings else model.vocab * model.hidden)


def _attention_matmul_flops(d: ModelDescription, block: int | None = None) -> float:
    """Forward FLOPs of QKᵀ and AV over the attention calls (of one block, when given), each
    4 · batch · queries · keys · heads · head dimension."""
    calls = [op.attention for op in d.ops if op.attention is not None and block in (None, op.block)]
    return sum(
        4.0 * c.batch * c.seq_len * (c.kv_seq_len or c.seq_len) * c.heads * (c.head_dim + c.v_head_dim) / 2
        for c in calls
        if c is not None
    )


def attention_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of the attention matmuls per token, all layers: 4·L·H·Q·T."""
    if model.description is not None:
        return _attention_matmul_flops(model.description) / _tokens(model.description)
    return 4.0 * model.n_layers * model.n_heads * model.head_dim * seq_len


def _described_recompute(d: ModelDescription, seq_len: int, plan: CheckpointPlan) -> float:
    """Per token: each checkpointed block's matmuls (under op-level SAC the second, fourth, ...
    single matmuls and every grouped one) and, with full regions, its attention."""
    total = 0.0
    for block in plan.blocks:
        ops = [op for op in d.ops if op.block == block and op.flops]
        if plan.selective_op:
            singles = [op for op in ops if len(op.gemms) == 1 and op.gemms[0][3] == 1]
            total += sum(op.flops for i, op in enumerate(singles) if i % 2)
            total += sum(op.flops for op in ops if op not in singles)
        else:
            total += sum(op.flops for op in ops) + _attention_matmul_flops(d, block)
    return total / _tokens(d)


def model_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """torchtitan's and PaLM's 6·N + 12·L·H·Q·T. Fine-tuned with LoRA, the matmuls the step
    needs as measured: every forward one and the backward ones autograd runs (no weight gradient
    for a frozen weight, so about 4·N + the adapters' 6·N_A), and the attention's three passes."""
    d = model.description
    if d is not None and d.finetune is not None:
        matmuls = sum(op.flops + op.backward_flops for op in d.ops) / _tokens(d)
        return matmuls + 3.0 * attention_flops_per_token(model, seq_len)
    return 6.0 * matmul_params(model) + 3.0 * attention_flops_per_token(model, seq_len)


def recompute_flops_per_token(model: ModelConfig, seq_len: int, plan: CheckpointPlan) -> float:
    """The forward FLOPs activation checkpointing runs again per token: every checkpointed
    block's weight matmuls and attention; under op-level SAC only the matmuls it recomputes
    (k, o and up: torchtitan keeps every other mm's output, and attention's)."""
    if not plan.active:
        return 0.0
    if model.description is not None:
        return _described_recompute(model.description, seq_len, plan)
    q, k, v, o, gate, up, down, *_ = layer_params(model, 0)
    if plan.selective_op:
        per_block = 2.0 * (k.numel + o.numel + up.numel)
    else:
        block_params = sum(p.numel for p in layer_params(model, 0))
        per_block = 2.0 * block_params + attention_flops_per_token(model, seq_len) / model.n_layers
    return len(plan.blocks) * per_block
