"""The one place a scenario's model becomes a ``transformers.LlamaConfig``.

Calibration (single layers), validation (whole models) and the parameter-count tests all build
from it, so they measure the same architecture: SDPA attention, no KV cache (training).
"""

from dataclasses import replace
from typing import Any

from sim.workload.model import ModelConfig


def llama_config(model: ModelConfig, seq_len: int, n_layers: int | None = None) -> Any:
    """``LlamaConfig`` for ``model`` (with ``n_layers`` decoder layers instead, when given)."""
    from transformers import LlamaConfig

    if n_layers is not None:
        model = replace(model, n_layers=n_layers)
    config: Any = LlamaConfig
    return config(
        vocab_size=model.vocab,
        hidden_size=model.hidden,
        intermediate_size=model.ffn_hidden,
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads,
        tie_word_embeddings=model.tie_embeddings,
        max_position_embeddings=max(seq_len, 128),
        attn_implementation="sdpa",
        # training: no KV cache (with checkpoint_wrapper a cache would keep every layer's K/V)
        use_cache=False,
    )
