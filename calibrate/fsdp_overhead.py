"""What FSDP2 itself costs on the host, measured with the real ``fully_shard`` (and FSDP1's,
with the real ``FullyShardedDataParallel``, the same way).

- Per-unit overhead: FSDP2's hooks, DTensor bookkeeping, buffer allocation (fresh pages on a
  CPU) and stream/event handling around every unit in forward and backward. It depends on the
  unit's parameters, not on the batch, so it is measured on ``CHAIN`` decoder layers of the
  scenario's dimensions run on a batch of ``TINY_SEQ`` tokens, where compute is small: the layers
  wrapped one ``fully_shard`` per layer plus the root on the calibration's world mesh, against
  the same layers unwrapped, in interleaved repetitions. The wrapped time less its collectives
  (timed around each blocking call, so a late rank's wait goes too), less the plain time, over
  ``CHAIN``, less the copies the simulator charges separately (all-gather copy-in and copy-out,
  reduce-scatter copy-in, at the measured copy rate), is the overhead of one unit. On a GPU the
  host runs ahead of the device and the collectives do not block it, so nothing is subtracted
  but the copies, and the figure is recorded only.
- Optimizer on FSDP2's parameters: FSDP2 keeps each sharded parameter as a DTensor, and
  ``AdamW(foreach=True)`` pays DTensor's dispatch on every foreach call. It is timed on the
  scenario's parameter shards as DTensors (``Shard(0)`` on the calibration's world mesh).
"""

import math
import statistics
from typing import Any

import torch
import torch.distributed as dist

from calibrate.compute import ComputeTarget
from calibrate.overheads import optimizer_shard_shapes, optimizer_step_s_per_param
from calibrate.sweep import TORCH_DTYPES
from calibrate.unit_timing import synced_now
from sim.workload.model import ModelConfig

CHAIN = 4  # wrapped layers
TINY_SEQ = 8


def world_mesh(device: torch.device) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.group.WORLD
    assert group is not None, "the process group is initialised before calibrating"
    return DeviceMesh.from_group(group, device.type)


class _Chain(torch.nn.Module):
    """``CHAIN`` decoder layers called as ``LlamaModel`` calls them."""

    def __init__(self, model: ModelConfig, device: torch.device, dtype: torch.dtype):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        from calibrate.hf_llama import llama_config

        super().__init__()
        torch.manual_seed(0)
        config = llama_config(model, TINY_SEQ, n_layers=CHAIN)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(CHAIN))
        self.to(device=device, dtype=dtype)
        self.position_ids = torch.arange(TINY_SEQ, device=device).unsqueeze(0)
        with torch.no_grad():
            rotary = LlamaRotaryEmbedding(config=config).to(device)
            self.cos_sin = rotary(torch.empty(1, device=device, dtype=dtype), self.position_ids)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(
                h, attention_mask=None, position_ids=self.position_ids, position_embeddings=self.cos_sin
            )
        return h


def _step(
    chain: torch.nn.Module, hidden: int, device: torch.device, dtype: torch.dtype
) -> tuple[float, float]:
    """(forward, backward) seconds of one step, blocking collectives left out on a CPU."""
    from calibrate.collective_timer import timed_collectives

    x = torch.randn(1, TINY_SEQ, hidden, device=device, dtype=dtype, requires_grad=True)
    records: list[tuple[str, float, float, int]] = []
    with timed_collectives(records):
        t0 = synced_now(device)
        loss = chain(x).float().sum()
        t1 = synced_now(device)
        loss.backward()
        t2 = synced_now(device)
    for p in chain.parameters():
        p.grad = None
    if device.type == "cuda":
        return t1 - t0, t2 - t1
    forward_comm = sum(e - s for _, s, e, _ in records if e <= t1)
    backward_comm = sum(e - s for _, s, e, _ in records if s >= t1)
    return t1 - t0 - forward_comm, t2 - t1 - backward_comm


def _chain(target: ComputeTarget, device: torch.device, dtype: torch.dtype) -> "_Chain | Any":
    """``CHAIN`` decoder layers: a described model's own first block (``calibrate.hf_units``),
    else Llama's."""
    if target.model.description is None:
        return _Chain(target.model, device, dtype)
    from calibrate.hf_units import BlockChain

    return BlockChain(target, device, dtype, count=CHAIN, batch=1, seq_len=TINY_SEQ)


def _padded(shapes: list[tuple[int, ...]], world: int) -> int:
    return sum(math.ceil(s[0] / world) * world * math.prod(s[1:]) for s in shapes)


def _copy_bytes(target: ComputeTarget, world: int, param_bytes: int) -> tuple[int, int]:
    """Bytes of the copies the simulator charges one layer (``sim.schedule.fsdp2``) in forward and
    in backward (fp32 shards, fp32 reduction, resharded after forward; under LoRA only the
    adapters have gradients to reduce-scatter)."""
    padded = _padded(target.block_param_shapes(), world)
    all_gather = padded // world * max(param_bytes, 4) + padded * param_bytes  # copy-in + copy-out
    with_grads = _padded(target.block_param_shapes(trainable_only=True), world)
    return all_gather, all_gather + with_grads * max(param_bytes, 4)  # + reduce-scatter copy-in


