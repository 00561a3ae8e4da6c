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
  ``zero_grad(set_to_none=True)``), its module tracking keeping no gradient alive
  (``validation.tracker_hooks``: PyTorch's own holds a module's input gradients until all of
  them are computed, which the step without the tracker does not).
Kernels are the CPU ones (attention, loss); which attention kernel ran, and whether it was given
``is_causal`` or an explicit mask, is recorded in ``kernels``.
The attention mask is decided as in the real run (``one_sequence_per_row``): transformers counts a
FakeTensor as tracing and, unable to read the positions, would assume packed sequences and
materialise a mask (plus, with GQA, copies of K and V), where the real run passes ``is_causal``.
NO_SHARD (DDP) is not supported: DDP's reducer needs real tensors. FSDP1
(``parallel.fsdp_version = 1``, NO_SHARD included) runs the same way, measured by the storage-level
tracker of the real FSDP1 runs (``validation.step_memory``).
"""

import contextlib
import json
import os
import resource
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sim.childproc import ChildTimeout, run_module
from sim.errors import UserError
from sim.scenario.loader import load_scenario
from sim.scenario.sections import Scenario
from sim.workload.options import FinetuneMethod, Strategy
from validation.build import build_scenario_model, wrap
from validation.step_memory import AllocationLog
from validation.tracker_hooks import module_tracking_holds_no_gradients
from validation.worker import TRACKER_CATEGORIES, Trainer, _mesh

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm_buffers", "other")
# aten ops that tell which attention / loss kernel a CPU step ran
KERNEL_OPS = {
    "attention": ("scaled_dot_product", "aten._softmax.", "aten._safe_softmax."),
    "loss": ("nll_loss", "cross_entropy", "log_softmax"),
}
# attention's mask arguments across the SDPA overloads (flash/math take attn_mask, efficient/cudnn attn_bias)
MASK_ARGS = ("attn_mask", "attn_bias")
PEAK_TOP = 10  # storage sizes listed per category in ``peak_detail``


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
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)
        self.autocast = False  # FSDP2 mixed precision is the MixedPrecisionPolicy, not autocast


class KernelRecorder(TorchDispatchMode):
    """Records the aten overloads of the attention and loss kernels a step dispatches.

    ``kernels["attention_mask"]`` says how the forward SDPA kernels were masked: "is_causal" (no
    mask tensor, the causal flag), "mask" (an explicit mask tensor) or "none".
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels: dict[str, list[str]] = {kind: [] for kind in KERNEL_OPS}
        self.kernels["attention_mask"] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        for kind, words in KERNEL_OPS.items():
            if any(w in name for w in words) and name not in self.kernels[kind]:
                self.kernels[kind].append(name)
        if "scaled_dot_product" in name and "backward" not in name:
            masking = _attention_masking(func, args, kwargs or {})
            if masking not in self.kernels["attention_mask"]:
                self.kernels["attention_mask"].append(masking)
        return func(*args, **(kwargs or {}))


