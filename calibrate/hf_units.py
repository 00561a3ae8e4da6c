"""The units of a model described from its ``config.json``, timed inside the real model.

The model is the real ``transformers`` class built from the description's own config
(``hfmodel.build``, SDPA attention, random weights), kept to one decoder layer of each kind
(``hfmodel.describe.representatives``: DeepSeek's dense first layer, Gemma's sliding and global
layers are kinds of their own) so that a large model stays cheap; blocks built alike take the
times of their kind's representative. One training step of that model is timed with module
hooks, so every unit runs where and as the model runs it (its mask, rotary tables, MoE routing):
- ``block.<i>``, the kind whose representative is decoder block ``i``: forward between the
  layer's forward pre-hook and forward hook; backward between its full backward pre-hook (the
  gradient of its output arrived) and its full backward hook (its input's gradient is done);
  recompute inside a non-reentrant ``checkpoint_wrapper`` backward, from entering to leaving the
  recomputation (its ``context_fn``), in a second set of steps;
- ``embed``: the input embedding's forward hooks; its backward is what remains of the step's
  backward after the head and the blocks;
- ``head``: the rest of the model — in forward all but the embedding and the blocks (the rotary
  tables, the mask, the final norm, the lm_head and the loss), in backward from the step's start
  to the last block's backward pre-hook.
A LoRA model is the same model with PEFT's LoRA applied as the description applied it (adapters
in the compute dtype); its first block is a kind of its own, and since its input (from the frozen
embedding) needs no gradient, its backward is what remains of the step's backward and the
embedding's is 0. An encoder-decoder (T5) keeps one block per kind in each of its two stacks
and runs on the scenario's encoder and decoder lengths; its shared embedding's two calls (the
encoder's tokens, the decoder's) add up to ``embed``'s forward. QLoRA is refused
(``ComputeTarget.check_measurable``).
Means over ``reps`` steps after one warm-up. Memory is not measured here: a described model's
saved bytes and transients come from its description (the same saved-tensor hooks, under
``FakeTensorMode``), which the memory validation checks.
"""

import contextlib
import copy
import json
import statistics
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from calibrate.cache_state import evict
from calibrate.compute import STACK_DEPTH_KEYS, ComputeTarget
from calibrate.sweep import TORCH_DTYPES
from calibrate.unit_timing import synced_now
from sim.hardware.compute_section import UnitMeasurement
from sim.workload.description import ModelDescription

TIMES = ("forward_s", "backward_s", "recompute_s")


@dataclass(frozen=True, kw_only=True)
class DescribedModel:
    """The real model kept to one block per kind; ``kept`` are the original indices of its blocks
    (over both stacks of an encoder-decoder, the encoder's first), ``slots`` where each kept block
    sits (its stack's block list and its index there), ``block_units`` the unit each original
    block is timed by."""

    model: nn.Module
    slots: tuple[tuple[nn.ModuleList, int], ...]
    kept: tuple[int, ...]
    block_units: tuple[str, ...]

    @property
    def layers(self) -> list[nn.Module]:
        return [stack[i] for stack, i in self.slots]

    def replace_layer(self, j: int, module: nn.Module) -> None:
        stack, i = self.slots[j]
        stack[i] = module


def _description(target: ComputeTarget) -> ModelDescription:
    d = target.model.description
    assert d is not None, "a described model"
    return d


def _config(target: ComputeTarget, depths: dict[str, int] | None = None) -> Any:
    """The description's own config; with ``depths`` (stack -> blocks) each stack cut to its
    first blocks, their kinds unchanged, since a block's kind follows its index."""
    from hfmodel.build import hf_config

    data = json.loads(_description(target).config_json)
    for stack, n in (depths or {}).items():
        if stack in STACK_DEPTH_KEYS:
            data[STACK_DEPTH_KEYS[stack]] = n
            continue
        data["num_hidden_layers"] = n
        if isinstance(data.get("layer_types"), list):
            data["layer_types"] = data["layer_types"][:n]
    return hf_config(data)


