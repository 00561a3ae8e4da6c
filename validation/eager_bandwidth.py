"""How fast eager PyTorch's memory-bound kernels move bytes on a GPU, from published kernel timings.

    python -m validation.eager_bandwidth          # the table and each part's figure
    python -m validation.eager_bandwidth --check  # exit 1 where a built-in profile disagrees

The GPU kernel model (``sim.costs.gpu``) times a model's elementwise and reduction work as the
bytes eager PyTorch moves (``hfmodel.trace``: every non-view aten call reads its tensor inputs and
writes its outputs) over a bandwidth. A streaming benchmark's rate (``achievable_hbm_bandwidth_Bps``,
one read and one write stream) is the best case; ATen's eager kernels — type casts, broadcasts,
row reductions, a chain of small kernels per norm — move their bytes slower. This module measures
by how much: it runs the HuggingFace/torch reference implementations that Liger-Kernel's
benchmarks time (``validation/data/liger_eager_kernels.json``: HF's RMSNorm, HF's rotary
embedding, ``torch.nn.functional.cross_entropy``, ``torch.nn.LayerNorm``; forward and backward)
under ``FakeTensorMode``, counts their bytes with the tracer's own rule, and divides by the
published time. A pass counts when its bytes take at least ``MIN_STREAM_S`` at the streaming rate
(bandwidth-bound; below that the launch floor the model charges separately dominates). A part's
``eager_memory_efficiency`` is the median over its counted passes of (bytes / time) / streaming
rate, to three decimals.

The byte count is the tracer's, not the kernels' true traffic (e.g. ``nll_loss_backward`` is
charged for reading the log-probabilities it only indexes): the efficiency is defined against the
same count the simulator multiplies it with, so what it corrects is the time, consistently.
"""

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "liger_eager_kernels.json"
MIN_STREAM_S = 100e-6
# the built-in profile each measured GPU is (its streaming rate is the denominator)
PROFILE_OF_GPU = {
    "NVIDIA A100-SXM4-80GB": "a100-sxm-80g",
    "NVIDIA A100 80GB PCIe": "a100-pcie-80g",
    "NVIDIA H100 NVL": "h100-nvl",
}


@dataclass(frozen=True, kw_only=True)
class Pass:
    """One timed forward or backward of one reference op at one size."""

    gpu: str
    kernel: str
    size: str
    direction: str  # "forward" | "backward"
    moved_bytes: int
    measured_s: float
    streaming_Bps: float

    @property
    def efficiency(self) -> float:
        return self.moved_bytes / self.measured_s / self.streaming_Bps

    @property
    def counted(self) -> bool:
        return self.moved_bytes / self.streaming_Bps >= MIN_STREAM_S


def _counted_bytes(build: Callable[[], tuple[Callable[[], Any], tuple[Any, ...]]]) -> tuple[int, int]:
    """(forward, backward) bytes the tracer's rule counts for one op, on fake tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from hfmodel.trace import _work

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.moved = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            self.moved += _work(str(func), func, args, kwargs, out)[2]
            return out

    with FakeTensorMode():
        run, wrt = build()
        forward = Count()
        with forward:
            out = run()
        outs = out if isinstance(out, tuple) else (out,)
        grads = tuple(torch.randn_like(o) for o in outs)
        backward = Count()
        with backward:
            torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    return int(forward.moved), int(backward.moved)


def _builder(kernel: str, x_name: str, x: int, config: dict[str, Any]) -> tuple[str, Callable[[], Any]]:
    """(size label, builder) of the reference op Liger's benchmark script times (b5672a1)."""
    import torch
    from torch import nn

    bf16 = torch.bfloat16

    if kernel == "rms_norm":  # benchmark_rms_norm.py's copy of HF's LlamaRMSNorm (an fp32 weight)
        m, h = config["M"], x

        def rms() -> tuple[Callable[[], Any], tuple[Any, ...]]:
            weight = nn.Parameter(torch.ones(h))
            inp = torch.randn(m, h, dtype=bf16, requires_grad=True)

            def run() -> Any:
                hs = inp.to(torch.float32)
                variance = hs.pow(2).mean(-1, keepdim=True)
                hs = hs * torch.rsqrt(variance + 1e-6)
                return weight * hs.to(bf16)

            return run, (inp, weight)

        return f"M={m} H={h}", rms
    if kernel == "rope":  # HF's apply_rotary_pos_emb on (1, heads, T, head_dim) views
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        seq = x if x_name == "T" else config["seq_len"]
        hidden = config["hidden_size"] if x_name == "T" else x
        nq, nkv = config["num_q_heads"], config["num_kv_heads"]
        hd = hidden // nq

        def rope() -> tuple[Callable[[], Any], tuple[Any, ...]]:
            q = torch.randn(1, seq, nq, hd, dtype=bf16, requires_grad=True).transpose(1, 2)
            k = torch.randn(1, seq, nkv, hd, dtype=bf16, requires_grad=True).transpose(1, 2)
            cos, sin = torch.randn(1, seq, hd, dtype=bf16), torch.randn(1, seq, hd, dtype=bf16)
            return (lambda: apply_rotary_pos_emb(q, k, cos, sin)), (q, k)

        return f"T={seq} hidden={hidden}", rope
    if kernel == "cross_entropy":  # torch's CrossEntropyLoss on fp32 logits
        rows, vocab = config["B"] * config["T"], x

        def ce() -> tuple[Callable[[], Any], tuple[Any, ...]]:
            logits = torch.randn(rows, vocab, requires_grad=True)
            target = torch.randint(vocab, (rows,))
            return (lambda: nn.functional.cross_entropy(logits, target)), (logits,)

        return f"N={rows} V={vocab}", ce
    if kernel == "layer_norm":  # torch.nn.LayerNorm, fp32
        m, n = config["M"], x

        def ln() -> tuple[Callable[[], Any], tuple[Any, ...]]:
            layer = nn.LayerNorm(n, eps=config["eps"])
            inp = torch.randn(m, n, requires_grad=True)
            return (lambda: layer(inp)), (inp, layer.weight, layer.bias)

        return f"M={m} N={n}", ln
    raise ValueError(f"{DATA}: kernel {kernel!r} has no reference op here")


