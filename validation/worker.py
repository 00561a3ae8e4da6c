"""One rank of a real training run: ``python -m validation.worker SPEC.json`` (or under torchrun).

Measures step time and its phases, peak memory by category (FSDPMemTracker, tensor level; on a
GPU also ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``) and the collectives
issued per step, and writes ``rank{r}.json`` into the spec's output folder. On a machine with
CUDA it runs NCCL on ``cuda:LOCAL_RANK`` and synchronises the device around every timer; without
CUDA it runs gloo on the CPU. With ``allocator_trace`` in the spec (a GPU), the caching
allocator's history is recorded from before the model is built, and the run's own allocation
sequence is replayed through the simulator's allocator model (``validation.allocator_trace``);
with ``allocator_trace_file`` too, rank 0 saves that trace there (``save_trace``).
"""

import contextlib
import datetime
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from calibrate.unit_timing import synced_now
from sim.fileio import write_text_atomic
from sim.scenario.loader import load_scenario
from sim.scenario.sections import Scenario
from sim.workload.options import Strategy
from validation.build import batch as _batch
from validation.build import build_optimizer, build_scenario_model, step_loss, wrap
from validation.counting import CollectiveCounter, counting_allreduce_hook
from validation.tracker_categories import categories, optimizer_state_bytes


def _mesh(scenario: Scenario, device_type: str = "cpu"):
    from torch.distributed.device_mesh import init_device_mesh

    k = scenario.parallel.world_size
    if scenario.parallel.strategy.is_hybrid:
        s = scenario.shard_group_size
        return init_device_mesh(device_type, (k // s, s), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (k,), mesh_dim_names=("shard",))


class Trainer:
    device = torch.device("cpu")

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self.rank = dist.get_rank()
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        no_shard = scenario.parallel.strategy is Strategy.NO_SHARD
        mesh = None if no_shard else _mesh(scenario, self.device.type)
        model = build_scenario_model(scenario)
        if no_shard:
            model = model.to(self.device)  # fully_shard moves parameters to the mesh's device itself
        self.wrapped = wrap(model, scenario, mesh)
        self.model = self.wrapped.model
        self.ddp_counts: dict[str, dict[str, int]] = {}
        self.ddp_buckets: dict[int, torch.Tensor] = {}  # DDP's bucket buffers, by index
        if not self.wrapped.is_fsdp:
            hook = counting_allreduce_hook(self.ddp_counts, self.ddp_buckets)
            self.model.register_comm_hook(None, hook)  # type: ignore[operator]
        self.optimizer = build_optimizer(self.model.parameters(), scenario)
        self.autocast = (
            not self.wrapped.is_fsdp and scenario.param_dtype != "fp32"
        )  # DDP mixed precision = autocast

    def step(self, index: int) -> dict[str, float]:
        """One optimizer step (all micro-batches); returns phase times in seconds."""
        phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.marks: list[tuple[str, float, float]] = []  # (phase, start, end) on the host clock
        for mb in range(self.scenario.training.grad_accum):
            inputs = _batch(self.scenario, self.rank, index * 100 + mb, self.device)
            last = mb == self.scenario.training.grad_accum - 1
            # DDP decides in its forward whether the backward reduces (``no_sync`` must hold the
            # forward too); FSDP2's flag is read in backward
            with self._gradient_sync(last):
                t0 = synced_now(self.device)
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    loss, self.outputs = step_loss(self.model, inputs, self.scenario.training.keep_outputs)
                t1 = synced_now(self.device)
                loss.backward()
            if last:
                self._clip_grad_norm()
            t2 = synced_now(self.device)
            phases["forward"] += t1 - t0
            phases["backward"] += t2 - t1
            self.after_microbatch()
            self.marks += [("forward", t0, t1), ("backward", t1, t2)]
        t2 = synced_now(self.device)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = synced_now(self.device)
        phases["optimizer"] = t3 - t2
        self.marks.append(("optimizer", t2, t3))
        return phases

    def _clip_grad_norm(self) -> None:
        """``training.max_grad_norm``: FSDP1's own ``clip_grad_norm_``, else torch's foreach one
        (FSDP2's DTensor gradients, DDP's); timed with the last backward, where the simulated
        step's phases count it (``validation.compare.simulated_phases``)."""
        norm = self.scenario.training.max_grad_norm
        if norm <= 0:
            return
        own = getattr(self.model, "clip_grad_norm_", None)  # FullyShardedDataParallel's
        if own is not None:
            own(norm)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), norm, foreach=True)

    def after_microbatch(self) -> None:
        """Called after each micro-batch's backward (the fake-mode tracker resets its module stats)."""

    def _gradient_sync(self, last: bool) -> Any:
        """``training.sync_every_microbatch = false``: FSDP2's ``set_requires_gradient_sync`` (or
        DDP's ``no_sync``) off on every micro-batch but the last."""
        sync = last or self.scenario.training.sync_every_microbatch
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(sync)  # type: ignore[operator]
            return contextlib.nullcontext()
        return contextlib.nullcontext() if sync else self.model.no_sync()  # type: ignore[operator]