def build_described(target: ComputeTarget, device: torch.device, dtype: torch.dtype) -> DescribedModel:
    """The real model with one decoder block per kind: built up to its last representative (on
    the device, random weights), then its block list cut to the representatives, as
    ``hfmodel.describe`` cuts the model it measures."""
    from hfmodel.build import block_prefixes, block_stacks, build_causal_lm
    from hfmodel.describe import representatives

    f = _description(target).finetune
    lora = f.lora_settings() if f is not None else None
    with torch.device("meta"):
        meta = build_causal_lm(_config(target), dtype)
    blocks = block_prefixes(meta)
    reps = representatives(meta, blocks, first_alone=lora is not None)
    kept = tuple(sorted(set(reps)))
    stacks = block_stacks(blocks)
    # each stack built up to its last representative: its position in its own stack, plus one
    local = {stack: [indices.index(i) for i in kept if i in indices] for stack, indices in stacks.items()}
    cfg = _config(target, {stack: ks[-1] + 1 for stack, ks in local.items()})
    with torch.device(device):
        model = build_causal_lm(cfg, dtype)
    if lora is not None:  # PEFT's LoRA as the description traced it: adapters in the base's dtype
        from hfmodel.finetune import apply_lora

        apply_lora(model, lora, adapters_in_base_dtype=True)
    modules = dict(model.named_modules())
    slots: list[tuple[nn.ModuleList, int]] = []
    for stack, ks in local.items():
        parent, _, attr = stack.rpartition(".")
        trimmed = nn.ModuleList([modules[stack][k] for k in ks])
        setattr(modules[parent] if parent else model, attr, trimmed)
        slots += [(trimmed, j) for j in range(len(ks))]
    if len(stacks) == 1:
        cfg.num_hidden_layers = len(kept)  # a decoder's layer count (T5's stacks loop over their lists)
    model = model.to(device=device, dtype=dtype).train()
    return DescribedModel(
        model=model, slots=tuple(slots), kept=kept, block_units=tuple(f"block.{r}" for r in reps)
    )


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class _Clock:
    """Timestamps of one step by event name, taken after waiting for the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.at: dict[str, float] = {}
        self.spent: dict[str, float] = {}

    def hook(self, event: str) -> Callable[..., None]:
        def mark(*_: Any) -> None:
            self.at[event] = synced_now(self.device)

        return mark

    def interval(self, name: str, since: str = "embed.f0") -> Callable[..., None]:
        """Add the time since the ``since`` mark to ``name``: a module called more than once a
        step (T5's shared embedding: the encoder's tokens, then the decoder's) sums its calls."""

        def add(*_: Any) -> None:
            self.spent[name] = self.spent.get(name, 0.0) + synced_now(self.device) - self.at[since]

        return add


def _register(dm: DescribedModel, clock: _Clock) -> list[Any]:
    handles = []
    for embed in _embedding_modules(dm.model):
        handles += [
            embed.register_forward_pre_hook(clock.hook("embed.f0")),
            embed.register_forward_hook(clock.interval("embed.forward")),
        ]
    for j, layer in enumerate(dm.layers):
        handles += [
            layer.register_forward_pre_hook(clock.hook(f"{j}.f0")),
            layer.register_forward_hook(clock.hook(f"{j}.f1")),
            layer.register_full_backward_pre_hook(clock.hook(f"{j}.b0")),
            layer.register_full_backward_hook(clock.hook(f"{j}.b1")),
        ]
    return handles


def _embedding_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that embed tokens with the input embedding's table: the table itself, or (T5)
    the encoder's and the decoder's ``embed_tokens``, which hold the shared weight."""
    get_embeddings: Any = model.get_input_embeddings
    table = get_embeddings().weight
    users = {id(m): m for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is table}
    return list(users.values())


def _ids(target: ComputeTarget, device: torch.device, seq_len: int | None = None) -> torch.Tensor:
    vocab = _description(target).vocab
    return torch.randint(0, vocab, (target.micro_batch, seq_len or target.seq_len), device=device)


def _batch(target: ComputeTarget, device: torch.device) -> dict[str, torch.Tensor]:
    """One training step's inputs: token ids and labels (an encoder-decoder's labels, shifted
    right into its decoder's input, have the decoder's own length)."""
    ids = _ids(target, device)
    decoder = _description(target).decoder_seq_len
    return {"input_ids": ids, "labels": ids if decoder is None else _ids(target, device, decoder)}


def _step_times(dm: DescribedModel, target: ComputeTarget, device: torch.device) -> dict[str, float]:
    """One training step's unit times (seconds), keyed ``unit.forward_s`` / ``unit.backward_s``."""
    clock = _Clock(device)
    handles = _register(dm, clock)
    batch = _batch(target, device)
    evict(device)  # the step's data out of cache, as the rest of a training step leaves it
    try:
        t0 = synced_now(device)
        loss = dm.model(**batch).loss
        t1 = synced_now(device)
        with warnings.catch_warnings():  # a frozen embedding: the fallback handled below
            warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
            loss.backward()
        t2 = synced_now(device)
    finally:
        for h in handles:
            h.remove()
    dm.model.zero_grad(set_to_none=True)
    at = clock.at
    out = {"embed.forward_s": clock.spent["embed.forward"]}
    for j, index in enumerate(dm.kept):
        out[f"block.{index}.forward_s"] = at[f"{j}.f1"] - at[f"{j}.f0"]
        out[f"block.{index}.backward_s"] = at[f"{j}.b1"] - at[f"{j}.b0"]
    blocks = [f"block.{i}" for i in dm.kept]
    out["head.forward_s"] = t1 - t0 - out["embed.forward_s"] - sum(out[f"{b}.forward_s"] for b in blocks)
    out["head.backward_s"] = min(at[f"{j}.b0"] for j in range(len(dm.kept))) - t1
    rest = t2 - t1 - out["head.backward_s"] - sum(out[f"{b}.backward_s"] for b in blocks)
    if _embedding_trains(dm):
        out["embed.backward_s"] = rest
    else:
        # LoRA freezes the embedding: the first block's input needs no gradient, so its full
        # backward hook fires with its output's gradient (torch's documented fallback) and its
        # backward is what remains of the step's; the frozen embedding has none
        first = f"block.{dm.kept[0]}"
        out[f"{first}.backward_s"] += rest
        out["embed.backward_s"] = 0.0
    return out


