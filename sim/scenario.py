"""Scenario files: TOML in, a frozen ``Scenario`` out, every mistake named by file and key.

Each section is a small keyword-only frozen dataclass; the loader checks unknown keys (with a
did-you-mean), types and allowed values, then cross-field rules. ``--set a.b=value`` overrides
go through the same checks.
"""

import difflib
import tomllib
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from sim.dtypes import canonical_dtype
from sim.errors import UserError
from sim.model import ModelConfig, preset


class Strategy(StrEnum):
    NO_SHARD = "NO_SHARD"  # DDP
    SHARD_GRAD_OP = "SHARD_GRAD_OP"  # ZeRO-2
    FULL_SHARD = "FULL_SHARD"  # ZeRO-3
    HYBRID_SHARD = "HYBRID_SHARD"  # ZeRO-3 within a shard group, replicated across groups


class WrapPolicy(StrEnum):
    MODEL = "model"
    BLOCK = "block"
    LINEAR = "linear"


class CheckpointMode(StrEnum):
    NONE = "none"
    FULL = "full"


class OptimizerName(StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"
    NONE = "none"


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    preset: str | None = None
    n_layers: int | None = None
    hidden: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    vocab: int | None = None
    tie_embeddings: bool | None = None


@dataclass(frozen=True, kw_only=True)
class TrainingSection:
    micro_batch: int = 1
    seq_len: int = 2048
    grad_accum: int = 1
    avg_seq_len: int | None = None  # mean real tokens per sequence padded to seq_len; None: no padding


@dataclass(frozen=True, kw_only=True)
class ParallelSection:
    world_size: int = 8
    strategy: Strategy = Strategy.FULL_SHARD
    wrap: WrapPolicy = WrapPolicy.BLOCK
    shard_group_size: int | None = None  # HYBRID_SHARD; default: cluster.gpus_per_node
    reshard_after_forward: bool | None = None  # None: True for FULL/HYBRID_SHARD, False for SHARD_GRAD_OP
    forward_prefetch: int = (
        0  # units all-gathered ahead explicitly in forward (set_modules_to_forward_prefetch)
    )
    backward_prefetch: int = 1  # units all-gathered ahead in backward; 1 is FSDP2's implicit default
    ddp_bucket_mb: float = 25.0  # NO_SHARD: DistributedDataParallel bucket_cap_mb


@dataclass(frozen=True, kw_only=True)
class PrecisionSection:
    param_dtype: str = "fp32"  # MixedPrecisionPolicy.param_dtype; master params stay fp32
    reduce_dtype: str | None = None  # default: param_dtype


@dataclass(frozen=True, kw_only=True)
class OptimizerSection:
    name: OptimizerName = OptimizerName.ADAMW


@dataclass(frozen=True, kw_only=True)
class CheckpointingSection:
    mode: CheckpointMode = CheckpointMode.NONE


@dataclass(frozen=True, kw_only=True)
class ClusterSection:
    profile: str = "h100-sxm"  # built-in profile name or path to a calibrated JSON profile
    gpus_per_node: int | None = None  # default: the profile's
    compute_scaling: bool = False  # accept a compute section measured at other dimensions, scaled


@dataclass(frozen=True, kw_only=True)
class SimulationSection:
    seed: int = 0
    compute_jitter: float = 0.0  # relative std-dev of each compute op's time, per rank
    slow_rank: int | None = None
    slow_rank_factor: float = 1.0  # e.g. 1.1: slow_rank's compute takes 10 % longer


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "training": TrainingSection,
    "parallel": ParallelSection,
    "precision": PrecisionSection,
    "optimizer": OptimizerSection,
    "checkpointing": CheckpointingSection,
    "cluster": ClusterSection,
    "simulation": SimulationSection,
}


