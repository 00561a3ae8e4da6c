"""The simulated step's reserved memory with FSDP1's initialisation in front of it: whether the
segments ``FullyShardedDataParallel``'s initialisation leaves cached change what the step
reserves (``make validate-published`` quotes both, beside the published reserved)."""

from collections.abc import Sequence

from sim.core.events import MemoryCategory, MemoryRecord
from sim.outputs.allocator import (
    Served,
    allocator_order,
    serve_record,
    steady_state_replay,
    workspace_records,
)
from sim.outputs.caching_allocator import CachingAllocator
from sim.schedule.model_state import stored_bytes, unit_stored_bytes
from sim.simulate import SimResult
from sim.workload.units import WrapUnit


def fsdp1_init_order(units: Sequence[WrapUnit]) -> list[WrapUnit]:
    """The order FSDP1 initialises its units in: ``_recursive_wrap`` wraps a module's children
    before the module, so a nested unit (a longer module path) comes before the one holding it, in
    forward order, and the root last."""

    def holder(unit: WrapUnit) -> str:
        inside = [u.prefix for u in units if not u.is_root and unit.prefix.startswith(u.prefix + ".")]
        return max(inside, key=len, default="")

    order: list[WrapUnit] = []

    def visit(prefix: str) -> None:
        for unit in units:
            if not unit.is_root and holder(unit) == prefix:
                visit(unit.prefix)
                order.append(unit)

    visit("")
    return [*order, *(u for u in units if u.is_root)]


def simulated_reserved_bytes(result: SimResult, *, fsdp1_init: bool) -> tuple[int, int]:
    """(reserved after the initialisation, peak reserved of the step) of rank 0's simulated
    allocations through ``CachingAllocator``, as ``sim.outputs.allocator.reserved_curve`` replays
    them (the cuBLAS workspaces first; the step in its steady state). With ``fsdp1_init`` the allocator first goes through FSDP1's
    initialisation as ``FullyShardedDataParallel(module, device_id=...)`` does it to a model on the
    CPU: per unit (``fsdp1_init_order``) each parameter moved to the GPU, the ``FlatParameter``
    made (``torch.cat``) and the parameters freed, the shard cloned out of it (the step's
    ``param:`` record) and the full one freed; then ``empty_cache()`` and the peak reset, as
    llama-recipes' ``MemoryTrace`` does at an epoch's start. The shards then live where that left
    them, not packed at the step's start."""
    device = result.profile.device
    records = allocator_order(list(result.events.memory_of(0)))
    allocator = CachingAllocator(device.memory_bytes - device.context_bytes)
    served: Served = {}
    if fsdp1_init:
        shards = {r.label: r for r in records if r.delta_bytes > 0 and r.label.startswith("param:")}
        for rec in _fsdp1_init_records(result, shards):
            serve_record(allocator, rec, served)
        allocator.release_free_segments()
        allocator.peak_reserved = allocator.reserved
    after_init = allocator.reserved
    for rec in workspace_records(0, device.cublas_workspace_bytes or 0):
        serve_record(allocator, rec, served)
    reserved = steady_state_replay(allocator, records, served)  # a placed shard stays where it is
    return after_init, max(reserved)


def _fsdp1_init_records(result: SimResult, shards: dict[str, MemoryRecord]) -> list[MemoryRecord]:
    """FSDP1's initialisation as memory records on the compute stream, unit by unit
    (``fsdp1_init_order``): its parameters moved, its FlatParameter made, the parameters freed,
    its shard (the step's ``param:`` record) cloned out, the FlatParameter freed."""
    step = result.step
    out: list[MemoryRecord] = []

    def record(label: str, nbytes: int, pieces: tuple[int, ...] = ()) -> None:
        if nbytes == 0:  # a unit without parameters of its own moves and flattens nothing
            return
        out.append(
            MemoryRecord(
                rank=0,
                time_s=0.0,
                category=MemoryCategory.PARAMS,
                delta_bytes=nbytes,
                label=label,
                pieces=pieces,
            )
        )

    for unit in fsdp1_init_order(step.units):
        moved = tuple(p.numel * stored_bytes(step, p) for p in unit.params)
        flat = step.padded_numel(unit) * unit_stored_bytes(step, unit)
        record(f"init:{unit.name}", sum(moved), moved)
        record(f"flat:{unit.name}", flat)
        record(f"init:{unit.name}", -sum(moved))
        shard = shards.get(f"param:{unit.name}")
        if shard is not None:
            out.append(shard)
        record(f"flat:{unit.name}", -flat)
    return out
