"""What each op of the hand-written Llama costs the host in eager PyTorch: its Python-level
torch calls (each one eager dispatch) and the kernels its forward and backward launch, counted in
transformers' ``modeling_llama.py`` and measured by ``hfmodel.trace``; the attention kernels'
own launches; torchtitan's fused RMSNorm's. ``sim.workload.layers`` puts them on its ops,
``sim.costs`` turns them into host time.
"""

# Python-level torch calls in one eager forward of each op, read from transformers'
# modeling_llama.py: LlamaRMSNorm.forward does to(fp32), pow, mean, add(eps), rsqrt, mul, to(dtype)
# and the weight multiply (8), plus the residual add before it (1); a Linear is one call;
# LlamaAttention around SDPA: 3 view/transpose pairs (6), apply_rotary_pos_emb (unsqueeze x2,
# 2 x (mul, rotate_half's 2 slices, neg and cat, mul, add) = 16), repeat_kv handled inside SDPA
# with enable_gqa or 2 expand/reshape per tensor (4), the SDPA call (1), transpose, reshape and
# contiguous of the output (3); the SwiGLU activation act_fn and the product (2), plus the
# residual add after the MLP (1); the embedding lookup (1); LlamaRotaryEmbedding (expand, float,
# matmul, transpose, cat, cos, sin, 2 muls by the scaling, 2 casts: 11); the head's logits.float()
# and ForCausalLMLoss (pad, shift view, view x2, cross_entropy: 6).
HOST_OPS = {"norm": 9, "linear": 1, "attention": 30, "mlp_act": 3, "embed": 1, "rotary": 11, "loss": 6}

# The kernels an attention kernel launches (forward, backward), from their implementations:
# FlashAttention-2 runs one forward kernel and three backward (``flash_bwd_dot_do_o_kernel``, the
# dq/dk/dv kernel, ``flash_bwd_convert_dq_kernel``); the memory-efficient and cuDNN kernels one
# forward and two backward (a preprocess and the main kernel); the eager math path, as HF's
# ``eager_attention_forward`` writes it (and SDPA's math path alike), six forward (q @ k^T, the
# scaling, the mask's add, the softmax, its cast back, @ v) and eight backward (two matmuls for
# @ v, the cast, the softmax's backward, the scaling's, two matmuls for q @ k^T, the GQA heads' sum)
ATTENTION_LAUNCHES = {"flash": (1, 3), "efficient": (1, 2), "cudnn": (1, 2), "math": (6, 8), "eager": (6, 8)}

# The kernels each op of the hand-written Llama launches (forward, backward), its attention
# kernel's own excepted: the counts ``hfmodel.trace`` measures on transformers' Llama (aten calls
# that run a kernel), grouped as these ops group its modules. A linear's two matmuls backward; a
# block's norm its 8 calls and the residual add before it (9), 17 backward (the residual stream's
# gradient join among them); the final norm has no add to take (8, 16); the attention op's RoPE,
# transposes and output copy (10), 19 backward (the two adds joining q's, k's and v's input
# gradients among them); the SwiGLU act and product (2), 4 backward (the gate/up join among
# them); the lookup (1, 2); the rotary tables and position ids (11, 0); the loss's cast, shift
# and cross-entropy (5, 3). tests/test_hf_models.py checks that a block and the whole model
# launch what the described transformers Llama does.
LAUNCHES = {
    "norm": (9, 17),
    "final_norm": (8, 16),
    "linear": (1, 2),
    "attention": (10, 19),
    "mlp_act": (2, 4),
    "embed": (1, 2),
    "rotary": (11, 0),
    "loss": (5, 3),
}

# torchtitan's TritonFusedRMSNorm (torchtitan/models/norms.py, 2024-04, 157a12c56): forward one
# kernel, with the input's view, ``empty_like`` for y and ``empty`` for rstd around it (host
# calls: view, empty_like, empty, the launch, reshape); backward the ``_rms_norm_bwd_kernel_sm``
# kernel, ``_dw.sum(0)`` and its cast to the weight's dtype, and in a block the residual stream's
# gradient join. As in ``LAUNCHES``, a block's first norm also counts the residual add before it
# (the block before's last); the add before its second is an op of its own (``_residual_add``)
FUSED_NORM_HOST_OPS = 5
FUSED_NORM_LAUNCHES = {"norm": (1, 4), "final_norm": (1, 3)}
