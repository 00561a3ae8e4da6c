"""The simulated step's reserved memory with FSDP1's initialisation in front of it: whether the
segments ``FullyShardedDataParallel``'s initialisation leaves cached change what the step
reserves (``make validate-published`` quotes both, beside the published reserved)."""

from collections.abc import Sequence

from sim.core.events import Stream
from sim.outputs.allocator import CachingAllocator, allocator_order, tensor_sizes
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
    them (the cuBLAS workspace first). With ``fsdp1_init`` the allocator first goes through FSDP1's
    initialisation as ``FullyShardedDataParallel(module, device_id=...)`` does it to a model on the
    CPU: per unit (``fsdp1_init_order``) each parameter moved to the GPU, the ``FlatParameter``
    made (``torch.cat``) and the parameters freed, the shard cloned out of it (the step's
    ``param:`` record) and the full one freed; then ``empty_cache()`` and the peak reset, as
    llama-recipes' ``MemoryTrace`` does at an epoch's start. The shards then live where that left
    them, not packed at the step's start."""
    step, device = result.step, result.profile.device
    records = allocator_order(list(result.events.memory_of(0)))
    by_label = {r.label: r for r in records if r.delta_bytes > 0}
    allocator = CachingAllocator(device.memory_bytes - device.context_bytes)
    served: dict[str, int] = {}

    def malloc(label: str, sizes: Sequence[int], stream: Stream) -> None:
        served[label] = len(sizes)
        for k, nbytes in enumerate(sizes):
            allocator.malloc(f"{label}#{k}", nbytes, stream)

    def free(label: str) -> None:
        for k in range(served.pop(label)):
            allocator.free(f"{label}#{k}")

    placed: set[str] = set()
    if fsdp1_init:
        for unit in fsdp1_init_order(step.units):
            moved = [p.numel * stored_bytes(step, p) for p in unit.params]
            malloc(f"init:{unit.name}", moved, Stream.COMPUTE)
            malloc(
                f"flat:{unit.name}", [step.padded_numel(unit) * unit_stored_bytes(step, unit)], Stream.COMPUTE
            )
            free(f"init:{unit.name}")
            shard = by_label.get(f"param:{unit.name}")
            if shard is not None:
                malloc(shard.label, tensor_sizes(shard), shard.stream)
                placed.add(shard.label)
            free(f"flat:{unit.name}")
        allocator.release_free_segments()
        allocator.peak_reserved = allocator.reserved
    after_init = allocator.reserved
    if device.cublas_workspace_bytes:
        malloc("cublas_workspace", [device.cublas_workspace_bytes], Stream.COMPUTE)
    for rec in records:
        if rec.delta_bytes > 0 and rec.label not in placed:
            malloc(rec.label, tensor_sizes(rec), rec.stream)
        elif rec.delta_bytes <= 0:
            free(rec.label)
    return after_init, allocator.peak_reserved
