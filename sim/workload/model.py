"""Decoder-only transformers of the Llama family: dimensions, presets and their exact parameters.

Parameter names, shapes and registration order follow ``transformers``' ``LlamaForCausalLM``
(``modeling_llama.py``): embed_tokens, then per layer q/k/v/o_proj, gate/up/down_proj,
input_layernorm, post_attention_layernorm, then the final norm and lm_head. Llama has no biases.
"""

from dataclasses import dataclass
from functools import cache

from sim.errors import UserError
from sim.workload.description import ModelDescription
from sim.workload.params import ParamSpec


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Dimensions of a Llama-architecture model (the fields of a HF ``LlamaConfig``)."""

    name: str = "custom"
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab: int
    tie_embeddings: bool = False
    # a model built from its Hugging Face config (``model.config``, the library presets): its
    # parameters, units and measured ops; None for the hand-written Llama dimensions above
    description: ModelDescription | None = None

    @property
    def head_dim(self) -> int:
        if self.description is not None:
            return self.description.head_dim
        return self.hidden // self.n_heads

    @staticmethod
    def of(description: ModelDescription) -> "ModelConfig":
        """The dimensions of a described model (its representative ones where layers differ)."""
        d = description
        return ModelConfig(
            name=d.name,
            n_layers=d.n_layers,
            hidden=d.hidden,
            n_heads=d.n_heads,
            n_kv_heads=d.n_kv_heads,
            ffn_hidden=d.ffn_hidden,
            vocab=d.vocab,
            tie_embeddings=d.tie_embeddings,
            description=d,
        )

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def check(self, where: str) -> None:
        """Raise a UserError naming ``where`` when the dimensions cannot form a Llama model."""
        if self.description is not None:
            return  # transformers built it: its dimensions are consistent by construction
        for field in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn_hidden", "vocab"):
            if getattr(self, field) <= 0:
                raise UserError(f"{where}: model.{field} must be a positive integer")
        if self.hidden % self.n_heads:
            raise UserError(
                f"{where}: model.hidden ({self.hidden}) must be divisible by model.n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads:
            raise UserError(
                f"{where}: model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})"
            )


# Dimensions from each model's published config.json (Hugging Face model cards of meta-llama).
PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": ModelConfig(
        name="llama2-7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=32, ffn_hidden=11008, vocab=32000
    ),
    "llama2-13b": ModelConfig(
        name="llama2-13b", n_layers=40, hidden=5120, n_heads=40, n_kv_heads=40, ffn_hidden=13824, vocab=32000
    ),
    "llama2-70b": ModelConfig(
        name="llama2-70b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, ffn_hidden=28672, vocab=32000
    ),
    "llama3-8b": ModelConfig(
        name="llama3-8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab=128256
    ),
    # codellama/CodeLlama-34b-hf config.json: the Llama-2-architecture 34B (IBM's FSDP blog trains a 34B)
    "codellama-34b": ModelConfig(
        name="codellama-34b",
        n_layers=48,
        hidden=8192,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden=22016,
        vocab=32000,
    ),
    "llama3-70b": ModelConfig(
        name="llama3-70b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, ffn_hidden=28672, vocab=128256
    ),
    # Small models that run for real on a CPU, for tests, calibration and validation.
    "tiny": ModelConfig(
        name="tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=172, vocab=512
    ),
    "llama-5m": ModelConfig(
        name="llama-5m", n_layers=4, hidden=256, n_heads=8, n_kv_heads=4, ffn_hidden=688, vocab=4096
    ),
    "llama-34m": ModelConfig(
        name="llama-34m", n_layers=8, hidden=512, n_heads=8, n_kv_heads=8, ffn_hidden=1376, vocab=8192
    ),
}


def preset(name: str, where: str = "scenario") -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"{where}: unknown model.preset {name!r}; allowed: {', '.join(PRESETS)}") from None


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}"


def layer_params(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    p, h, f, kv = layer_prefix(i), cfg.hidden, cfg.ffn_hidden, cfg.kv_dim
    q = cfg.n_heads * cfg.head_dim
    return [
        ParamSpec(name=f"{p}.self_attn.q_proj.weight", shape=(q, h)),
        ParamSpec(name=f"{p}.self_attn.k_proj.weight", shape=(kv, h)),
        ParamSpec(name=f"{p}.self_attn.v_proj.weight", shape=(kv, h)),
        ParamSpec(name=f"{p}.self_attn.o_proj.weight", shape=(h, q)),
        ParamSpec(name=f"{p}.mlp.gate_proj.weight", shape=(f, h)),
        ParamSpec(name=f"{p}.mlp.up_proj.weight", shape=(f, h)),
        ParamSpec(name=f"{p}.mlp.down_proj.weight", shape=(h, f)),
        ParamSpec(name=f"{p}.input_layernorm.weight", shape=(h,)),
        ParamSpec(name=f"{p}.post_attention_layernorm.weight", shape=(h,)),
    ]


@cache
def param_specs(cfg: ModelConfig) -> tuple[ParamSpec, ...]:
    """Every parameter of ``LlamaForCausalLM(cfg)`` in registration order (tied head counted once);
    of a described model, the parameters ``transformers`` built."""
    if cfg.description is not None:
        return cfg.description.params
    specs = [ParamSpec(name="model.embed_tokens.weight", shape=(cfg.vocab, cfg.hidden))]
    for i in range(cfg.n_layers):
        specs += layer_params(cfg, i)
    specs.append(ParamSpec(name="model.norm.weight", shape=(cfg.hidden,)))
    if not cfg.tie_embeddings:
        specs.append(ParamSpec(name="lm_head.weight", shape=(cfg.vocab, cfg.hidden)))
    return tuple(specs)


@cache
def n_params(cfg: ModelConfig) -> int:
    """Parameters of the model (a QLoRA weight by the elements it packs, not its packed storage)."""
    return sum(s.quantized_numel or s.numel for s in param_specs(cfg))
