"""The scenario's real layers, built by ``transformers`` with random weights: the three units.

- embed: ``nn.Embedding`` (HF ``LlamaModel.embed_tokens``). The rotary tables
  (``LlamaRotaryEmbedding``, computed once per forward in the root) are built once, outside every
  unit, and passed to the block; the simulator models them analytically (``sim.workload.layers``);
- block: one ``LlamaDecoderLayer`` with SDPA attention, called as ``LlamaModel`` calls it
  (no mask, so SDPA runs causal, and the rotary ``position_embeddings``);
- head: the final ``LlamaRMSNorm``, ``lm_head`` and HF's ``ForCausalLMLoss`` (logits upcast to
  fp32, labels shifted), as ``LlamaForCausalLM.forward`` computes the loss.

Each unit is a callable from its input to its output plus the input factory, so that forward
and backward can be timed and measured alone.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from calibrate.compute import ComputeTarget
from calibrate.hf_llama import llama_config
from calibrate.sweep import TORCH_DTYPES


@dataclass(frozen=True, kw_only=True)
class Unit:
    """``run(inputs)`` returns the unit's output (a scalar loss for the head)."""

    name: str
    module: nn.Module
    make_inputs: Callable[[], tuple[torch.Tensor, ...]]
    run: Callable[..., torch.Tensor]
    shared: tuple[torch.Tensor, ...] = ()  # computed once per step for all blocks (rotary cos/sin)

    def params(self) -> list[nn.Parameter]:
        return list(self.module.parameters())


def build_units(target: ComputeTarget, device: torch.device, seed: int = 0) -> dict[str, Unit]:
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    torch.manual_seed(seed)
    cfg = llama_config(target.model, target.seq_len, n_layers=1)
    dtype = TORCH_DTYPES[target.param_dtype]
    b, s, h, v = target.micro_batch, target.seq_len, target.model.hidden, target.model.vocab
    rotary = LlamaRotaryEmbedding(config=cfg).to(device)
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)

    embed = nn.Embedding(v, h, cfg.pad_token_id).to(device=device, dtype=dtype)
    block = LlamaDecoderLayer(cfg, layer_idx=0).to(device=device, dtype=dtype).train()
    head = nn.ModuleDict(
        {"norm": LlamaRMSNorm(h, eps=cfg.rms_norm_eps), "lm_head": nn.Linear(h, v, bias=False)}
    )
    head = head.to(device=device, dtype=dtype)

    def ids() -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, v, (b, s), device=device),)

    def hidden() -> tuple[torch.Tensor, ...]:
        return (torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True),)

    def hidden_and_labels() -> tuple[torch.Tensor, ...]:
        return (*hidden(), *ids())

    with torch.no_grad():
        cos_sin = rotary(torch.empty(1, device=device, dtype=dtype), position_ids)

    def run_embed(input_ids: torch.Tensor) -> torch.Tensor:
        return embed(input_ids)

    def run_block(x: torch.Tensor) -> torch.Tensor:
        return block(x, attention_mask=None, position_ids=position_ids, position_embeddings=cos_sin)

    def run_head(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = head["lm_head"](head["norm"](x))
        return ForCausalLMLoss(logits, labels, vocab_size=v)

    return {
        "embed": Unit(name="embed", module=embed, make_inputs=ids, run=run_embed),
        "block": Unit(name="block", module=block, make_inputs=hidden, run=run_block, shared=tuple(cos_sin)),
        "head": Unit(name="head", module=head, make_inputs=hidden_and_labels, run=run_head),
    }