def _fsdp1_copy_bytes(target: ComputeTarget, world: int, param_bytes: int) -> tuple[int, int]:
    """Bytes of the copies ``sim.schedule.fsdp1`` charges one layer in forward (the cast into the
    low-precision shard) and in backward (the flat gradient's concatenation, the cast to the fp32
    reduce dtype), at the calibration's settings (reduce in fp32, ``use_orig_params=False``); under
    LoRA only the adapters have flat gradients."""
    flat = sum(math.prod(s) for s in target.block_param_shapes())
    padded = math.ceil(flat / world) * world
    forward = padded // world * max(param_bytes, 4) if param_bytes != 4 else 0
    grads = sum(math.prod(s) for s in target.block_param_shapes(trainable_only=target.finetuned))
    padded_grads = math.ceil(grads / world) * world
    backward = grads * param_bytes + (grads * 4 if param_bytes != 4 else 0)
    backward += padded_grads * 4 if padded_grads > grads else 0
    return forward, backward


def _fsdp2_chain(target: ComputeTarget, device: torch.device) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    wrapped = _chain(target, device, torch.float32)  # FSDP2 keeps fp32 shards and casts for compute
    mesh = world_mesh(device)
    policy = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[target.param_dtype], reduce_dtype=torch.float32)
    for layer in wrapped.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(wrapped, mesh=mesh, mp_policy=policy)
    return wrapped


def _fsdp1_chain(target: ComputeTarget, device: torch.device) -> torch.nn.Module:
    from functools import partial

    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    chain = _chain(target, device, torch.float32)
    compute = TORCH_DTYPES[target.param_dtype]
    # each layer, and under LoRA each adapter (PEFT's policy, as ``parallel.wrap = "peft"``)
    layers = {id(layer) for layer in chain.layers} | {id(m) for m in _adapters(chain)}
    # cast_forward_inputs: the chain hands each layer fp32 rotary tables, as FSDP2's policy casts them
    mp = (
        MixedPrecision(param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=True)
        if compute != torch.float32
        else None
    )
    return FullyShardedDataParallel(
        chain,
        auto_wrap_policy=partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in layers),
        mixed_precision=mp,
        device_id=device,
    )


def _adapters(chain: torch.nn.Module) -> list[torch.nn.Module]:
    """The leaf modules with a trainable weight (LoRA's adapters; none in full training)."""
    return (
        [
            m
            for m in chain.modules()
            if not list(m.children()) and getattr(m, "weight", None) is not None and m.weight.requires_grad
        ]
        if any(not p.requires_grad for p in chain.parameters())
        else []
    )


def unit_overhead(
    target: ComputeTarget, device: torch.device, reps: int, copy_Bps: float, version: int = 2
) -> dict[str, float]:
    """Seconds FSDP2 (``version`` 1: FSDP1) adds per unit in forward and in backward beyond the
    modelled copies (>= 0), and the raw figures before that floor."""
    compute = TORCH_DTYPES[target.param_dtype]
    plain = _chain(target, device, compute)
    wrapped = _fsdp2_chain(target, device) if version == 2 else _fsdp1_chain(target, device)
    samples: dict[str, list[tuple[float, float]]] = {"plain": [], "fsdp": []}
    rounds = max(reps, 10)
    for rep in range(rounds + 2):  # two warm-up rounds: FSDP2's lazy init runs in the first
        for name, chain in (("plain", plain), ("fsdp", wrapped)):
            times = _step(chain, target.model.hidden, device, compute)
            if rep >= 2:
                samples[name].append(times)
    world = dist.get_world_size() if dist.is_initialized() else 1
    copy_bytes = _copy_bytes if version == 2 else _fsdp1_copy_bytes
    copies = copy_bytes(target, world, compute.itemsize)
    # FSDP1 under LoRA: a layer is its block's unit and its adapters'; each unit is charged a share
    units_per_layer = 1 + (len(_adapters(plain)) // CHAIN if version == 1 else 0)
    out: dict[str, float] = {}
    for index, phase in enumerate(("forward", "backward")):
        extra = statistics.fmean(t[index] for t in samples["fsdp"]) - statistics.fmean(
            t[index] for t in samples["plain"]
        )
        out[f"{phase}_raw_s"] = (extra / CHAIN - copies[index] / copy_Bps) / units_per_layer
        out[f"{phase}_s"] = max(0.0, out[f"{phase}_raw_s"])
    return out


def dtensor_optimizer_s_per_param(target: ComputeTarget, device: torch.device, reps: int) -> dict[str, float]:
    """Seconds per parameter element of one optimizer step over the scenario's fp32 shards held
    as DTensors, as FSDP2 holds them."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = world_mesh(device)
    params = []
    for shape in optimizer_shard_shapes(target):
        local = torch.randn(shape, device=device)
        full = torch.Size((shape[0] * mesh.size(), *shape[1:]))
        dt = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full, stride=_contiguous(full)
        )
        p = torch.nn.Parameter(dt)
        p.grad = DTensor.from_local(
            torch.randn(shape, device=device),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=full,
            stride=_contiguous(full),
        )
        params.append(p)
    return optimizer_step_s_per_param(params, device, reps)


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))
