"""A model described by its measured ops: what ``hfmodel`` extracts from a Hugging Face config.

The description (JSON, ``version`` 10) is written on the torch side (``hfmodel.describe``) and read
here without torch. It holds:
- ``params``: every parameter as ``transformers`` builds it on the meta device (name, shape,
  registration order, a tied weight once), and ``buffer_bytes`` (module buffers, unsharded);
- ``blocks``: the wrap units, the module paths of the class's ``_no_split_modules``;
- ``dims``: the config's dimensions (layers, hidden, heads, KV heads, head dim, vocabulary, ...),
  and ``moe`` (experts, top-k, shared experts) when the model has experts;
- ``measured``: the micro-batch, sequence length and dtype the ops were measured at (and an
  encoder-decoder's ``decoder_seq_len``);
- ``ops``: the forward in execution order, each with its module, kind, decoder block, the
  parameters it owns (a tied one at its first user; ``reuses`` names it at the later ones), forward FLOPs, the (M, N, K, count) of its matmuls, bytes moved by its
  elementwise work, saved-activation bytes, forward and backward transients (each with the
  storage sizes that make it up, ``*_pieces``, in creation order) and Python-level calls; an attention op also carries its call's shape (the kernel's own work is added per kernel
  by ``sim.workload.attention_kernel.attention_kernel_figures``, since it depends on the hardware); and
  what its backward runs, measured: the matmuls autograd issues (a frozen weight has no weight
  gradient; an op whose input needs no gradient either has none at all), their FLOPs, and the
  bytes its elementwise backward moves;
- ``finetune`` (null for full training): the LoRA settings PEFT applied, the frozen parameters
  and, for QLoRA, the weights stored in 4 bits (``sim.workload.finetune``).
"""

import json
from dataclasses import dataclass, field
from typing import Any

from sim.errors import UserError
from sim.workload.finetune import FinetuneFacts, finetuned_params
from sim.workload.params import ParamSpec

# 3: encoder-decoders (``measured.decoder_seq_len``; attention calls' ``kv_seq_len``, ``dropout``,
# ``bias``, ``bias_grad``) and tied parameters' later users (``reuses``); 4: attention calls'
# ``softcap`` (a version 3 file of Gemma 2 would read as uncapped); 6: attention calls'
# ``backward_start_bytes``; 7: block ops' ``checkpointed_forward_bytes``; 8: every byte figure's
# tensors (``saved_pieces``, ``forward_transient_pieces``, ``checkpointed_forward_pieces``,
# ``backward_transient_pieces``); 9: ops' ``saved_released_ahead``; 10: ops' ``forward_launches``
# and ``backward_launches``; 11: ops' ``forward_requests``, ``checkpointed_forward_requests`` and
# ``backward_requests``; 12: ops' ``next_block_input_bytes``; 13: attention calls'
# ``query_not_bshd``; 14: the probe makes no gradient for a bias that needs none (T5's zero
# cross-attention bias: a version 13 file counts one in that call's backward transient); 15: block
# ops' ``recompute_transient_bytes``; 16: an ``nn.Embedding`` subclass's op is of kind "embed"
# (Gemma 3's scaled word embedding was "elementwise", timed in the head's calibration group)
DESCRIPTION_VERSION = 16
GEMM_FIELDS = 4  # (M, N, K, count)