def _storage_peak(trainer: Any, index: int) -> dict[str, Any] | None:
    """FSDP1 and DeepSpeed, whose storages PyTorch's trackers cannot follow: ``validation.step_memory``."""
    from validation.step_memory import measure_fsdp1_step, measure_step_from_live_tensors

    if trainer.wrapped.fsdp_version == 1:
        return measure_fsdp1_step(trainer.model, trainer.optimizer, lambda: trainer.step(index))
    if trainer.wrapped.fsdp_version == 0:  # DeepSpeed: every tensor alive when the step starts
        return measure_step_from_live_tensors(trainer.model, lambda: trainer.step(index))
    return None


def _peak_memory(trainer: Any, index: int) -> dict[str, int]:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from validation.tracker_hooks import tracking_holds_no_gradients

    storage = _storage_peak(trainer, index)
    if storage is not None:
        return storage
    if trainer.wrapped.is_fsdp:
        tracker: Any = FSDPMemTracker(trainer.model, trainer.optimizer)
    else:
        tracker = MemTracker()
        # DDP's reducer allocates its bucket buffers in C++ at construction, where no tracker sees
        # them; they stay resident. Told of them (the hook kept them in the backwards before), the
        # tracker counts them from the start as "Other"; untold, it met each at its first
        # ``copy_`` and counted it from there as "Temp" (the 5m model's optimizer-step peak had
        # every bucket twice once their sizes were added on top)
        tracker.track_external(trainer.model, trainer.optimizer, *trainer.ddp_buckets.values())
    state_bytes = optimizer_state_bytes(trainer.optimizer)
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)
    # a second micro-batch's forward runs the modules again: the tracker's per-module stats are
    # reset after each backward (as in fake mode), its step-wide peak kept
    trainer.after_microbatch = tracker.reset_mod_stats
    try:
        with tracking_holds_no_gradients(), tracker:  # the step's memory, not the tracker's
            trainer.step(index)
    finally:
        del trainer.after_microbatch
    snapshot = tracker.get_tracker_snapshot("peak").get(trainer.device) or next(
        iter(tracker.get_tracker_snapshot("peak").values())
    )
    out: dict[str, Any] = {"total": int(snapshot.get("Total", 0)), **categories(snapshot, state_bytes)}
    out["raw"] = {k: int(v) for k, v in snapshot.items()}
    if cuda:  # the allocator's own figures, beside the tracker's tensor-level ones
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(trainer.device)
        out["cuda_max_reserved"] = torch.cuda.max_memory_reserved(trainer.device)
    if not trainer.wrapped.is_fsdp:  # the only external tensors DDP's tracker was told of
        buckets, logged = int(snapshot.get("Other", 0)), _ddp_bucket_bytes(trainer.model)
        if buckets != logged:  # a bucket the hook did not keep would be counted from its first use
            raise RuntimeError(f"the tracker holds {buckets} B of DDP buckets, DDP logs {logged} B")
        out["other"] -= buckets
        out["comm_buffers"] = out.get("comm_buffers", 0) + buckets
    return out


