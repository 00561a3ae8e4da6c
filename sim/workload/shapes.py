"""What one micro-batch and one attention call look like to the kernels, and the one form of an
op's request to the allocator: the shapes every cost and memory figure of ``sim.workload`` reads."""

from dataclasses import dataclass

from sim.workload.options import LossKernel, NormKernel


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one micro-batch looks like to the kernels."""

    micro_batch: int
    seq_len: int
    act_bytes: int  # activation dtype (param_dtype under FSDP2 MixedPrecisionPolicy)
    attention_kernel: str  # "flash", "cudnn", "efficient" (no seq^2 buffers) or "math"
    loss: LossKernel = LossKernel.EAGER
    norm: NormKernel = NormKernel.EAGER
    # an encoder-decoder's decoder length (``training.decoder_seq_len``); None for a decoder
    decoder_seq_len: int | None = None
    # rows padded to ``seq_len`` (``training.avg_seq_len`` below it), with the ``attention_mask``
    # a padding collator passes (transformers' ``DataCollatorWithPadding``)
    padded: bool = False
    # rows packed from several documents, their positions restarting at each
    # (``training.avg_doc_len`` below ``seq_len``): the collator's batch x sequence ``position_ids``,
    # so the rotary tables are computed per row
    packed: bool = False
    # transformers builds the documents' block-diagonal causal mask from those positions
    # (``masking_utils.find_packed_sequence_indices``): packed rows without a KV cache (with one,
    # ``_preprocess_mask_arguments`` does not look; nor did transformers before 4.36)
    document_mask: bool = False

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def position_rows(self) -> int:
        """Rows of the positions the model's rotary tables are computed from: the collator's
        batch × sequence ``position_ids`` of packed rows, else the model's own ``arange``, one row
        broadcast over the batch (HF ``LlamaModel.forward``: ``position_ids.unsqueeze(0)``)."""
        return self.micro_batch if self.packed else 1


@dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """One scaled-dot-product attention call: batch, sequence, heads and head dimension."""

    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool = True
    v_head_dim: int | None = None  # when values differ from queries and keys (DeepSeek's MLA)
    window: int | None = None  # sliding-window attention: keys attended per query at most
    # keys per query when they differ from the queries' length: an encoder-decoder's
    # cross-attention (decoder queries over the encoder's output)
    kv_seq_len: int | None = None
    dropout: float = 0.0  # attention dropout probability (T5 trains with dropout_rate 0.1)
    bias: bool = False  # an additive float bias masks the scores (T5's relative position bias)
    bias_grad: bool = False  # the bias is learned: its gradient flows back (not T5's cross-attention)
    softcap: bool = False  # tanh soft-capping of the scores (Gemma 2's ``attn_logit_softcapping``)
    # the call is given a collator's padding mask (``Workload.padded``, ``row_masks_for``)
    padding_mask: bool = False
    # the call is given packed documents' block-diagonal mask (``Workload.document_mask``,
    # ``row_masks_for``)
    document_mask: bool = False
    # what the model's backward holds as the kernel's backward starts, its output's gradient
    # among it (measured for a described model's call); None: the kernel alone (the hand-written
    # ops count no gradients passed between ops)
    backward_start_bytes: int | None = None

    @property
    def kv_len(self) -> int:
        return self.seq_len if self.kv_seq_len is None else self.kv_seq_len

    @property
    def sdpa_window_mask(self) -> bool:
        """Whether transformers' SDPA path hands the kernel a mask: a sliding-window call whose keys
        reach its window (``masking_utils._ignore_causal_mask_sdpa`` keeps ``is_causal`` only
        below it: ``kv_length >= local_attention_size`` builds the mask; measured on Mistral,
        window 64 against 65 at 64 tokens). With the mask ``is_causal`` is off, ``use_gqa_in_sdpa``
        is false, so ``repeat_kv`` copies k and v to every query head, and torch converts the
        boolean mask to an additive one in the query's dtype (``convert_boolean_attn_mask``),
        which a fused kernel keeps for backward (``sim.workload.attention_kernel``). Not for a
        soft-capped call (Gemma 2): transformers does not run those through SDPA at all
        (``_supports_sdpa = False``), so a fused kernel there stands for FlashAttention's, which
        soft-caps and windows in the kernel, with no mask."""
        return not self.softcap and self.causal and self.window is not None and self.kv_len >= self.window

    @property
    def row_mask(self) -> bool:
        """Whether the call's mask is built row by row from the collator's batch: its padding
        (``padding_mask``) or its packed documents (``document_mask``), batch × 1 × queries × keys
        where a window's alone is one expanded row."""
        return self.padding_mask or self.document_mask

    @property
    def sdpa_bool_mask(self) -> bool:
        """Whether transformers' SDPA path hands the kernel a boolean mask: a reached window
        (``sdpa_window_mask``), a collator's padding (``padding_mask``: ``_ignore_causal_mask_sdpa``
        keeps ``is_causal`` only where no key is padded; measured on Llama with padded rows: a
        batch × 1 × queries × keys boolean mask, ``is_causal`` off, k and v at every query head) or
        packed documents (``document_mask``: measured on Llama with restarting positions and no
        cache, the same batch × 1 × queries × keys boolean mask, ``is_causal`` off, k and v at
        every query head). Either way k and v are ``repeat_kv``'s copies and the kernel keeps the
        converted mask. Not for a biased call: T5's padding reaches the kernel folded into its
        float bias (``bias_rows``)."""
        return not self.softcap and not self.bias and (self.row_mask or self.sdpa_window_mask)

    @property
    def bias_rows(self) -> int:
        """The batch rows of the additive bias a biased call hands the kernel: one, broadcast over
        the batch, unless a row mask is folded into it (T5 with padded rows:
        ``create_position_bias_mask``'s ``torch.where(mask, position_bias, min)`` over the
        batch × 1 × queries × keys boolean mask, batch × heads × queries × keys; measured on
        tiny-t5 on the CPU, every encoder and cross-attention call)."""
        return self.batch if self.folds_mask else 1

    @property
    def folds_mask(self) -> bool:
        """Whether the call's row mask is folded into its additive bias (T5 with padded rows,
        ``bias_rows``), a new batch × heads × queries × keys tensor at any batch."""
        return self.bias and self.row_mask

    @property
    def sdpa_given_mask(self) -> bool:
        """Whether transformers' SDPA path hands the kernel a mask of any kind: a boolean one
        (``sdpa_bool_mask``) or an additive bias (T5's position bias, ``create_position_bias_mask``,
        the causal triangle filled into it). Then ``is_causal`` is off and a fused kernel computes
        every pair, the masking only in the mask: its FLOPs and its time (``sim.costs.gpu``)."""
        return self.sdpa_bool_mask or self.bias

    @property
    def flops_head_dim(self) -> float:
        """The head dimension of the FLOP count: QKᵀ runs on ``head_dim``, AV on ``v_head_dim``."""
        return self.head_dim if self.v_head_dim is None else (self.head_dim + self.v_head_dim) / 2


