"""One rank of a real training run: ``python -m validation.worker SPEC.json`` (or under torchrun).

Measures step time and its phases, peak memory by category (FSDPMemTracker, tensor level) and
the collectives issued per step, and writes ``rank{r}.json`` into the spec's output folder.
"""

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sim.io import write_text_atomic
from sim.scenario import Scenario, Strategy, load_scenario
from validation.build import build_llama, wrap
from validation.counting import CollectiveCounter, counting_allreduce_hook

# FSDPMemTracker categories -> the simulator's
TRACKER_CATEGORIES = {
    "Sharded Param": "params",
    "Unsharded Param": "params",
    "Buffer": "params",
    "Parameter": "params",
    "Sharded Grad": "grads",
    "Unsharded Grad": "grads",
    "Gradient": "grads",
    "OptState": "optimizer",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "All Gather": "comm_buffers",
    "Reduce Scatter": "comm_buffers",
    "Temp": "other",
}


def _mesh(scenario: Scenario):
    from torch.distributed.device_mesh import init_device_mesh

    k = scenario.parallel.world_size
    if scenario.parallel.strategy is Strategy.HYBRID_SHARD:
        s = scenario.shard_group_size
        return init_device_mesh("cpu", (k // s, s), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (k,), mesh_dim_names=("shard",))


def _batch(scenario: Scenario, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    t = scenario.training
    ids = torch.randint(0, scenario.model.vocab, (t.micro_batch, t.seq_len), generator=g)
    return ids, ids.clone()


class Trainer:
    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self.rank = dist.get_rank()
        mesh = None if scenario.parallel.strategy is Strategy.NO_SHARD else _mesh(scenario)
        model = build_llama(scenario.model, scenario.training.seq_len)
        self.wrapped = wrap(model, scenario, mesh)
        self.model = self.wrapped.model
        self.ddp_counts: dict[str, dict[str, int]] = {}
        if not self.wrapped.is_fsdp:
            self.model.register_comm_hook(None, counting_allreduce_hook(self.ddp_counts))  # type: ignore[operator]
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)
        self.autocast = (
            not self.wrapped.is_fsdp and scenario.param_dtype != "fp32"
        )  # DDP mixed precision = autocast

    def step(self, index: int) -> dict[str, float]:
        """One optimizer step (all micro-batches); returns phase times in seconds."""
        phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        for mb in range(self.scenario.training.grad_accum):
            ids, labels = _batch(self.scenario, self.rank, index * 100 + mb)
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                loss = self.model(input_ids=ids, labels=labels).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            phases["forward"] += t1 - t0
            phases["backward"] += t2 - t1
        t2 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        phases["optimizer"] = time.perf_counter() - t2
        return phases


def _peak_memory(trainer: Trainer, index: int) -> dict[str, int]:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if trainer.wrapped.is_fsdp:
        tracker: Any = FSDPMemTracker(trainer.model, trainer.optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(trainer.model, trainer.optimizer)
    with tracker:
        trainer.step(index)
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    out = {"total": int(snapshot.get("Total", 0))}
    for name, value in snapshot.items():
        if name != "Total":
            key = TRACKER_CATEGORIES.get(name, "other")
            out[key] = out.get(key, 0) + int(value)
    out["raw"] = {k: int(v) for k, v in snapshot.items()}  # type: ignore[assignment]
    if not trainer.wrapped.is_fsdp:
        # DDP's reducer allocates its bucket buffers in C++ at construction, where no tracker sees
        # them; they stay resident, so their size (from DDP's own logging data) adds to the peak
        buckets = _ddp_bucket_bytes(trainer.model)
        out["comm_buffers"] = out.get("comm_buffers", 0) + buckets
        out["total"] += buckets
    return out


def _ddp_bucket_bytes(ddp: Any) -> int:
    data = ddp._get_ddp_logging_data()
    return sum(int(x) for x in str(data.get("bucket_sizes", "")).split(",") if x.strip())


def run(spec: dict[str, Any]) -> dict[str, Any]:
    scenario = load_scenario(spec["scenario"], spec.get("overrides", []))
    trainer = Trainer(scenario)
    for i in range(spec["warmup"]):
        trainer.step(i)
    times, phases = [], []
    for i in range(spec["steps"]):
        dist.barrier()
        start = time.perf_counter()
        phases.append(trainer.step(spec["warmup"] + i))
        times.append(time.perf_counter() - start)
    counter = CollectiveCounter()
    with counter:
        trainer.step(spec["warmup"] + spec["steps"])
    counts = dict(counter.counts) if trainer.wrapped.is_fsdp else {}
    trainer.ddp_counts.clear()
    if not trainer.wrapped.is_fsdp:
        trainer.step(spec["warmup"] + spec["steps"] + 1)
        counts = {k: dict(v) for k, v in trainer.ddp_counts.items()}
    memory = _peak_memory(trainer, spec["warmup"] + spec["steps"] + 2)
    return {
        "rank": trainer.rank,
        "step_times_s": times,
        "phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "collectives": counts,
        "memory_peak": memory,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    dist.init_process_group(
        "gloo", timeout=__import__("datetime").timedelta(seconds=spec.get("timeout_s", 300))
    )
    try:
        result = run(spec)
        write_text_atomic(Path(spec["out_dir"]) / f"rank{dist.get_rank()}.json", json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # threads per rank come from OMP_NUM_THREADS, set by the launcher as torchrun does (cores / ranks)
    sys.exit(main(sys.argv[1:]))
