"""FSDP2's parameter groups and the bytes of their buffers: which parameters FSDP2 casts to
``param_dtype``, the dtype it all-gathers each in, one group's all-gather output, copy-in cast
buffer and padded gradients (torch 2.13 ``_fully_shard/_fsdp_param.py``, ``_fsdp_init.py``), read
by the FSDP2 schedule (``sim.schedule.fsdp2``).
"""

from dataclasses import dataclass

from sim.core.topology import GroupKind
from sim.dtypes import FLOAT_DTYPES
from sim.schedule.fsdp2_offload import OffloadBytes
from sim.schedule.model_state import stored_bytes
from sim.schedule.step import StepConfig
from sim.workload.params import ParamSpec
from sim.workload.units import WrapUnit

EXPERTS = "#experts"  # the name of a unit's expert parameter group (expert parallelism)


def cast_to_param_dtype(cfg: StepConfig, p: ParamSpec) -> bool:
    """FSDP2 casts a parameter to ``param_dtype`` when it is a float of another dtype
    (``FSDPParam.init_dtype_attrs``): the fp32 trainable ones under mixed precision."""
    stored = p.dtype or "fp32"
    return stored in FLOAT_DTYPES and stored != cfg.param_dtype


def gathered_bytes(cfg: StepConfig, p: ParamSpec) -> int:
    """Bytes per element FSDP2 all-gathers and unshards ``p`` in."""
    return cfg.param_bytes if cast_to_param_dtype(cfg, p) else stored_bytes(cfg, p)


@dataclass(frozen=True, kw_only=True)
class UnitBytes:
    """One unit's FSDP2 buffers: the all-gather output (= its unsharded parameters), the copy-in
    cast buffer of the parameters cast to ``param_dtype``, the bytes the copy-in reads, and the
    padded elements with gradients (what it reduce-scatters)."""

    gather: int
    cast: int
    copy_in: int
    grad_padded: int
    grad_numel: int  # the unsharded gradients (what accumulates without gradient sync)
    offload: OffloadBytes  # CPUOffloadPolicy: the shards' copy to the device

    @staticmethod
    def of(cfg: StepConfig, params: tuple[ParamSpec, ...]) -> "UnitBytes":
        """The buffers of one parameter group (a unit, or under EP its dense or expert part)."""
        pad = [(p, *cfg.param_sharding(p)) for p in params]
        return UnitBytes(
            gather=sum(n * gathered_bytes(cfg, p) for p, n, _ in pad),
            cast=sum(n // w * cfg.param_bytes for p, n, w in pad if cast_to_param_dtype(cfg, p)),
            copy_in=sum(n // w * max(gathered_bytes(cfg, p), stored_bytes(cfg, p)) for p, n, w in pad),
            grad_padded=sum(n for p, n, _ in pad if p.trainable),
            grad_numel=sum(p.numel for p in params if p.trainable),
            offload=OffloadBytes(
                h2d=sum(n // w * stored_bytes(cfg, p) for p, n, w in pad),
                kept=sum(n // w * stored_bytes(cfg, p) for p, n, w in pad if not cast_to_param_dtype(cfg, p)),
                cast=sum(n // w * cfg.param_bytes for p, n, w in pad if cast_to_param_dtype(cfg, p)),
                staging=max(
                    (n // w * stored_bytes(cfg, p) for p, n, w in pad if cast_to_param_dtype(cfg, p)),
                    default=0,
                ),
            ),
        )


def param_groups(cfg: StepConfig, unit: WrapUnit) -> tuple[tuple[str, tuple[ParamSpec, ...]], ...]:
    """A unit's FSDPParamGroups, named: one, or under expert parallelism the dense parameters
    (sharded over the world) then the local experts (over ``world / E`` ranks), as
    ``fully_shard(block, shard_placement_fn=...)`` groups them by process group, in registration
    order (``_fsdp_init._init_param_group``, torchtitan ``apply_fsdp``)."""
    experts = tuple(p for p in unit.params if p.name in cfg.expert_params)
    if not experts:
        return ((unit.name, unit.params),)
    dense = tuple(p for p in unit.params if p.name not in cfg.expert_params)
    return ((unit.name, dense), (unit.name + EXPERTS, experts))


@dataclass(frozen=True, kw_only=True)
class ParamGroups:
    """Every unit's FSDPParamGroups (``param_groups``): their names, the unit each belongs to, its
    buffers' bytes, and the size and kind of the group of ranks it is sharded over."""

    of_unit: dict[str, tuple[str, ...]]  # unit -> its groups' names, in registration order
    unit_of: dict[str, str]  # group -> its unit
    sizes: dict[str, UnitBytes]
    shard_size: dict[str, int]  # the experts' over ``world / E`` ranks, the rest over the world
    kind: dict[str, GroupKind]
    # group -> the parameter whose unsharded gradient ``foreach_reduce`` holds until it returns:
    # its last trainable one in registration order, on a group sharded over more than one rank
    # (``sim.schedule.fsdp2_reduce``)
    held_grad: dict[str, str]

    @staticmethod
    def of(cfg: StepConfig) -> "ParamGroups":
        groups = {u.name: param_groups(cfg, u) for u in cfg.units}
        unit_of = {g: unit for unit, gs in groups.items() for g, _ in gs}
        shard_size = {
            g: cfg.shard_size // (cfg.expert_parallel if g.endswith(EXPERTS) else 1) for g in unit_of
        }
        last_trainable = {
            g: next((p.name for p in reversed(params) if p.trainable), None)
            for gs in groups.values()
            for g, params in gs
        }
        return ParamGroups(
            of_unit={unit: tuple(g for g, _ in gs) for unit, gs in groups.items()},
            unit_of=unit_of,
            sizes={g: UnitBytes.of(cfg, params) for gs in groups.values() for g, params in gs},
            shard_size=shard_size,
            kind={g: GroupKind.EXPERT_SHARD if g.endswith(EXPERTS) else GroupKind.SHARD for g in unit_of},
            held_grad={
                g: name for g, name in last_trainable.items() if name is not None and shard_size[g] > 1
            },
        )