@dataclass(frozen=True, kw_only=True)
class AttentionCall:
    """One attention call as the model makes it (heads and head dims as the kernel sees them)."""

    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    causal: bool = True
    window: int | None = None
    kv_seq_len: int | None = None  # keys per query where they differ (cross-attention)
    dropout: float = 0.0  # attention dropout probability
    bias: bool = False  # an additive float bias on the scores (T5's relative position bias)
    bias_grad: bool = False  # the bias needs a gradient (learned, not T5's zero cross-attention bias)
    softcap: bool = False  # the scores are tanh soft-capped (Gemma 2's ``attn_logit_softcapping``)
    output_counted: bool = True  # the model's ops already save the output (a projection keeps it)
    query_not_bshd: bool = False  # the query is not (batch, seq, heads, dim) in memory (``hfmodel.probe``)
    extra_saved_bytes: int = 0  # saving q, k, v keeps the rest of the storages they view
    # what the model's backward holds as the kernel's backward starts: the output's gradient and
    # whatever else is alive then (the residual stream's gradient), parameter gradients excepted
    backward_start_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class DescribedOp:
    name: str
    module: str
    kind: str
    block: int | None
    params: tuple[str, ...]
    flops: float
    memory_bytes: float
    saved_bytes: int
    forward_transient_bytes: int
    backward_transient_bytes: int
    # of saved_bytes, what ops after its block save (a checkpointed block's output they keep)
    saved_after_block_bytes: int = 0
    # of saved_bytes, the next block's input as that block's first op saves it (a checkpointed
    # next block holds it as its input: no second copy)
    next_block_input_bytes: int = 0
    # of saved_bytes, those a later op's backward frees (their first saver's): (ops ahead, bytes)
    saved_released_ahead: tuple[tuple[int, int], ...] = ()
    # a block op's: what its block's ops hold during it when the block is checkpointed (nothing
    # saved: each storage to its last forward use), the attention kernel's own work excepted
    checkpointed_forward_bytes: int = 0
    # a block op's: its forward transient of what its block's ops made alone, as the block's
    # recompute holds it (what the forward held from before the block is the schedule's)
    recompute_transient_bytes: int = 0
    # the storages each figure is made of, in creation order (``hfmodel.trace``)
    saved_pieces: tuple[int, ...] = ()
    forward_transient_pieces: tuple[int, ...] = ()
    checkpointed_forward_pieces: tuple[int, ...] = ()
    backward_transient_pieces: tuple[int, ...] = ()
    recompute_transient_pieces: tuple[int, ...] = ()
    # its forward's allocations and frees in order, as (storage, bytes): bytes > 0 a storage the
    # forward frees, < 0 one kept for backward, 0 the free of the storage (``hfmodel.trace``);
    # and where its block is checkpointed (nothing kept); its backward's, where a free of a kept
    # forward storage is its release
    forward_requests: tuple[tuple[int, int], ...] = ()
    checkpointed_forward_requests: tuple[tuple[int, int], ...] = ()
    backward_requests: tuple[tuple[int, int], ...] = ()
    gemms: tuple[tuple[int, int, int, int], ...] = ()
    attention: AttentionCall | None = None
    host_ops: int = 0
    # the kernels its forward and its backward launch (``hfmodel.trace``)
    forward_launches: int = 0
    backward_launches: int = 0
    backward_flops: float = 0.0
    backward_memory_bytes: float = 0.0
    backward_gemms: tuple[tuple[int, int, int, int], ...] = ()
    reuses: tuple[str, ...] = ()  # tied parameters an earlier op owns, used again here


@dataclass(frozen=True, kw_only=True)
class MoeFacts:
    experts: int
    top_k: int
    shared_experts: int = 0


@dataclass(frozen=True, kw_only=True, eq=False)
class ModelDescription:
    """Compared and hashed by ``key`` (config hash and measured dims): caches stay cheap."""

    name: str
    model_type: str
    architecture: str
    config_sha256: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab: int
    tie_embeddings: bool
    max_position_embeddings: int | None
    moe: MoeFacts | None
    params: tuple[ParamSpec, ...]
    buffer_bytes: int
    blocks: tuple[str, ...]
    micro_batch: int
    seq_len: int
    dtype: str
    ops: tuple[DescribedOp, ...]
    # an encoder-decoder (T5): its decoder's length; its blocks are two stacks, the encoder's then
    # the decoder's (``blocks``), run in that order in forward and in reverse in backward
    decoder_seq_len: int | None = None
    config_json: str = "{}"  # the config.json itself, so that validation builds the same model
    finetune: FinetuneFacts | None = None
    key: str = field(default="")

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelDescription) and other.key == self.key

    @property
    def stacks(self) -> tuple[str, ...]:
        """Each block's stack, the module path its block sits in (an encoder-decoder's
        ``encoder.block`` and ``decoder.block``; a decoder's one stack)."""
        return tuple(b.rpartition(".")[0] for b in self.blocks)

    @property
    def stack_firsts(self) -> frozenset[int]:
        """The blocks that start a stack (an encoder-decoder's ``encoder.block.0`` and
        ``decoder.block.0``, where T5's stacks make their position biases)."""
        stacks = self.stacks
        return frozenset(b for b in range(len(stacks)) if b == 0 or stacks[b - 1] != stacks[b])