def passes(data_path: Path = DATA) -> list[Pass]:
    """Every timed pass of the data file: forward as timed; backward as timed, else full − forward."""
    from sim.hardware.registry import builtin_devices

    devices = builtin_devices()
    data = json.loads(data_path.read_text())
    out: list[Pass] = []
    for gpu in data["gpus"]:
        device = devices[PROFILE_OF_GPU[gpu["gpu_name"]]]
        assert device.achievable_hbm_bandwidth_Bps is not None
        timed: dict[tuple[str, str, int, str], dict[str, float]] = {}
        for m in gpu["measurements"]:
            key = (m["kernel"], m["x_name"], m["x"], json.dumps(m["config"], sort_keys=True))
            timed.setdefault(key, {})[m["mode"]] = m["ms"] / 1e3
        seen: set[tuple[str, str]] = set()  # a size two sweeps share (rope's T and hidden) counts once
        for (kernel, x_name, x, config), modes in sorted(timed.items()):
            if "forward" not in modes:
                continue
            backward_s = modes.get("backward", modes["full"] - modes["forward"] if "full" in modes else None)
            size, build = _builder(kernel, x_name, x, json.loads(config))
            if (kernel, size) in seen:
                continue
            seen.add((kernel, size))
            fwd_bytes, bwd_bytes = _counted_bytes(build)
            for direction, moved, seconds in (
                ("forward", fwd_bytes, modes["forward"]),
                ("backward", bwd_bytes, backward_s),
            ):
                if seconds is None or seconds <= 0:
                    continue
                out.append(
                    Pass(
                        gpu=gpu["gpu_name"],
                        kernel=kernel,
                        size=size,
                        direction=direction,
                        moved_bytes=moved,
                        measured_s=seconds,
                        streaming_Bps=device.achievable_hbm_bandwidth_Bps,
                    )
                )
    return out


def efficiency_by_profile(all_passes: list[Pass]) -> dict[str, float]:
    """Each measured part's figure: the median efficiency of its counted passes, 3 decimals."""
    out: dict[str, float] = {}
    for gpu, profile in PROFILE_OF_GPU.items():
        effs = [p.efficiency for p in all_passes if p.gpu == gpu and p.counted]
        out[profile] = round(statistics.median(effs), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m validation.eager_bandwidth", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 where a built-in profile's figure differs"
    )
    args = parser.parse_args(argv)
    from sim.hardware.registry import builtin_devices

    all_passes = passes()
    print("| GPU | op | size | pass | bytes (tracer) | measured | GB/s | of streaming | counted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in all_passes:
        print(
            f"| {p.gpu} | {p.kernel} | {p.size} | {p.direction} | {p.moved_bytes / 1e6:,.1f} MB | "
            f"{p.measured_s * 1e3:.3f} ms | {p.moved_bytes / p.measured_s / 1e9:,.0f} | {p.efficiency:.1%} | "
            f"{'yes' if p.counted else 'no'} |"
        )
    figures = efficiency_by_profile(all_passes)
    devices = builtin_devices()
    wrong = 0
    for profile, value in figures.items():
        have = devices[profile].eager_memory_efficiency
        print(f"{profile}: eager_memory_efficiency = {value} (profile: {have})")
        wrong += have != value
    return 1 if args.check and wrong else 0


if __name__ == "__main__":
    sys.exit(main())
