"""Real FSDP2 peak memory of one rank of any world size, in one process, without real memory.

``python -m validation.fake_memory SCENARIO [--set k=v ...] [--detail]`` prints one JSON object.

How (the recipe of torchtitan's memory estimator, checked here against a real 2-process gloo run
of the same scenario: identical bytes in every tracker category):
- a fake process group (``FakeStore``, backend ``"fake"``, rank 0 of ``parallel.world_size``):
  collectives are issued and return without moving data or allocating temporaries;
- the device mesh built outside the fake mode, exactly as ``validation.worker`` builds it (1-D
  ``("shard",)``; HYBRID_SHARD 2-D ``("replicate", "shard")``), on device type ``"cpu"``;
- the model built under ``FakeTensorMode`` (tensors with shapes and dtypes but no storage), then
  wrapped by ``validation.build.wrap`` and given ``AdamW(foreach=True)``;
- one untracked step (creates the optimizer state), then ``FSDPMemTracker`` around one more step
  (``validation.worker.Trainer.step``: forward, backward, ``optimizer.step()``,
  ``zero_grad(set_to_none=True)``), its module tracking and its post-backward wrapper keeping
  no gradient alive (``validation.tracker_hooks``: PyTorch's own hold a module's input gradients
  until all of them are computed, and each parameter group's last gradient through its reduce,
  which the step without the tracker does not).
Kernels are the CPU ones (attention, loss); which attention kernel ran, and whether it was given
``is_causal`` or an explicit mask, is recorded in ``kernels``.
The attention mask is decided as in the real run (``one_sequence_per_row``): transformers counts a
FakeTensor as tracing and, unable to read the positions, would assume packed sequences and
materialise a mask (plus, with GQA, copies of K and V), where the real run passes ``is_causal``.
NO_SHARD (DDP) is not supported: DDP's reducer needs real tensors. FSDP1
(``parallel.fsdp_version = 1``, NO_SHARD included) runs the same way, measured by the storage-level
tracker of the real FSDP1 runs (``validation.step_memory``).

This module holds the measurement itself and its command line; the rest of it lives in
``validation.kernel_recorder`` (which attention and loss kernels ran), ``validation.peak_tracker``
(FSDPMemTracker noting where its peak was; the simulator's categories), ``validation.fake_mode_patches``
(``one_sequence_per_row`` and the other patches that keep a fake step on the real step's path) and
``validation.fake_memory_child`` (``measure_fake_memory_subprocess``: this module run as a child).
"""

import contextlib
import json
import resource
import sys
import time
from typing import Any

import torch.distributed as dist

from sim.errors import UserError
from sim.scenario.loader import load_scenario
from sim.scenario.sections import Scenario
from sim.workload.options import FinetuneMethod, Strategy
from validation.build import build_optimizer, build_scenario_model, wrap
from validation.fake_mode_patches import (
    catch_all_reshard_by_storage,
    one_sequence_per_row,
    post_forward_meshes_outside_fake_mode,
)
from validation.kernel_recorder import KernelRecorder, attention_kernel
from validation.peak_tracker import peak_tracker_class
from validation.step_memory import AllocationLog
from validation.tracker_categories import categories, optimizer_state_bytes, tracker_key_name
from validation.tracker_hooks import tracking_holds_no_gradients
from validation.worker import Trainer, _mesh


class FakeTrainer(Trainer):
    """``validation.worker.Trainer`` with the model built under the active fake mode on a given mesh."""

    def __init__(self, scenario: Scenario, mesh: Any):  # noqa: D107 (same fields as Trainer)
        self.scenario = scenario
        self.rank = dist.get_rank()
        model = build_scenario_model(scenario)
        self.wrapped = wrap(model, scenario, mesh)
        self.model = self.wrapped.model
        self.ddp_counts = {}
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters
        self.optimizer = build_optimizer(trainable, scenario)
        self.autocast = False  # FSDP2 mixed precision is the MixedPrecisionPolicy, not autocast


def _check_supported(scenario: Scenario) -> None:
    if scenario.parallel.strategy is Strategy.NO_SHARD and scenario.parallel.fsdp_version == 2:
        raise UserError(
            f"{scenario.source}: parallel.strategy = NO_SHARD is not supported in fake mode "
            "(DDP's reducer needs real tensors); measure it with a real run (validation.worker)"
        )
    if dist.is_initialized():
        raise UserError(
            "fake memory measurement needs a process without a process group "
            "(use measure_fake_memory_subprocess: the fake group and fake mode leak global state)"
        )


def _kernels(real: bool) -> Any:
    if not real:
        return contextlib.nullcontext()
    from validation.qlora import unfused_4bit_matmul

    return unfused_4bit_matmul()