class _Reader:
    """Typed access to one JSON object, every mistake named by the file and key."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise UserError(f"{where}: expected a JSON object")
        self.data, self.where = data, where

    def get(self, key: str, tp: type | tuple[type, ...]) -> Any:
        if key not in self.data:
            raise UserError(f"{self.where}: missing key {key!r}")
        value = self.data[key]
        if not isinstance(value, tp) or (isinstance(value, bool) and tp in (int, float)):
            raise UserError(f"{self.where}: {key} has the wrong type ({type(value).__name__})")
        return value


def _gemms(raw: list[Any], where: str) -> tuple[tuple[int, int, int, int], ...]:
    out = []
    for g in raw:
        if not (
            isinstance(g, list) and len(g) == GEMM_FIELDS and all(isinstance(x, int) and x > 0 for x in g)
        ):
            raise UserError(f"{where}: gemms entries must be [M, N, K, count] of positive integers")
        out.append((g[0], g[1], g[2], g[3]))
    return tuple(out)


def _pieces(r: "_Reader", figure: str, where: str) -> tuple[int, ...]:
    """A figure's storage sizes: positive integers that sum to the figure."""
    pieces = r.get(f"{figure}_pieces", list)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in pieces):
        raise UserError(f"{where}: {figure}_pieces must be a list of positive integers")
    if sum(pieces) != r.get(f"{figure}_bytes", int):
        raise UserError(f"{where}: {figure}_pieces sum to {sum(pieces)}, not {figure}_bytes")
    return tuple(pieces)


def _requests(r: "_Reader", key: str, where: str) -> tuple[tuple[int, int], ...]:
    """``forward_requests``, ``checkpointed_forward_requests``, ``backward_requests``: [storage, bytes] pairs of
    integers (bytes signed: made and freed, made and kept, or 0: freed)."""
    raw = r.get(key, list)
    if not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in p)
        for p in raw
    ):
        raise UserError(f"{where}: {key} entries must be [storage, bytes] pairs of integers")
    return tuple((p[0], p[1]) for p in raw)


def _released_ahead(r: "_Reader", where: str) -> tuple[tuple[int, int], ...]:
    """``saved_released_ahead``: [ops ahead, bytes] pairs of positive integers, within the op's
    saved bytes."""
    raw = r.get("saved_released_ahead", list)
    if not all(
        isinstance(p, list)
        and len(p) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in p)
        for p in raw
    ):
        raise UserError(
            f"{where}: saved_released_ahead entries must be [ops ahead, bytes] of positive integers"
        )
    if sum(p[1] for p in raw) > r.get("saved_bytes", int):
        raise UserError(f"{where}: saved_released_ahead holds more bytes than saved_bytes")
    return tuple((p[0], p[1]) for p in raw)


def _op(raw: Any, where: str) -> DescribedOp:
    r = _Reader(raw, where)
    att = raw.get("attention")
    call = None
    if att is not None:
        a = _Reader(att, f"{where}.attention")
        call = AttentionCall(
            **{k: a.get(k, int) for k in ("batch", "seq_len", "heads", "kv_heads", "head_dim", "v_head_dim")},
            causal=a.get("causal", bool),
            window=att.get("window"),
            kv_seq_len=att.get("kv_seq_len"),
            dropout=float(att.get("dropout", 0.0)),
            bias=bool(att.get("bias", False)),
            bias_grad=bool(att.get("bias_grad", False)),
            softcap=bool(att.get("softcap", False)),
            output_counted=a.get("output_counted", bool),
            query_not_bshd=a.get("query_not_bshd", bool),
            extra_saved_bytes=a.get("extra_saved_bytes", int),
            backward_start_bytes=a.get("backward_start_bytes", int),
        )
    return DescribedOp(
        name=r.get("name", str),
        module=r.get("module", str),
        kind=r.get("kind", str),
        block=raw.get("block"),
        params=tuple(r.get("params", list)),
        flops=float(r.get("flops", (int, float))),
        memory_bytes=float(r.get("memory_bytes", (int, float))),
        saved_bytes=r.get("saved_bytes", int),
        saved_after_block_bytes=r.get("saved_after_block_bytes", int),
        next_block_input_bytes=r.get("next_block_input_bytes", int),
        saved_released_ahead=_released_ahead(r, where),
        forward_transient_bytes=r.get("forward_transient_bytes", int),
        backward_transient_bytes=r.get("backward_transient_bytes", int),
        checkpointed_forward_bytes=r.get("checkpointed_forward_bytes", int),
        recompute_transient_bytes=r.get("recompute_transient_bytes", int),
        **{
            f"{figure}_pieces": _pieces(r, figure, where)
            for figure in (
                "saved",
                "forward_transient",
                "checkpointed_forward",
                "backward_transient",
                "recompute_transient",
            )
        },
        forward_requests=_requests(r, "forward_requests", where),
        checkpointed_forward_requests=_requests(r, "checkpointed_forward_requests", where),
        backward_requests=_requests(r, "backward_requests", where),
        gemms=_gemms(r.get("gemms", list), where),
        attention=call,
        host_ops=r.get("host_ops", int),
        forward_launches=r.get("forward_launches", int),
        backward_launches=r.get("backward_launches", int),
        backward_flops=float(r.get("backward_flops", (int, float))),
        backward_memory_bytes=float(r.get("backward_memory_bytes", (int, float))),
        backward_gemms=_gemms(r.get("backward_gemms", list), where),
        reuses=tuple(raw.get("reuses", [])),
    )


