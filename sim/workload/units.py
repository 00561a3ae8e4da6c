"""FSDP wrap units: which parameters each ``fully_shard`` call owns, and which forward work runs
under which unit's hooks.

A *unit* is one ``fully_shard`` call (one FSDPParamGroup); the root unit is the last call, on the
whole model, and owns every parameter not owned by another unit. A *segment* is a maximal run of
consecutive layer ops owned by the same unit: the granularity at which FSDP hooks fire.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from math import ceil, prod

from sim.workload.layer_op import LayerOp
from sim.workload.model import ModelConfig, ParamSpec, layer_prefix, param_specs
from sim.workload.options import WrapPolicy

ROOT = "root"


def padded_numel(spec: ParamSpec, shard_size: int) -> int:
    """Numel after FSDP2 pads dim 0 to a multiple of the shard group (``_get_dim0_padded_size``)."""
    rows = spec.shape[0]
    return ceil(rows / shard_size) * shard_size * prod(spec.shape[1:])


def flat_param_numel(params: Sequence[ParamSpec], *, aligned_numel: int, pad_to: int) -> int:
    """Numel of FSDP1's ``FlatParameter`` of ``params`` (registration order), before sharding:
    with ``use_orig_params=True`` (``aligned_numel`` > 0) each parameter starts at a multiple of
    ``aligned_numel`` elements (16 B of the compute dtype) and the whole is padded to a multiple of
    ``pad_to`` (the process group's size); without it the parameters are concatenated as they are
    (``FlatParamHandle._init_flat_param_and_metadata``, torch 2.13 ``fsdp/_flat_param.py``)."""
    total = 0
    for spec in params:
        if aligned_numel > 0 and total % aligned_numel:
            total += aligned_numel - total % aligned_numel
        total += spec.numel
    if aligned_numel > 0 and total % pad_to:
        total += pad_to - total % pad_to
    return total


def flat_param_padded_numel(unsharded_numel: int, shard_size: int) -> int:
    """FSDP1's padded unsharded size: the flat parameter ``chunk``-ed into ``shard_size`` equal
    shards, each padded to the first's (``FlatParamHandle._get_shard``): ceil(N / W) · W."""
    return ceil(unsharded_numel / shard_size) * shard_size


@cache
def _padded_total(params: tuple[ParamSpec, ...], shard_size: int) -> int:
    return sum(padded_numel(p, shard_size) for p in params)


@dataclass(frozen=True, kw_only=True)
class WrapUnit:
    name: str
    prefix: str  # module path of the wrapped module ("" for the root)
    params: tuple[ParamSpec, ...]

    @property
    def is_root(self) -> bool:
        return self.name == ROOT

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def padded_numel(self, shard_size: int) -> int:
        return _padded_total(self.params, shard_size)

    def owns(self, module: str) -> bool:
        return self.prefix == "" or module == self.prefix or module.startswith(self.prefix + ".")


@dataclass(frozen=True, kw_only=True)
class Segment:
    unit: str
    ops: tuple[LayerOp, ...]

    @property
    def block(self) -> int | None:
        return self.ops[0].block

    @property
    def params(self) -> tuple[ParamSpec, ...]:
        return tuple(p for op in self.ops for p in op.params)

    @property
    def name(self) -> str:
        first, last = self.ops[0].name, self.ops[-1].name
        return first if first == last else f"{first}..{last.rsplit('.', 1)[-1]}"


def unit_prefixes(cfg: ModelConfig, wrap: WrapPolicy) -> list[str]:
    """Module paths of the non-root units, in the order ``fully_shard`` is applied (forward order)."""
    if wrap is WrapPolicy.MODEL:
        return []
    if wrap in (WrapPolicy.BLOCK, WrapPolicy.PEFT):
        if cfg.description is not None:  # the class's _no_split_modules
            blocks = list(cfg.description.blocks)
        else:
            blocks = [layer_prefix(i) for i in range(cfg.n_layers)]
        return blocks if wrap is WrapPolicy.BLOCK else _peft_prefixes(cfg, blocks)
    # every module with a matrix: linears, embeddings, and experts' stacked (3-D) weights
    linear_modules = list(dict.fromkeys(s.module for s in param_specs(cfg) if len(s.shape) >= 2))
    if cfg.tie_embeddings:  # a tied weight must stay in one unit: the root's
        embed = "model.embed_tokens" if cfg.description is None else param_specs(cfg)[0].module
        linear_modules = [m for m in linear_modules if m != embed]
    return linear_modules


def _peft_prefixes(cfg: ModelConfig, blocks: list[str]) -> list[str]:
    """PEFT's ``fsdp_auto_wrap_policy`` (``peft.utils.other``): its ``lambda_policy_fn`` wraps every
    leaf module with a trainable ``weight`` (LoRA's ``lora_A.default``/``lora_B.default`` linears),
    its transformer policy every decoder block; in forward order, each block before its adapters."""
    specs = param_specs(cfg)
    # every module above one that holds a parameter: those are not leaves
    ancestors = {m[:i] for m in {s.module for s in specs} for i, c in enumerate(m) if c == "."}
    block_set = set(blocks)
    out: dict[str, None] = {}
    for spec in specs:
        block = _innermost(spec.module, block_set)
        if block is not None:
            out.setdefault(block)
        is_leaf_weight = spec.name == spec.module + ".weight" and spec.module not in ancestors
        if spec.trainable and is_leaf_weight:
            out.setdefault(spec.module)
    return list(out)


def _innermost(module: str, prefixes: set[str]) -> str | None:
    """The longest prefix in ``prefixes`` that is ``module`` or one of its parent modules."""
    path = module
    while path:
        if path in prefixes:
            return path
        path = path.rpartition(".")[0]
    return None


@cache
def build_units(cfg: ModelConfig, wrap: WrapPolicy) -> tuple[WrapUnit, ...]:
    """Non-root units in forward order, then the root with every remaining parameter."""
    prefixes = unit_prefixes(cfg, wrap)
    by_prefix: dict[str, list[ParamSpec]] = {p: [] for p in prefixes}
    root: list[ParamSpec] = []
    for spec in param_specs(cfg):
        owner = _innermost(spec.module, set(by_prefix))
        (by_prefix[owner] if owner is not None else root).append(spec)
    units = [WrapUnit(name=p, prefix=p, params=tuple(by_prefix[p])) for p in prefixes]
    return (*units, WrapUnit(name=ROOT, prefix="", params=tuple(root)))


def build_segments(ops: Sequence[LayerOp], units: Sequence[WrapUnit]) -> list[Segment]:
    """Group consecutive ops with the same owner (and decoder layer) into segments."""
    segments: list[Segment] = []
    current: list[LayerOp] = []
    current_unit = ""
    by_prefix = {u.prefix: u.name for u in units if not u.is_root}
    prefixes = set(by_prefix)
    for op in ops:
        owner = _innermost(op.module, prefixes)
        unit = by_prefix[owner] if owner is not None else ROOT
        if current and (unit != current_unit or op.block != current[0].block):
            segments.append(Segment(unit=current_unit, ops=tuple(current)))
            current = []
        current_unit = unit
        current.append(op)
    if current:
        segments.append(Segment(unit=current_unit, ops=tuple(current)))
    return segments


def gradient_params(segments: Sequence[Segment]) -> list[tuple[ParamSpec, ...]]:
    """For each segment, the parameters whose gradient its backward produces first: its own, but
    a tied parameter a later segment uses again (``LayerOp.reuses``) at the last such segment,
    where backward reaches it first (autograd accumulates the others into that gradient)."""
    last_user: dict[str, int] = {}
    specs = {p.name: p for s in segments for p in s.params}
    for i, s in enumerate(segments):
        for p in s.params:
            last_user.setdefault(p.name, i)
        for op in s.ops:
            for name in op.reuses:
                last_user[name] = i
    out: list[list[ParamSpec]] = [[] for _ in segments]
    for name, i in last_user.items():
        out[i].append(specs[name])
    return [tuple(ps) for ps in out]


def input_needs_grad(unit: WrapUnit, segments: Sequence[Segment]) -> bool:
    """Whether the unit's forward input requires a gradient, i.e. some trainable parameter runs
    before it (FSDP2 registers its post-backward hook on inputs that require one). False for the
    unit whose input is the token ids and, under LoRA, for the first blocks before any adapter:
    they reduce in the final callback."""
    if unit.is_root:
        return False
    first = next(i for i, s in enumerate(segments) if s.unit == unit.name)
    return any(p.trainable for s in segments[:first] for p in s.params)
