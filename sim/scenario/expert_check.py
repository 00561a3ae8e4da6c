"""What ``parallel.expert_parallel`` (expert parallelism, a what-if) models, checked at load.

Modelled as torchtitan trains an MoE model with EP (``torchtitan/distributed/fsdp.py``
``apply_fsdp``, ``parallel_dims.py`` sparse mesh ("dp_replicate", "efsdp", "ep")): FSDP2
``fully_shard`` per decoder block with full training, FULL_SHARD or SHARD_GRAD_OP over the world,
whole blocks checkpointed or none (a recomputed block exchanges its tokens again). Everything else is refused here, in one line naming the key.
"""

from sim.errors import UserError
from sim.scenario.sections import Scenario
from sim.workload.options import CheckpointMode, Strategy, WrapPolicy


def check_expert_parallel(s: Scenario, where: str) -> None:
    e, p = s.parallel.expert_parallel, s.parallel
    key = f"{where}: parallel.expert_parallel = {e}"
    if e < 1:
        raise UserError(f"{key} must be >= 1 (1: no expert parallelism)")
    if e == 1:
        return
    d = s.model.description
    if d is None or d.moe is None:
        raise UserError(f"{key} needs a model with experts (model.config or a library MoE model)")
    if p.world_size % e or d.moe.experts % e:
        raise UserError(
            f"{key} must divide parallel.world_size ({p.world_size}) and the experts per layer ({d.moe.experts})"
        )
    refusals = (
        (
            p.fsdp_version != 2 or s.deepspeed.enabled,
            "is modelled under FSDP2 only (parallel.fsdp_version = 2)",
        ),
        (
            p.strategy not in (Strategy.FULL_SHARD, Strategy.SHARD_GRAD_OP),
            f"is modelled with FULL_SHARD or SHARD_GRAD_OP, not {p.strategy.value}",
        ),
        (
            p.wrap is not WrapPolicy.BLOCK,
            'is modelled with parallel.wrap = "block" (one fully_shard per block)',
        ),
        (s.finetune.lora, 'is modelled for full training only (finetune.method = "full")'),
        (p.cpu_offload, "is not modelled with parallel.cpu_offload"),
        (
            isinstance(p.reshard_after_forward, int) and not isinstance(p.reshard_after_forward, bool),
            "is not modelled with an integer parallel.reshard_after_forward",
        ),
        (
            s.checkpointing.mode is CheckpointMode.SELECTIVE and s.checkpointing.selective == "op",
            "is not modelled with op-level selective checkpointing (torchtitan's policy keeps the "
            'all-to-alls\' outputs): use checkpointing.mode = "full" or selective = N',
        ),
    )
    for refused, why in refusals:
        if refused:
            raise UserError(f"{key} {why}")
