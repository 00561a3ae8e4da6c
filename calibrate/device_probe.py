"""What a rank's device achieves, measured: matmul FLOP/s, copy bandwidth, SDPA's kernel choice.

The profile's ``device.peak_flops`` holds *achieved* dense-matmul rates (square matmuls large
enough to be compute-bound), so ``compute_efficiency`` is 1.0. ``hbm_bandwidth_Bps`` is the
large-copy rate counted as STREAM's "Copy" counts it: bytes read + bytes written per second
(McCalpin, STREAM benchmark). All ranks measure at the same time, as they compute in training
(on a CPU they share cores and memory bandwidth); the mean over ranks is recorded.
"""

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from calibrate.sweep import TORCH_DTYPES

# SDPA's fused kernels keep no (seq x seq) score matrix; the math path does.
_FUSED_SDPA_OPS = ("flash_attention", "efficient_attention", "cudnn_attention")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def total_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def timed(fn: Callable[[], Any], device: torch.device, min_time_s: float, min_reps: int = 3) -> float:
    """Median seconds of ``fn`` after one warm-up call, repeated for at least ``min_time_s``."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time_s:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops(device: torch.device, dtype: str, max_n: int | None = None) -> float:
    """Achieved FLOP/s of an n×n @ n×n matmul (2n³ FLOPs).

    n starts at 256 and doubles until one matmul takes 20 ms or n reaches ``max_n`` (8192 on a
    GPU, 1024 on a CPU): CPUs without native bf16 run bf16 matmuls ~100× slower than fp32, and a
    fixed size would take minutes there.
    """
    max_n = max_n or (8192 if device.type == "cuda" else 1024)
    n = 256
    while True:
        mm = _matmul(n, dtype, device)
        if n >= max_n or timed(mm, device, min_time_s=0.0, min_reps=1) >= 0.02:
            break
        n *= 2
    return 2 * n**3 / timed(mm, device, min_time_s=0.3)


def _matmul(n: int, dtype: str, device: torch.device) -> Callable[[], Any]:
    a = torch.randn(n, n, device=device).to(TORCH_DTYPES[dtype])
    b = torch.randn(n, n, device=device).to(TORCH_DTYPES[dtype])
    return lambda: torch.mm(a, b)


def copy_bandwidth_Bps(device: torch.device, nbytes: int | None = None) -> float:
    """STREAM-copy bandwidth: 2 × bytes / time for a copy far larger than the caches."""
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, min_time_s=0.3, min_reps=5)


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def sdpa_kernel(
    device: torch.device,
    dtype: str,
    heads: int = 8,
    kv_heads: int = 8,
    seq: int = 256,
    head_dim: int = 64,
    *,
    float_bias: bool = False,
) -> str:
    """The aten op SDPA dispatches to for a causal training call shaped like HF Llama's.

    transformers' ``sdpa_attention_forward`` calls SDPA with ``is_causal=True``, no mask, and
    ``enable_gqa`` when kv heads < heads; we make the same call with grads enabled and record
    which aten ops ran (a fused ``_scaled_dot_product_*`` kernel, or the math decomposition).
    ``float_bias``: the call T5's attention makes instead, an additive float mask that carries
    the relative position bias (and needs its gradient), ``is_causal=False``.
    """
    td = TORCH_DTYPES[dtype]
    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=td, requires_grad=True)
    k = torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=td, requires_grad=True)
    v = torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=td, requires_grad=True)
    mask = (
        torch.randn(1, heads, seq, seq, device=device, dtype=td, requires_grad=True) if float_bias else None
    )
    with _OpNames() as rec:
        torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=not float_bias, enable_gqa=kv_heads != heads
        )
    fused = [n for n in rec.names if "scaled_dot_product" in n and any(f in n for f in _FUSED_SDPA_OPS)]
    return fused[0] if fused else "math (" + ", ".join(sorted(set(rec.names))) + ")"


def attention_kernel(evidence: dict[str, str]) -> str:
    """ "flash" when every probed dtype ran a fused kernel (no seq² buffers), else "math"."""
    return "flash" if all(not e.startswith("math") for e in evidence.values()) else "math"


def probe_device(device: torch.device, dtypes: tuple[str, ...]) -> dict[str, Any]:
    """This rank's measurements; the caller averages the numbers over ranks."""
    return {
        "peak_flops": {d: matmul_flops(device, d) for d in dtypes},
        "hbm_bandwidth_Bps": copy_bandwidth_Bps(device),
    }