# a forward request (``DescribedOp.forward_requests``): (tensor, bytes), bytes > 0 made and freed by
# the forward, < 0 made and kept for backward, 0 the tensor's free
Request = tuple[int, int]


def row_masks_for(w: Workload, *, bias: bool, softcap: bool, over_labels: bool = False) -> tuple[bool, bool]:
    """Whether a call of ``w`` is given the collator's padding mask and packed documents'
    block-diagonal mask (``AttentionShape.padding_mask``, ``document_mask``), as a pair.

    Padding: wherever the rows are padded, T5's biased calls included (``create_position_bias_mask``
    folds the boolean mask into the bias, ``AttentionShape.bias_rows``), but not a call
    ``over_labels`` (an encoder-decoder's decoder self-attention: its tokens are the labels, which
    the collator does not pad; measured on tiny-t5, whose decoder calls keep ``is_causal``'s
    triangle alone) nor a soft-capped
    call, which transformers runs through FlashAttention's own padding-free (unpadded,
    variable-length) path rather than SDPA (not modelled). Documents: where transformers builds
    their mask (``Workload.document_mask``), but not for a biased call (an encoder-decoder's,
    which packing is not modelled for) nor a soft-capped one (run through FlashAttention)."""
    return w.padded and not softcap and not over_labels, w.document_mask and not bias and not softcap