@dataclass(frozen=True, kw_only=True)
class Scenario:
    source: str
    model: ModelConfig
    training: TrainingSection
    parallel: ParallelSection
    precision: PrecisionSection
    optimizer: OptimizerSection
    checkpointing: CheckpointingSection
    cluster: ClusterSection
    simulation: SimulationSection

    @property
    def param_dtype(self) -> str:
        return self.precision.param_dtype

    @property
    def reduce_dtype(self) -> str:
        return self.precision.reduce_dtype or self.precision.param_dtype

    @property
    def reshard_after_forward(self) -> bool:
        if self.parallel.reshard_after_forward is not None:
            return self.parallel.reshard_after_forward
        return self.parallel.strategy is not Strategy.SHARD_GRAD_OP

    @property
    def shard_group_size(self) -> int:
        """Ranks that hold one copy of the sharded state (the all-gather/reduce-scatter group)."""
        strategy, k = self.parallel.strategy, self.parallel.world_size
        if strategy is Strategy.NO_SHARD:
            return 1
        if strategy is Strategy.HYBRID_SHARD:
            return self.parallel.shard_group_size or min(k, self.gpus_per_node)
        return k

    @property
    def gpus_per_node(self) -> int:
        if self.cluster.gpus_per_node is not None:
            return self.cluster.gpus_per_node
        from sim.profile import load_profile

        return load_profile(self.cluster.profile, where=f"{self.source}: cluster.profile").gpus_per_node

    @property
    def tokens_per_step(self) -> int:
        """Real (non-padding) tokens of one optimizer step over all ranks."""
        t = self.training
        real = t.seq_len if t.avg_seq_len is None else t.avg_seq_len
        return t.micro_batch * real * t.grad_accum * self.parallel.world_size


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, name: str, where: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert (int -> float, str -> enum)."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        if value is None and type(None) in args:
            return None
        return _coerce(value, inner[0], name, where)
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        allowed = [m.value for m in tp]
        matches = [m for m in tp if isinstance(value, str) and m.value.lower() == value.lower()]
        if not matches:
            raise UserError(f"{where}: {name} = {value!r} is not allowed; allowed: {', '.join(allowed)}")
        return matches[0]
    ok = (
        (tp is bool and isinstance(value, bool))
        or (tp is int and isinstance(value, int) and not isinstance(value, bool))
        or (tp is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (tp is str and isinstance(value, str))
    )
    if not ok:
        raise UserError(f"{where}: {name} must be {_type_name(tp)}, got {value!r}")
    return float(value) if tp is float else value


def _did_you_mean(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; allowed: {', '.join(options)}"


def _build_section(name: str, cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise UserError(f"{where}: [{name}] must be a table")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    for key in raw:
        if key not in known:
            raise UserError(f"{where}: unknown key {name}.{key}{_did_you_mean(key, known)}")
    values = {k: _coerce(v, hints[k], f"{name}.{k}", where) for k, v in raw.items()}
    return cls(**values)


def _resolve_model(section: ModelSection, where: str) -> ModelConfig:
    dims = {f.name: getattr(section, f.name) for f in fields(section) if f.name != "preset"}
    given = {k: v for k, v in dims.items() if v is not None}
    if section.preset is not None:
        cfg = replace(preset(section.preset, where), **given)
        if given:
            cfg = replace(cfg, name=f"{cfg.name}*")
    else:
        required = [f.name for f in fields(ModelConfig) if f.default is MISSING and f.name not in given]
        if required:
            raise UserError(f"{where}: model needs model.preset or all of: {', '.join(required)}")
        cfg = ModelConfig(name="custom", **given)
    cfg.check(where)
    return cfg


def _check(s: Scenario, where: str) -> None:
    def positive(name: str, value: float) -> None:
        if value <= 0:
            raise UserError(f"{where}: {name} must be > 0, got {value}")

    for name in ("micro_batch", "seq_len", "grad_accum"):
        positive(f"training.{name}", getattr(s.training, name))
    avg = s.training.avg_seq_len
    if avg is not None and not 0 < avg <= s.training.seq_len:
        raise UserError(
            f"{where}: training.avg_seq_len must be in [1, training.seq_len = {s.training.seq_len}], got {avg}"
        )
    p = s.parallel
    positive("parallel.world_size", p.world_size)
    positive("parallel.ddp_bucket_mb", p.ddp_bucket_mb)
    if p.forward_prefetch < 0 or p.backward_prefetch < 0:
        raise UserError(f"{where}: parallel.forward_prefetch and parallel.backward_prefetch must be >= 0")
    for name in ("param_dtype", "reduce_dtype"):
        value = getattr(s.precision, name)
        if value is not None:
            try:
                canonical_dtype(value)
            except UserError as e:
                raise UserError(f"{where}: precision.{name}: {e}") from None
    if s.cluster.gpus_per_node is not None:
        positive("cluster.gpus_per_node", s.cluster.gpus_per_node)
    if p.shard_group_size is not None:
        positive("parallel.shard_group_size", p.shard_group_size)
    if p.strategy is Strategy.HYBRID_SHARD:
        g = s.shard_group_size
        if g <= 0 or p.world_size % g:
            raise UserError(
                f"{where}: parallel.world_size ({p.world_size}) must be divisible by parallel.shard_group_size ({g})"
            )
    elif p.shard_group_size is not None:
        raise UserError(f"{where}: parallel.shard_group_size applies only to strategy HYBRID_SHARD")
    sim = s.simulation
    if sim.compute_jitter < 0:
        raise UserError(f"{where}: simulation.compute_jitter must be >= 0")
    positive("simulation.slow_rank_factor", sim.slow_rank_factor)
    if sim.slow_rank is not None and not 0 <= sim.slow_rank < p.world_size:
        raise UserError(
            f"{where}: simulation.slow_rank must be in [0, {p.world_size - 1}], got {sim.slow_rank}"
        )


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse ``section.key=value``; the value is read as TOML, else taken as a plain string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise UserError(f"--set {text!r}: expected section.key=value, e.g. parallel.world_size=64")
    path, raw = text.split("=", 1)
    section, key = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, key, value


def scenario_from_dict(data: dict[str, Any], where: str, overrides: Sequence[str] = ()) -> Scenario:
    # a [sweep] table describes variants of this scenario; `fsdpsim sweep` reads it (sim.sweep)
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items() if k != "sweep"}
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SECTIONS:
            raise UserError(
                f"--set {text!r}: unknown section {section!r}{_did_you_mean(section, list(SECTIONS))}"
            )
        if not isinstance(data.setdefault(section, {}), dict):
            raise UserError(f"{where}: [{section}] must be a table")
        data[section][key] = value
    for name in data:
        if name not in SECTIONS:
            raise UserError(f"{where}: unknown section [{name}]{_did_you_mean(name, list(SECTIONS))}")
    built = {name: _build_section(name, cls, data.get(name, {}), where) for name, cls in SECTIONS.items()}
    model = _resolve_model(built.pop("model"), where)
    scenario = Scenario(source=where, model=model, **built)
    _check(scenario, where)
    return scenario


def load_scenario(path: str | Path, overrides: Sequence[str] = ()) -> Scenario:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: scenario file not found")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{p}: not valid TOML ({e})") from None
    return scenario_from_dict(data, str(p), overrides)