def _embedding_trains(dm: DescribedModel) -> bool:
    get_embeddings: Any = dm.model.get_input_embeddings
    return any(p.requires_grad for p in get_embeddings().parameters())


def _recompute_times(
    dm: DescribedModel, target: ComputeTarget, device: torch.device, reps: int
) -> dict[str, float]:
    """Each kept block's recompute inside a non-reentrant ``checkpoint_wrapper`` backward (the
    blocks are wrapped in place: this runs last)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    spent: list[list[float]] = [[] for _ in dm.kept]

    def stopwatch_for(j: int) -> Callable[[], Any]:
        @contextlib.contextmanager
        def stopwatch() -> Iterator[None]:
            t0 = synced_now(device)
            try:
                yield
            finally:
                spent[j].append(synced_now(device) - t0)

        return lambda: (contextlib.nullcontext(), stopwatch())

    for j, layer in enumerate(dm.layers):
        dm.replace_layer(j, checkpoint_wrapper(layer, preserve_rng_state=False, context_fn=stopwatch_for(j)))
    for _ in range(reps + 1):
        batch = _batch(target, device)
        evict(device)
        dm.model(**batch).loss.backward()
        dm.model.zero_grad(set_to_none=True)
    return {f"block.{i}.recompute_s": statistics.fmean(spent[j][1:]) for j, i in enumerate(dm.kept)}


def measure_described(
    target: ComputeTarget, device: torch.device, reps: int
) -> tuple[dict[str, float], tuple[str, ...]]:
    """The mean times of every unit (flat ``unit.field`` keys) and the unit of each decoder block."""
    target.check_measurable()
    torch.manual_seed(0)
    dm = build_described(target, device, TORCH_DTYPES[target.param_dtype])
    samples = [_step_times(dm, target, device) for _ in range(reps + 1)][1:]  # the first: a warm-up
    times = {k: statistics.fmean(s[k] for s in samples) for k in samples[0]}
    times |= _recompute_times(dm, target, device, reps)
    times |= {f"{u}.recompute_s": 0.0 for u in ("embed", "head")}
    return times, dm.block_units


def units_of(times: dict[str, float], block_units: tuple[str, ...]) -> dict[str, UnitMeasurement]:
    """The measured units; bytes 0: a described model's memory is its description's."""
    names = ["embed", *dict.fromkeys(block_units), "head"]
    return {
        u: UnitMeasurement(
            **{f: times[f"{u}.{f}"] for f in TIMES},
            saved_activation_bytes=0,
            forward_transient_bytes=0,
            backward_transient_bytes=0,
        )
        for u in names
    }


def _captured_call(
    dm: DescribedModel, ids: torch.Tensor, encoder_decoder: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The first kept block's call as the model makes it (hidden states left out); an
    encoder-decoder's first block is its encoder's, though its decoder must run too."""
    got: dict[str, Any] = {}

    def keep(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        got["args"], got["kwargs"] = args[1:], dict(kwargs)
        if not args:
            got["kwargs"].pop("hidden_states")

    handle = dm.layers[0].register_forward_pre_hook(keep, with_kwargs=True)
    with torch.no_grad():
        dm.model(input_ids=ids, **({"decoder_input_ids": ids} if encoder_decoder else {}))
    handle.remove()
    return got["args"], got["kwargs"]


class BlockChain(nn.Module):
    """``count`` copies of the model's first decoder block, each called as the model calls it on
    ``batch`` sequences of ``seq_len`` tokens."""

    def __init__(
        self,
        target: ComputeTarget,
        device: torch.device,
        dtype: torch.dtype,
        *,
        count: int,
        batch: int,
        seq_len: int,
    ):
        super().__init__()
        torch.manual_seed(0)
        compute = TORCH_DTYPES[target.param_dtype]
        dm = build_described(target, device, compute)
        ids = torch.randint(0, _description(target).vocab, (batch, seq_len), device=device)
        encoder_decoder = _description(target).decoder_seq_len is not None
        self.rest, self.call_kwargs = _captured_call(dm, ids, encoder_decoder)
        self.layers = nn.ModuleList(copy.deepcopy(dm.layers[0]) for _ in range(count))
        self.to(device=device, dtype=dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = _first(layer(h, *self.rest, **self.call_kwargs))
        return h


def block_unit(target: ComputeTarget, device: torch.device) -> Any:
    """The first block alone on the scenario's batch, as a ``calibrate.layers.Unit``."""
    from calibrate.layers import Unit

    dtype = TORCH_DTYPES[target.param_dtype]
    b, s, h = target.micro_batch, target.seq_len, _description(target).hidden
    chain = BlockChain(target, device, dtype, count=1, batch=b, seq_len=s)

    def hidden() -> tuple[torch.Tensor, ...]:
        return (torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True),)

    return Unit(name="block", module=chain, make_inputs=hidden, run=chain)