def _ddp_bucket_bytes(ddp: Any) -> int:
    data = ddp._get_ddp_logging_data()
    return sum(int(x) for x in str(data.get("bucket_sizes", "")).split(",") if x.strip())


def make_trainer(scenario: Scenario) -> Any:
    """The scenario's real run: DeepSpeed's engine, or FSDP2 / FSDP1 / DDP."""
    if scenario.deepspeed.enabled:
        from validation.build_deepspeed import DeepSpeedTrainer

        return DeepSpeedTrainer(scenario)
    return Trainer(scenario)


# the caching allocator's history kept for the check: far more entries than a small model's run makes
TRACE_ENTRIES = 2_000_000


def run(spec: dict[str, Any]) -> dict[str, Any]:
    tracing = bool(spec.get("allocator_trace")) and torch.cuda.is_available()
    if tracing:  # no stacks: the trace only (context=None keeps recording cheap)
        torch.cuda.memory._record_memory_history(context=None, max_entries=TRACE_ENTRIES)
    trainer = make_trainer(load_scenario(spec["scenario"], spec.get("overrides", [])))
    for i in range(spec["warmup"]):
        trainer.step(i)
    times, phases = [], []
    for i in range(spec["steps"]):
        dist.barrier()
        start = synced_now(trainer.device)
        phases.append(trainer.step(spec["warmup"] + i))
        times.append(synced_now(trainer.device) - start)
    counter = CollectiveCounter()
    with counter:
        trainer.step(spec["warmup"] + spec["steps"])
    counts = dict(counter.counts) if trainer.wrapped.is_fsdp else {}
    trainer.ddp_counts.clear()
    if not trainer.wrapped.is_fsdp:
        trainer.step(spec["warmup"] + spec["steps"] + 1)
        counts = {k: dict(v) for k, v in trainer.ddp_counts.items()}
    memory = _peak_memory(trainer, spec["warmup"] + spec["steps"] + 2)
    timeline: dict[str, Any] = {}
    if trainer.device.type == "cpu":  # host timestamps are the step's timeline only when collectives block
        from calibrate.collective_timer import timed_collectives

        records: list[tuple[str, float, float, int]] = []
        dist.barrier()
        with timed_collectives(records):
            trainer.step(spec["warmup"] + spec["steps"] + 3)
        timeline = {"phases": trainer.marks, "collectives": records}
    allocator: dict[str, int] = {}
    if tracing:
        from validation.allocator_trace import check_trace

        index = trainer.device.index or 0
        entries = torch.cuda.memory._snapshot(trainer.device)["device_traces"][index]
        torch.cuda.memory._record_memory_history(enabled=None)
        capacity = torch.cuda.get_device_properties(trainer.device).total_memory
        allocator = check_trace(entries, capacity)
        allocator["traced_entries_limit"] = TRACE_ENTRIES
        if spec.get("allocator_trace_file") and trainer.rank == 0:  # the trace itself, to read elsewhere
            from validation.allocator_trace import save_trace

            name = torch.cuda.get_device_name(trainer.device)
            save_trace(spec["allocator_trace_file"], entries, capacity_bytes=capacity, device=name)
    return {
        "rank": trainer.rank,
        "step_times_s": times,
        "allocator_trace": allocator,
        "phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "collectives": counts,
        "memory_peak": memory,
        "timeline": timeline,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    # threads per rank come from OMP_NUM_THREADS, set by the launcher as torchrun does (cores /
    # ranks); a rank forked from a preloaded server (validation.launch) has the server's OpenMP
    # settings, which read the variable when torch was imported there, so set them here
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=spec.get("timeout_s", 300)))
    try:
        result = run(spec)
        write_text_atomic(Path(spec["out_dir"]) / f"rank{dist.get_rank()}.json", json.dumps(result))
        # Every rank finished before any tears its process group down: gloo otherwise sometimes
        # aborts a rank at teardown under the other's last (functional) collective.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
