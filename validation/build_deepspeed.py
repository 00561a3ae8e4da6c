"""A real DeepSpeed ZeRO run of a scenario: ``deepspeed.initialize`` with the scenario's config
(``sim.scenario.deepspeed_config.deepspeed_config``), on the gloo group the worker created
(DeepSpeed picks its CPU accelerator by itself here; ``init_distributed`` reuses the group).

The step is DeepSpeed's idiom: per micro-batch ``engine(...)``, ``engine.backward(loss)`` and
``engine.step()`` (which steps the optimizer only at the accumulation boundary).
"""

from typing import Any

import torch

from calibrate.deepspeed_overhead import without_shm_comm_build
from calibrate.unit_timing import synced_now
from sim.scenario.deepspeed_config import deepspeed_config
from sim.scenario.sections import Scenario
from sim.workload.checkpointing import checkpoint_plan
from validation.build import Wrapped, apply_checkpointing, batch, build_scenario_model, step_loss


class DeepSpeedTrainer:
    device = torch.device("cpu")

    def __init__(self, scenario: Scenario):
        import deepspeed
        import torch.distributed as dist

        if not torch.cuda.is_available():
            without_shm_comm_build()
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        self.scenario = scenario
        self.rank = dist.get_rank()
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        model = build_scenario_model(scenario)
        c = scenario.checkpointing
        plan = checkpoint_plan(c.mode, c.selective, scenario.model.n_layers)
        if plan.active:  # non-reentrant, per decoder layer, before DeepSpeed wraps the model
            apply_checkpointing(model, plan, scenario)
        config = deepspeed_config(scenario)
        config["train_batch_size"] = (
            scenario.training.micro_batch * scenario.training.grad_accum * dist.get_world_size()
        )
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        self.model: Any = engine
        self.optimizer: Any = optimizer
        self.wrapped = Wrapped(engine, [], is_fsdp=True, fsdp_version=0)
        self.ddp_counts: dict[str, dict[str, int]] = {}
        self.marks: list[tuple[str, float, float]] = []

    def step(self, index: int) -> dict[str, float]:
        phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.marks = []
        engine = self.model
        for mb in range(self.scenario.training.grad_accum):
            inputs = batch(self.scenario, self.rank, index * 100 + mb, self.device)
            t0 = synced_now(self.device)
            loss, self.outputs = step_loss(engine, inputs, self.scenario.training.keep_outputs)
            t1 = synced_now(self.device)
            engine.backward(loss)
            t2 = synced_now(self.device)
            engine.step()
            t3 = synced_now(self.device)
            phases["forward"] += t1 - t0
            phases["backward"] += t2 - t1
            phases["optimizer"] += t3 - t2
            self.marks += [("forward", t0, t1), ("backward", t1, t2), ("optimizer", t2, t3)]
        return phases