def _attention_masking(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """ "mask", "is_causal" or "none" for one call of an SDPA overload (arguments bound by its schema)."""
    bound = dict(kwargs)
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
    if any(bound.get(a) is not None for a in MASK_ARGS):
        return "mask"
    return "is_causal" if bound.get("is_causal") else "none"


@contextlib.contextmanager
def one_sequence_per_row(model: nn.Module) -> Iterator[None]:
    """Decide transformers' causal mask as the real run does: no packed sequences.

    Without a KV cache and without an ``attention_mask``, transformers' ``create_causal_mask``
    looks for packed sequences in ``position_ids`` (``masking_utils.find_packed_sequence_indices``:
    a position that does not follow its predecessor starts a new sequence). Reading the positions
    is data dependent, so for a FakeTensor (``is_tracing`` counts FakeTensors as tracing) it gives
    up and returns its fake result as if packed; ``create_causal_mask`` then materialises a mask
    instead of leaving SDPA its ``is_causal`` flag, and with GQA ``repeat_kv`` copies K and V
    (``use_gqa_in_sdpa`` needs no mask). Real runs, on the CPU and on GPUs alike, read the
    positions, find one sequence per row and take the mask-free path.

    Inside this context a FakeTensor of positions is answered "not packed" (None), which is
    exactly what the real run finds: ``validation.worker`` passes only ``input_ids`` and
    ``labels``, so the positions are the model's own ``arange(seq_len)`` on every row. A forward
    that is given ``position_ids`` or an ``attention_mask`` (whose values fake tensors lack)
    raises a UserError instead of being measured on the wrong path. Real tensors, and
    everything outside the context, keep transformers' own decision.
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if isinstance(position_ids, FakeTensor):
            return None  # the model's own arange positions: one sequence per row
        return original(position_ids)

    def refuse_value_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        given = [k for k in ("position_ids", "attention_mask") if kwargs.get(k) is not None]
        if given:
            raise UserError(
                f"fake memory measurement: the step passes {' and '.join(given)}; deciding the "
                "attention mask from them needs their values, which fake tensors do not have"
            )

    hook = model.register_forward_pre_hook(refuse_value_inputs, with_kwargs=True)
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
        hook.remove()


def attention_kernel(kernels: dict[str, list[str]]) -> str:
    """The simulator's ``backend.attention_kernel`` for the recorded ops: "flash" (a fused
    kernel), "math" (SDPA's math path, which softmaxes with ``_safe_softmax``) or "eager" (the
    model's own attention: ``_softmax``, Gemma 2's soft-capping)."""
    names = kernels.get("attention", [])
    if any("flash" in n or "efficient" in n or "cudnn" in n for n in names):
        return "flash"
    return "math" if any("_safe_softmax" in n for n in names) else "eager"


def _tracker_class() -> type:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class PeakTracker(FSDPMemTracker):
        """FSDPMemTracker that also notes where the peak happened (and, with detail, what was live)."""

        def __init__(self, *args: Any, detail: bool = False, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.detail = detail
            self.last_op = ""
            self.peak_where: dict[str, Any] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.last_op = str(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _track(self, reftype: Any, t: torch.Tensor) -> None:
            super()._track(reftype, t)
            if self.detail:  # note the op that created each storage
                from torch.distributed._tools.common_utils import get_untyped_storages

                for st in get_untyped_storages(t):
                    winfo, _ = self._WINFO.get(st, (None, None))
                    if winfo is not None and not hasattr(winfo, "created_by"):
                        winfo.created_by = self.last_op.removeprefix("aten.").removesuffix(".default")

        def _update_peak_stats(self, peak_state: Any) -> None:
            before = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            if self._peak_mem != before:
                phase = "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
                self.peak_where = {
                    "op": self.last_op,
                    "phase": phase,
                    "modules": sorted(self._mod_tracker.parents),
                }
                if self.detail:
                    self.peak_where["storages"] = self._live_storages()

        def _live_storages(self) -> dict[str, list[list[Any]]]:
            """Per tracker category, the largest groups of live storages: [[bytes, count, op], ...]."""
            sizes: Counter[tuple[str, int, str]] = Counter()
            for winfo, w_st in list(self._WINFO.values()):
                if w_st() is not None and winfo.mem_consumed > 0:
                    op = getattr(winfo, "created_by", "before the step")
                    sizes[(_name(winfo.reftype), winfo.mem_consumed, op)] += 1
            out: dict[str, list[list[Any]]] = {}
            for (category, nbytes, op), count in sorted(sizes.items(), key=lambda kv: -kv[0][1] * kv[1]):
                if len(out.setdefault(category, [])) < PEAK_TOP:
                    out[category].append([nbytes, count, op])
            return out

    return PeakTracker


def _name(key: Any) -> str:
    return str(getattr(key, "value", key))  # tracker keys are str enums (_FSDPRefType) and "Total"


def categories(snapshot: dict[str, int]) -> dict[str, int]:
    """A tracker snapshot in the simulator's categories (``validation.worker.TRACKER_CATEGORIES``)."""
    out = dict.fromkeys(CATEGORIES, 0)
    for name, value in snapshot.items():
        if name != "Total":
            key = TRACKER_CATEGORIES.get(name, "other")
            out[key] = out.get(key, 0) + int(value)
    return out


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
            with _post_forward_meshes_outside_fake_mode():
                trainer = FakeTrainer(scenario, mesh)
            with one_sequence_per_row(trainer.model), catch_all_reshard_by_storage():
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