def _finetune(raw: Any, where: str) -> FinetuneFacts | None:
    if raw is None:
        return None
    r = _Reader(raw, f"{where}: finetune")
    targets = raw.get("target_modules")
    return FinetuneFacts(
        method=r.get("method", str),
        rank=r.get("rank", int),
        alpha=float(r.get("alpha", (int, float))),
        dropout=float(r.get("dropout", (int, float))),
        target_modules=tuple(targets) if isinstance(targets, list) else targets,
        frozen=frozenset(r.get("frozen", list)),
        quantized=frozenset(r.get("quantized", list)),
        quant_storage=raw.get("quant_storage", "bf16"),
        double_quant=bool(raw.get("double_quant", True)),
        adapter_dtype=raw.get("adapter_dtype"),
    )


def finetune_key(finetune: dict[str, Any] | None) -> str:
    """A short content key of the fine-tuning settings a description was measured with."""
    if not finetune or finetune.get("method", "full") == "full":
        return "full"
    import hashlib

    settings = {k: v for k, v in finetune.items() if k not in ("frozen", "quantized")}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def finetune_fingerprint(facts: FinetuneFacts | None) -> str:
    """What a calibrated profile records of how its described model trained: ``full``, or the
    method and LoRA settings (not the frozen names, which follow from them), e.g.
    ``lora:r8:a16.0:d0.0:q_proj,v_proj`` — readable in the profile, compared as a string."""
    if facts is None:
        return "full"
    targets = facts.target_modules
    named = ",".join(targets) if isinstance(targets, tuple) else str(targets)
    quant = f":{facts.quant_storage}:dq{int(facts.double_quant)}" if facts.method == "qlora" else ""
    return f"{facts.method}:r{facts.rank}:a{facts.alpha}:d{facts.dropout}:{named}{quant}"


def description_key(
    config_sha256: str,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    finetune: dict[str, Any] | None = None,
    decoder_seq_len: int | None = None,
) -> str:
    decoder = "" if decoder_seq_len is None else f"d{decoder_seq_len}:"
    return f"{config_sha256}:{micro_batch}:{seq_len}:{decoder}{dtype}:{finetune_key(finetune)}:v{DESCRIPTION_VERSION}"


def parse_description(data: Any, where: str) -> ModelDescription:
    """A ``ModelDescription`` from its JSON object, or a UserError naming ``where`` and the key."""
    r = _Reader(data, where)
    if r.get("version", int) != DESCRIPTION_VERSION:
        raise UserError(
            f"{where}: description version {data['version']} (this fsdp-sim reads {DESCRIPTION_VERSION})"
        )
    d = _Reader(r.get("dims", dict), f"{where}: dims")
    m = _Reader(r.get("measured", dict), f"{where}: measured")
    moe = data.get("moe")
    params = tuple(ParamSpec(name=str(n), shape=tuple(int(x) for x in s)) for n, s in r.get("params", list))
    ops = tuple(_op(o, f"{where}: ops[{i}]") for i, o in enumerate(r.get("ops", list)))
    sha, mb, seq, dtype = (
        r.get("config_sha256", str),
        m.get("micro_batch", int),
        m.get("seq_len", int),
        m.get("dtype", str),
    )
    finetune = _finetune(data.get("finetune"), where)
    decoder_seq = data["measured"].get("decoder_seq_len")
    if finetune is not None:
        params = finetuned_params(params, finetune, dtype)
    return ModelDescription(
        name=r.get("name", str),
        model_type=r.get("model_type", str),
        architecture=r.get("architecture", str),
        config_sha256=sha,
        **{
            k: d.get(k, int)
            for k in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "vocab")
        },
        tie_embeddings=d.get("tie_embeddings", bool),
        max_position_embeddings=data["dims"].get("max_position_embeddings"),
        moe=MoeFacts(**moe) if moe else None,
        params=params,
        buffer_bytes=r.get("buffer_bytes", int),
        blocks=tuple(r.get("blocks", list)),
        micro_batch=mb,
        seq_len=seq,
        dtype=dtype,
        ops=ops,
        decoder_seq_len=decoder_seq,
        config_json=json.dumps(r.get("config", dict), sort_keys=True),
        finetune=finetune,
        key=description_key(sha, mb, seq, dtype, data.get("finetune"), decoder_seq),
    )


def read_description(text: str, where: str) -> ModelDescription:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e})") from None
    return parse_description(data, where)
