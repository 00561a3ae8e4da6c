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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "liger_eager_kernels.json"
MLP_DATA = Path(__file__).parent / "data" / "liger_mlp_a100.json"
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


def _traced(build: "Build") -> tuple["Work", "Work"]:
    """(forward, backward) work the tracer's rules count for one op, on fake tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from hfmodel.trace import _work

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.work = Work()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            _, shape, moved = _work(str(func), func, args, kwargs, out)
            self.work.moved_bytes += int(moved)
            if shape is not None:
                self.work.gemms.append(shape)
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
    return forward.work, backward.work


def _counted_bytes(build: "Build") -> tuple[int, int]:
    forward, backward = _traced(build)
    return forward.moved_bytes, backward.moved_bytes


@dataclass
class Work:
    """What one pass runs: elementwise bytes moved and matmul (M, N, K, count) shapes."""

    moved_bytes: int = 0
    gemms: list[tuple[int, int, int, int]] = field(default_factory=list)


Build = Callable[[], tuple[Callable[[], Any], tuple[Any, ...]]]  # () -> (run, tensors to differentiate)


def _rms_norm(x_name: str, x: int, config: dict[str, Any]) -> tuple[str, Build]:
    """benchmark_rms_norm.py's copy of HF's LlamaRMSNorm (an fp32 weight) on a bf16 input."""
    import torch
    from torch import nn

    m, h = config["M"], x

    def build() -> tuple[Callable[[], Any], tuple[Any, ...]]:
        weight = nn.Parameter(torch.ones(h))
        inp = torch.randn(m, h, dtype=torch.bfloat16, requires_grad=True)

        def run() -> Any:
            hs = inp.to(torch.float32)
            variance = hs.pow(2).mean(-1, keepdim=True)
            hs = hs * torch.rsqrt(variance + 1e-6)
            return weight * hs.to(torch.bfloat16)

        return run, (inp, weight)

    return f"M={m} H={h}", build


def _rope(x_name: str, x: int, config: dict[str, Any]) -> tuple[str, Build]:
    """HF's apply_rotary_pos_emb on (1, heads, T, head_dim) views, bf16."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    seq = x if x_name == "T" else config["seq_len"]
    hidden = config["hidden_size"] if x_name == "T" else x
    nq, nkv = config["num_q_heads"], config["num_kv_heads"]
    hd, bf16 = hidden // nq, torch.bfloat16

    def build() -> tuple[Callable[[], Any], tuple[Any, ...]]:
        q = torch.randn(1, seq, nq, hd, dtype=bf16, requires_grad=True).transpose(1, 2)
        k = torch.randn(1, seq, nkv, hd, dtype=bf16, requires_grad=True).transpose(1, 2)
        cos, sin = torch.randn(1, seq, hd, dtype=bf16), torch.randn(1, seq, hd, dtype=bf16)
        return (lambda: apply_rotary_pos_emb(q, k, cos, sin)), (q, k)

    return f"T={seq} hidden={hidden}", build


def _cross_entropy(x_name: str, x: int, config: dict[str, Any]) -> tuple[str, Build]:
    """torch's CrossEntropyLoss on fp32 logits."""
    import torch

    rows, vocab = config["B"] * config["T"], x

    def build() -> tuple[Callable[[], Any], tuple[Any, ...]]:
        logits = torch.randn(rows, vocab, requires_grad=True)
        target = torch.randint(vocab, (rows,))
        return (lambda: torch.nn.functional.cross_entropy(logits, target)), (logits,)

    return f"N={rows} V={vocab}", build


def _layer_norm(x_name: str, x: int, config: dict[str, Any]) -> tuple[str, Build]:
    """torch.nn.LayerNorm, fp32."""
    import torch

    m, n = config["M"], x

    def build() -> tuple[Callable[[], Any], tuple[Any, ...]]:
        layer = torch.nn.LayerNorm(n, eps=config["eps"])
        inp = torch.randn(m, n, requires_grad=True)
        return (lambda: layer(inp)), (inp, layer.weight, layer.bias)

    return f"M={m} N={n}", build


# the reference op of each kernel Liger's benchmark scripts time (b5672a1): (size label, builder)
REFERENCE_OPS: dict[str, Callable[[str, int, dict[str, Any]], tuple[str, Build]]] = {
    "rms_norm": _rms_norm,
    "rope": _rope,
    "cross_entropy": _cross_entropy,
    "layer_norm": _layer_norm,
}


def _timed(gpu: dict[str, Any]) -> dict[tuple[str, str, int, str], dict[str, float]]:
    """Seconds per mode (forward, backward, full) of each (kernel, x_name, x, config) timed."""
    timed: dict[tuple[str, str, int, str], dict[str, float]] = {}
    for m in gpu["measurements"]:
        key = (m["kernel"], m["x_name"], m["x"], json.dumps(m["config"], sort_keys=True))
        timed.setdefault(key, {})[m["mode"]] = m["ms"] / 1e3
    return timed


def _gpu_passes(gpu: dict[str, Any], streaming_Bps: float) -> list[Pass]:
    out: list[Pass] = []
    seen: set[tuple[str, str]] = set()  # a size two sweeps share (rope's T and hidden) counts once
    for (kernel, x_name, x, config), modes in sorted(_timed(gpu).items()):
        size, build = REFERENCE_OPS[kernel](x_name, x, json.loads(config))
        if "forward" not in modes or (kernel, size) in seen:
            continue
        seen.add((kernel, size))
        backward_s = modes.get("backward", modes["full"] - modes["forward"] if "full" in modes else None)
        fwd_bytes, bwd_bytes = _counted_bytes(build)
        for direction, moved, seconds in (
            ("forward", fwd_bytes, modes["forward"]),
            ("backward", bwd_bytes, backward_s),
        ):
            if seconds is not None and seconds > 0:
                out.append(
                    Pass(
                        gpu=gpu["gpu_name"],
                        kernel=kernel,
                        size=size,
                        direction=direction,
                        moved_bytes=moved,
                        measured_s=seconds,
                        streaming_Bps=streaming_Bps,
                    )
                )
    return out


