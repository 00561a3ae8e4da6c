"""What FSDP1 fixes for each unit's ``FlatParameter`` when it wraps the model (torch 2.13
``fsdp/_flat_param.py``, ``_init_utils.py``): its elements, whether it is sharded and over which
group, its own dtype and whether it trains, and the dtypes it gathers and reduces in.
"""

from dataclasses import dataclass

from sim.core.topology import GroupKind
from sim.schedule.model_state import fsdp1_unit_trains, unit_dtype, unit_stored_bytes
from sim.schedule.step import StepConfig


@dataclass(frozen=True, kw_only=True)
class FlatParams:
    """Each unit's flat parameter, by unit name, and the sharding every one of them shares."""

    numel: dict[str, int]  # unpadded elements
    sharded: bool
    reduce_group: GroupKind
    shard_size: int  # ranks a flat parameter is sharded over (1: not sharded)
    stored_bytes: dict[str, int]  # per element, in its own dtype (uniform within a unit)
    trains: dict[str, bool]
    param_bytes: dict[str, int]  # per element, as gathered and computed in
    reduce_bytes: dict[str, int]  # per element, as reduced in
    param_dtype: dict[str, str]
    reduce_dtype: dict[str, str]

    @staticmethod
    def of(cfg: StepConfig) -> "FlatParams":
        assert cfg.fsdp1 is not None
        # FSDP1 clamps any strategy to NO_SHARD on a one-rank process group (``_init_core_state``):
        # HSDP with one-rank shard groups then all-reduces within that group and never across replicas
        sharded = cfg.sharded and cfg.shard_size > 1
        stored = {u.name: unit_stored_bytes(cfg, u) for u in cfg.units}
        # without MixedPrecision each flat parameter gathers, computes and reduces in its own dtype
        mp = cfg.fsdp1.mixed_precision
        return FlatParams(
            numel={u.name: cfg.flat_numel(u) for u in cfg.units},
            sharded=sharded,
            reduce_group=GroupKind.SHARD if cfg.sharded else GroupKind.REPLICATE,
            shard_size=cfg.shard_size if sharded else 1,
            stored_bytes=stored,
            trains={u.name: fsdp1_unit_trains(u) for u in cfg.units},
            param_bytes={u: cfg.param_bytes if mp else b for u, b in stored.items()},
            reduce_bytes={u: cfg.reduce_bytes if mp else b for u, b in stored.items()},
            param_dtype={u.name: cfg.param_dtype if mp else unit_dtype(cfg, u) for u in cfg.units},
            reduce_dtype={u.name: cfg.reduce_dtype if mp else unit_dtype(cfg, u) for u in cfg.units},
        )

    def mixed(self, unit: str) -> bool:
        """``_uses_param_mixed_precision``: the flat parameter's dtype is not ``param_dtype``."""
        return self.stored_bytes[unit] != self.param_bytes[unit]