def _uses_real_tensors(scenario: Scenario) -> bool:
    """QLoRA runs on real tensors: bitsandbytes' fake kernels give shapes but do not quantize, and
    allocate none of the dequantized weights the real kernels allocate."""
    return scenario.finetune.method is FinetuneMethod.QLORA


def measure_fake_memory(
    scenario: Scenario, detail: bool = False, log: AllocationLog | None = None
) -> dict[str, Any]:
    """Peak bytes of rank 0 in one tracked FSDP2 step at ``parallel.world_size`` ranks, by category.

    QLoRA runs on real tensors under the same fake process group (a small model only), and the
    4-bit layers' quantization state, module attributes allocated before the step that the
    tracker does not see, is added to the parameters (``raw["Quant State"]``, measured from the
    tensors bitsandbytes made).

    Returns ``total`` (the tracker's peak), the six simulator categories at that peak, ``raw``
    (the tracker's own categories), ``world_size``, ``wall_s`` (build and both steps),
    ``kernels`` (attention/loss aten ops that ran, ``attention_mask`` how attention was masked,
    ``attention_kernel`` in the simulator's terms)
    and ``peak_at`` (op, phase, modules at the peak; live storage sizes with ``detail``).
    Leaves a destroyed process group and global fake-mode state behind: call once per process.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _check_supported(scenario)
    start = time.perf_counter()
    k = scenario.parallel.world_size
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=k)
    try:
        mesh = _mesh(scenario)  # outside the fake mode: DeviceMesh needs real rank tensors
        real = _uses_real_tensors(scenario)
        with contextlib.nullcontext() if real else FakeTensorMode(), _kernels(real):
            with post_forward_meshes_outside_fake_mode():
                trainer = FakeTrainer(scenario, mesh)
            t = scenario.training
            rows = one_sequence_per_row(trainer.model, padded=t.padded, packed=t.packed)
            with rows, catch_all_reshard_by_storage():
                with KernelRecorder() as recorder:
                    trainer.step(0)  # untracked: creates the optimizer state
                if scenario.parallel.fsdp_version == 1:
                    measured, where = _fsdp1_step(trainer, log), {"tracker": "validation.step_memory"}
                else:
                    measured, where = _fsdp2_step(trainer, detail)
    finally:
        dist.destroy_process_group()
    return {
        **measured,
        "world_size": k,
        "wall_s": time.perf_counter() - start,
        "kernels": {**recorder.kernels, "attention_kernel": attention_kernel(recorder.kernels)},
        "peak_at": where,
    }


def _fsdp2_step(trainer: FakeTrainer, detail: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    from hfmodel.finetune import quant_state_bytes

    tracker = peak_tracker_class()(trainer.model, trainer.optimizer, detail=detail)
    state_bytes = optimizer_state_bytes(trainer.optimizer)
    # FSDPMemTracker refuses a module's second forward in one tracked step; its module
    # statistics are reset between micro-batches (the peak is kept)
    trainer.after_microbatch = tracker.reset_mod_stats  # type: ignore[method-assign]
    with tracking_holds_no_gradients(), tracker:
        _tracked_steps(trainer)
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    raw = {tracker_key_name(name): int(value) for name, value in snapshot.items()}
    quant = quant_state_bytes(trainer.model)  # QLoRA's, allocated before the step: not tracked
    if quant:
        raw["Quant State"] = quant
        raw["Total"] = raw.get("Total", 0) + quant
    return {"total": raw.get("Total", 0), **categories(raw, state_bytes), "raw": raw}, tracker.peak_where


def _fsdp1_step(trainer: FakeTrainer, log: AllocationLog | None = None) -> dict[str, Any]:
    """FSDP1 under the fake group: the storage-level tracker the real FSDP1 runs use (with ``log``,
    every storage it allocates and frees, ``validation.allocator_replay``)."""
    from hfmodel.finetune import quant_state_bytes
    from validation.step_memory import measure_fsdp1_step

    measured = measure_fsdp1_step(trainer.model, trainer.optimizer, lambda: _tracked_steps(trainer), log)
    quant = quant_state_bytes(trainer.model)  # QLoRA's: module attributes, not parameters or buffers
    if quant:  # allocated before the step and held through it, as in the FSDP2 run
        measured["total"] += quant
        measured["params"] += quant
        measured["raw"]["quant_state"] = quant
    return measured


def _tracked_steps(trainer: FakeTrainer) -> None:
    """The tracked step; with ``training.keep_outputs`` two, so that the second runs while the
    first's output is held (the steady state; the trackers count only what a tracked op made)."""
    trainer.step(1)
    if trainer.scenario.training.keep_outputs:
        trainer.step(2)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m validation.fake_memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument("scenario")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--detail", action="store_true", help="list the storages live at the peak")
    args = parser.parse_args(argv)
    try:
        result = measure_fake_memory(load_scenario(args.scenario, args.overrides), detail=args.detail)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