def passes(data_path: Path = DATA) -> list[Pass]:
    """Every timed pass of the data file: forward as timed; backward as timed, else full − forward."""
    from sim.hardware.registry import builtin_devices

    devices = builtin_devices()
    out: list[Pass] = []
    for gpu in json.loads(data_path.read_text())["gpus"]:
        streaming = devices[PROFILE_OF_GPU[gpu["gpu_name"]]].achievable_hbm_bandwidth_Bps
        assert streaming is not None
        out += _gpu_passes(gpu, streaming)
    return out


def _llama_mlp(config: dict[str, Any], seq_len: int) -> "Build":
    """HF's LlamaMLP in bf16 on a (batch, seq, hidden) bf16 input, as Liger's swiglu/geglu scripts."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    batch: int = config["B"] if "B" in config else config["bsz"]
    hidden = config["hidden_size"]

    def build() -> tuple[Callable[[], Any], tuple[Any, ...]]:
        llama = LlamaConfig(
            hidden_size=hidden, intermediate_size=config["intermediate_size"], hidden_act=config["hidden_act"]
        )
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # built in bf16 (``.to`` cannot swap fake parameters)
        try:
            layer = LlamaMLP(llama)
        finally:
            torch.set_default_dtype(default)
        x = torch.randn(batch, seq_len, hidden, dtype=torch.bfloat16, requires_grad=True)
        return (lambda: layer(x)), (x, *layer.parameters())

    return build


@dataclass(frozen=True, kw_only=True)
class MlpCheck:
    """The kernel model's time for one pass of HF's LlamaMLP against Liger's measured time."""

    kernel: str
    size: str
    direction: str
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def mlp_checks(data_path: Path = MLP_DATA) -> list[MlpCheck]:
    """Every timed forward and backward of the MLP file, predicted as the simulator times an op:
    its matmuls at ``gemm_s`` and its elementwise bytes at ``memory_s`` (A100 SXM 80 GB)."""
    from sim.costs.gpu import kernel_model
    from sim.hardware.registry import builtin_devices

    devices = builtin_devices()
    data = json.loads(data_path.read_text())
    model = kernel_model(devices[data["profile"]], "bf16", devices)
    out: list[MlpCheck] = []
    for (kernel, _, seq, config), modes in sorted(_timed(data).items()):
        forward, backward = _traced(_llama_mlp(json.loads(config), seq))
        for direction, work in (("forward", forward), ("backward", backward)):
            if direction not in modes:
                continue
            predicted = sum(c * model.gemm_s(m, n, k) for m, n, k, c in work.gemms)
            out.append(
                MlpCheck(
                    kernel=kernel,
                    size=f"{json.loads(config).get('B', json.loads(config).get('bsz'))} x {seq}",
                    direction=direction,
                    predicted_s=predicted + model.memory_s(work.moved_bytes),
                    measured_s=modes[direction],
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


def kernel_section() -> str:
    """VALIDATION.md's kernel-level section: each measured part's eager figure and the MLP check."""
    all_passes = passes()
    figures = efficiency_by_profile(all_passes)
    lines = [
        "### Kernel-level checks of the GPU compute model (`python -m validation.eager_bandwidth`)",
        "",
        "Eager elementwise kernels against Liger-Kernel's published timings of the HF/torch reference ops "
        "(RMSNorm, rotary, cross-entropy, LayerNorm; forward and backward): the bytes the tracer counts over "
        "the measured time, as a fraction of the profile's streaming rate; a part's "
        "`eager_memory_efficiency` is the median over its bandwidth-bound passes.",
        "",
        "| GPU (profile) | passes counted | lowest | median (the profile's figure) | highest |",
        "|---|---|---|---|---|",
    ]
    for gpu, profile in PROFILE_OF_GPU.items():
        effs = sorted(p.efficiency for p in all_passes if p.gpu == gpu and p.counted)
        lines.append(
            f"| {gpu} ({profile}) | {len(effs)} | {effs[0]:.1%} | {figures[profile]:.3f} | {effs[-1]:.1%} |"
        )
    checks = mlp_checks()
    worst = max(abs(c.error) for c in checks)
    lines += [
        "",
        "Out of sample: HF's LlamaMLP (hidden 4096, intermediate 11008, bf16; SwiGLU and GeGLU) timed by "
        "Liger on an A100-SXM4-80GB, against the kernel model's matmuls (`gemm_s`) plus its elementwise "
        "bytes at the eager rate (`memory_s`), as the simulator times an op:",
        "",
        "| MLP | batch x tokens | pass | predicted | measured | error |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {c.kernel} | {c.size} | {c.direction} | {c.predicted_s * 1e3:.2f} ms | {c.measured_s * 1e3:.2f} ms "
        f"| {c.error:+.1%} |"
        for c in checks
    ]
    lines += ["", f"Worst |error| {worst:.1%} over {len(checks)} passes.", ""]
    return "\n".join(lines)


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
    print("\n" + kernel_section())
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