@contextlib.contextmanager
def catch_all_reshard_by_storage() -> Iterator[None]:
    """FSDP1's final callback reshards what no hook did (``_catch_all_reshard``: a frozen flat
    parameter whose unit's inputs need no gradient) unless ``flat_param.data_ptr()`` is already its
    local shard's; every fake tensor's pointer is 0, so in fake mode it never reshards and the
    unsharded parameters live into the next step. The same test by storage identity, which fake
    tensors keep; the reshard itself is FSDP1's."""
    from torch.distributed.fsdp import _runtime_utils
    from torch.multiprocessing.reductions import StorageWeakRef

    original = _runtime_utils._catch_all_reshard

    def by_storage(state: Any) -> None:
        handle = state._handle
        if not handle:
            return
        flat = handle.flat_param
        same = (
            StorageWeakRef(flat.untyped_storage()).cdata
            == StorageWeakRef(flat._local_shard.untyped_storage()).cdata
        )
        if same and not handle._skipped_use_sharded_views:
            return
        _runtime_utils._reshard(state, handle, _runtime_utils._should_free_in_backward(state, handle))

    _runtime_utils._catch_all_reshard = by_storage
    try:
        yield
    finally:
        _runtime_utils._catch_all_reshard = original


@contextlib.contextmanager
def _post_forward_meshes_outside_fake_mode() -> Iterator[None]:
    """An integer ``reshard_after_forward`` makes ``fully_shard`` build a post-forward
    ``DeviceMesh`` (``_fsdp_init._get_post_forward_mesh_info``), whose rank tensors must be real,
    as ``_mesh`` builds the step's mesh outside the fake mode; the mesh itself is FSDP2's own."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    original = _fsdp_init._get_post_forward_mesh_info

    def outside(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    _fsdp_init._get_post_forward_mesh_info = outside
    _fully_shard._get_post_forward_mesh_info = outside
    try:
        yield
    finally:
        _fsdp_init._get_post_forward_mesh_info = original
        _fully_shard._get_post_forward_mesh_info = original


def _fsdp2_step(trainer: FakeTrainer, detail: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    from hfmodel.finetune import quant_state_bytes

    tracker = _tracker_class()(trainer.model, trainer.optimizer, detail=detail)
    # FSDPMemTracker refuses a module's second forward in one tracked step; its module
    # statistics are reset between micro-batches (the peak is kept)
    trainer.after_microbatch = tracker.reset_mod_stats  # type: ignore[method-assign]
    with module_tracking_holds_no_gradients(), tracker:
        _tracked_steps(trainer)
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    raw = {_name(name): int(value) for name, value in snapshot.items()}
    quant = quant_state_bytes(trainer.model)  # QLoRA's, allocated before the step: not tracked
    if quant:
        raw["Quant State"] = quant
        raw["Total"] = raw.get("Total", 0) + quant
    return {"total": raw.get("Total", 0), **categories(raw), "raw": raw}, tracker.peak_where


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


def measure_fake_memory_subprocess(
    scenario_path: str, overrides: list[str], timeout_s: float, detail: bool = False
) -> dict[str, Any]:
    """``measure_fake_memory`` in a ``python -m validation.fake_memory`` child of its own, forked
    from a server that imported torch and transformers once (``sim.childproc``).

    Adds ``process_wall_s`` (the child's whole run; the server's imports only in a process's
    first) and ``max_rss_bytes`` (the child's peak resident memory, the imported packages
    included). A failing or timed-out child raises a UserError.
    """
    args = [str(scenario_path)]
    for text in overrides:
        args += ["--set", text]
    if detail:
        args.append("--detail")
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    try:  # forked from a server that imported torch and transformers once (sim.childproc)
        proc = run_module(
            "validation.fake_memory",
            args,
            env=env,
            cwd=root,
            timeout_s=timeout_s,
            preload=("validation.fake_memory",),
        )
    except ChildTimeout:
        raise UserError(
            f"fake memory measurement of {scenario_path} {' '.join(overrides)} timed out after {timeout_s:.0f} s"
        ) from None
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise UserError(
            f"fake memory measurement of {scenario_path} {' '.join(overrides)} failed "
            f"(exit code {proc.returncode}):\n{tail}"
        )
    try:
        result: dict[str, Any] = json.loads(lines[-1])
    except json.JSONDecodeError:
        raise UserError(
            f"fake memory measurement of {scenario_path}: no JSON in the child's output"
        ) from None
    result["process_wall_s"] = time.perf_counter() - start
    return result


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
