"""The GPU kernel model: forward and backward time of one layer op from its shapes and the
device's published kernel-level figures (``sim.hardware.schema.DeviceSpec``). Pure functions.

- **Matmuls** run at the device's maximum achievable matmul rate for the dtype (``matmul_flops``,
  ml-engineering's MAMF), lowered by wave quantization: the output is cut into 256×128 tiles
  (cuBLAS's largest CTA tile, NVIDIA "Matrix Multiplication Background User's Guide", §Wave
  quantization) and a partial last wave of tiles over the SMs costs a full wave; a dimension that
  is not a multiple of 8 elements misses the tensor cores' fast path, measured at 272.7 against
  398.4 TFLOPS for an MLP with ffn 10922 against 10944 on H100 (ml-engineering
  ``training/performance/README.md``, SwiGLU); and a matmul too small to be compute-bound moves
  its operands at the streaming bandwidth (roofline). The backward runs two matmuls of the same
  size (the input's and the weight's gradients).
- **Attention** with a fused kernel runs at the published forward+backward throughput of that
  kernel for its head dimension and causality, interpolated in log sequence length (FlashAttention
  benchmarks' FLOP count: forward 4·b·s²·h·d, halved when causal, backward 2.5 × forward). A part
  without a published curve borrows the nearest architecture's curve scaled by the ratio of the two
  parts' achievable matmul rates, and one with FlashAttention-2's curve alone gets a memory-efficient
  curve derived from the A100's (``sim.costs.attention_curves``; both assumptions, named in the
  README). The math path is two batched matmuls and a softmax over the s² scores.
- **Memory-bound work** (norms, activations, rotary, residual adds, casts, the loss) moves the
  bytes eager PyTorch moves (``sim.workload.layers``) at the rate eager ATen kernels reach: the
  achievable streaming bandwidth times ``eager_memory_efficiency``, derived from Liger-Kernel's
  published timings of the HuggingFace/torch reference ops (``validation.eager_bandwidth``); a part not measured borrows the fraction of its architecture family's
  measured part with the nearest streaming rate, and one with none in its family (MI300X) streams.
  A matmul's operands move at the streaming rate itself (cuBLAS, not an eager elementwise kernel),
  and a fused RMSNorm (``training.norm = "fused"``, one Triton kernel) at the share of it Liger's
  fused RMSNorm reaches in its published timings (``FUSED_NORM_EFFICIENCY``).
- Every kernel takes at least ``kernel_launch_s`` on the device (back-to-back launch floor).

Host-side costs (eager dispatch per op, FSDP2's hooks) are the schedule's, on the host stream.
A device without these figures (a CPU, a version-2 profile) uses ``sim.costs.compute.Roofline``.
"""

import math
from dataclasses import dataclass, replace

from sim.costs.attention_curves import NEAREST_ARCH, attention_curves, curve_rate
from sim.dtypes import dtype_bytes
from sim.hardware.schema import AttentionCurve, DeviceSpec
from sim.workload.attention_kernel import fused_kernel
from sim.workload.layer_op import LayerKind, LayerOp
from sim.workload.shapes import AttentionShape

TILE_M, TILE_N = 256, 128  # cuBLAS's largest CTA tile (NVIDIA Matrix Multiplication Background guide)
ALIGN_ELEMENTS = 8  # tensor cores want every dimension a multiple of 8 fp16/bf16 elements
UNALIGNED_FACTOR = 272.7 / 398.4  # ml-engineering: H100, ffn 10922 against 10944 at hidden 4096
FA_BACKWARD_OVER_FORWARD = 2.5  # FlashAttention benchmarks' FLOP convention
# the kernel SDPA runs a fused call given a mask on (flash takes none; ``attention_s``)
MASKED_KERNEL = "efficient"
# the fraction of the streaming rate a fused (Triton) RMSNorm's forward and backward reach:
# medians over Liger-Kernel's published timings of its fused RMSNorm on A100-SXM4-80GB, A100 PCIe
# and H100 NVL (bandwidth-bound passes; derived by ``python -m validation.fused_bandwidth``)
FUSED_NORM_EFFICIENCY = (0.884, 0.219)
# a part without a published attention curve (or eager-kernel efficiency) borrows one of this family


@dataclass(frozen=True, kw_only=True)
class GpuKernelModel:
    """The device figures one scenario's kernels run at (compute dtype fixed)."""

    matmul_flops: float
    hbm_Bps: float  # streaming: a matmul's operands
    eager_Bps: float  # eager ATen elementwise and reduction kernels
    sm_count: int | None
    kernel_launch_s: float
    act_bytes: int
    attention_curves: tuple[AttentionCurve, ...]
    attention_scale: float = 1.0  # borrowed curves: this part's matmul rate over the lender's

    # -- matmuls ---------------------------------------------------------------------------

    def wave_efficiency(self, m: int, n: int) -> float:
        """Useful fraction of the SM-waves a matmul's output tiles take."""
        if not self.sm_count:
            return 1.0
        tiles = math.ceil(m / TILE_M) * math.ceil(n / TILE_N)
        waves = math.ceil(tiles / self.sm_count)
        return tiles / (waves * self.sm_count)

    def gemm_s(self, m: int, n: int, k: int) -> float:
        """One (m×k)·(k×n) matmul in the compute dtype."""
        rate = self.matmul_flops * self.wave_efficiency(m, n)
        if any(d % ALIGN_ELEMENTS for d in (m, n, k)):
            rate *= UNALIGNED_FACTOR
        compute_s = 2.0 * m * n * k / rate
        memory_s = (m * k + k * n + m * n) * self.act_bytes / self.hbm_Bps
        return max(compute_s, memory_s, self.kernel_launch_s)

    # -- attention -------------------------------------------------------------------------

    def _curve(self, shape: AttentionShape, kernel: str) -> AttentionCurve | None:
        fits = [c for c in self.attention_curves if c.kernel == kernel and c.causal == shape.causal]
        if not fits:
            return None
        return min(fits, key=lambda c: (abs(c.head_dim - shape.head_dim), c.head_dim))

    def attention_rate(self, shape: AttentionShape, kernel: str) -> float | None:
        """FLOP/s of the fused kernel at this sequence length (log-log interpolation, clamped)."""
        curve = self._curve(shape, kernel)
        if curve is None:
            return None
        return curve_rate(curve, shape.seq_len) * self.attention_scale

    def attention_s(self, shape: AttentionShape, kernel: str) -> tuple[float, float]:
        """(forward, backward) seconds of one attention call. Given a mask by transformers' SDPA
        path (``AttentionShape.sdpa_given_mask``: a sliding window the keys reach, a collator's
        padding; T5's position bias, ``create_position_bias_mask``), SDPA cannot run flash, which takes none:
        memory-efficient attention over every pair (torch 2.13 ``sdp_utils``: flash requires
        ``attn_mask`` to be None; ``is_causal`` is off, the causality only in the mask)."""
        if fused_kernel(kernel) and shape.sdpa_given_mask:
            kernel, shape = MASKED_KERNEL, replace(shape, causal=False, window=None)
        fwd_flops = 4.0 * shape.batch * shape.seq_len * shape.kv_len * shape.heads * shape.head_dim
        if shape.causal:
            fwd_flops /= 2
        rate = self.attention_rate(shape, kernel) if fused_kernel(kernel) else None
        if rate is not None:
            return fwd_flops / rate, FA_BACKWARD_OVER_FORWARD * fwd_flops / rate
        # the math path: QKᵀ and AV as batched matmuls, softmax over the fp32 scores
        b, s, kv, d = shape.batch * shape.heads, shape.seq_len, shape.kv_len, shape.head_dim
        matmuls = b * (self.gemm_s(s, kv, d) + self.gemm_s(s, d, kv))
        softmax = self.memory_s(b * s * kv * (4 + 4 + self.act_bytes))
        return matmuls + softmax, 2 * matmuls + 2 * softmax

    # -- memory-bound work -----------------------------------------------------------------

    def memory_s(self, nbytes: float) -> float:
        """Eager elementwise work moving ``nbytes`` (the tracer's count)."""
        return max(nbytes / self.eager_Bps, self.kernel_launch_s) if nbytes > 0 else 0.0

    def fused_s(self, nbytes: float, backward: bool) -> float:
        """A fused RMSNorm kernel's bytes at its measured share of the streaming rate."""
        rate = self.hbm_Bps * FUSED_NORM_EFFICIENCY[backward]
        return max(nbytes / rate, self.kernel_launch_s) if nbytes > 0 else 0.0

    # -- one layer op ----------------------------------------------------------------------

    def sac_recompute_s(self, op: LayerOp, attention_kernel: str) -> float:
        """What op-level selective checkpointing runs again of ``op``: nothing of a kept matmul, the
        elementwise work around a kept attention kernel, all of anything else."""
        if op.sac_kept_bytes and op.gemm is not None:
            return 0.0
        if op.sac_kept_bytes:
            return self.memory_s(op.memory_bytes)
        return self.op_s(op, attention_kernel)[0]

    def op_s(self, op: LayerOp, attention_kernel: str) -> tuple[float, float]:
        """(forward, backward) seconds of one layer op; the backward as measured where it was
        (a described model's: its own matmuls, e.g. no weight gradient for a frozen weight)."""
        fwd, bwd = self._analytic_op_s(op, attention_kernel)
        if op.backward_gemms is None:
            return fwd, bwd
        bwd = sum(c * self.gemm_s(m, n, k) for m, n, k, c in op.backward_gemms)
        bwd += self.memory_s(op.backward_memory_bytes or 0.0)
        if op.kind is LayerKind.ATTENTION and op.attention is not None:
            bwd += self.attention_s(op.attention, attention_kernel)[1]
        return fwd, bwd

    def _analytic_op_s(self, op: LayerOp, attention_kernel: str) -> tuple[float, float]:
        if op.grouped_gemms:  # each (M, N, K) matmul ``count`` times, plus the op's elementwise work
            fwd = sum(c * self.gemm_s(m, n, k) for m, n, k, c in op.grouped_gemms)
            bwd = sum(c * (self.gemm_s(m, k, n) + self.gemm_s(n, k, m)) for m, n, k, c in op.grouped_gemms)
            return (
                fwd + self.memory_s(op.memory_bytes),
                bwd + self.memory_s(op.backward_memory_factor * op.memory_bytes),
            )
        if op.gemm is not None and op.gradients_in_forward:  # the backward's matmuls run in forward
            m, n, k = op.gemm
            matmuls = self.gemm_s(m, n, k) + self.gemm_s(m, k, n) + self.gemm_s(n, k, m)
            elementwise = op.memory_bytes
            return matmuls + self.memory_s(elementwise), self.memory_s(
                op.backward_memory_factor * elementwise
            )
        if op.gemm is not None:  # plus its elementwise work (QLoRA's dequantization; zero otherwise)
            m, n, k = op.gemm
            fwd = self.gemm_s(m, n, k) + self.memory_s(op.memory_bytes)
            return fwd, self.gemm_s(m, k, n) + self.gemm_s(n, k, m)
        if op.fused_kernel:
            elementwise = self.fused_s(op.memory_bytes, backward=False)
            elementwise_bwd = self.fused_s(op.backward_memory_factor * op.memory_bytes, backward=True)
        else:
            elementwise = self.memory_s(op.memory_bytes)
            elementwise_bwd = self.memory_s(op.backward_memory_factor * op.memory_bytes)
        if op.kind is LayerKind.ATTENTION and op.attention is not None:
            fwd, bwd = self.attention_s(op.attention, attention_kernel)
            return fwd + elementwise, bwd + elementwise_bwd
        return elementwise, elementwise_bwd


def has_gpu_figures(device: DeviceSpec, dtype: str) -> bool:
    """Whether the device carries the GPU model's inputs for this compute dtype."""
    return dtype in device.matmul_flops and device.achievable_hbm_bandwidth_Bps is not None


def eager_memory_efficiency(device: DeviceSpec, lenders: dict[str, DeviceSpec]) -> float:
    """The device's measured fraction of its streaming rate eager kernels reach, else that of the
    measured part of its architecture family whose streaming rate is nearest its own, else 1."""
    if device.eager_memory_efficiency is not None:
        return device.eager_memory_efficiency
    arch = NEAREST_ARCH.get(device.architecture)
    family = [
        d
        for d in lenders.values()
        if arch
        and d.architecture == arch
        and d.eager_memory_efficiency is not None
        and d.achievable_hbm_bandwidth_Bps
    ]
    if not family or device.achievable_hbm_bandwidth_Bps is None:
        return 1.0
    own = device.achievable_hbm_bandwidth_Bps
    nearest = min(
        family, key=lambda d: (abs(math.log((d.achievable_hbm_bandwidth_Bps or own) / own)), d.name)
    )
    assert nearest.eager_memory_efficiency is not None
    return nearest.eager_memory_efficiency


def kernel_model(
    device: DeviceSpec, dtype: str, lenders: dict[str, DeviceSpec] | None = None
) -> GpuKernelModel:
    """The kernel model of ``device`` for ``dtype`` work (``has_gpu_figures`` must hold)."""
    curves, scale = attention_curves(device, lenders or {}, dtype)
    assert device.achievable_hbm_bandwidth_Bps is not None
    return GpuKernelModel(
        matmul_flops=device.matmul_flops[dtype],
        hbm_Bps=device.achievable_hbm_bandwidth_Bps,
        eager_Bps=device.achievable_hbm_bandwidth_Bps * eager_memory_efficiency(device, lenders or {}),
        sm_count=device.sm_count,
        kernel_launch_s=device.kernel_launch_s,
        act_bytes=dtype_bytes(dtype),
        attention_curves=curves,
        attention_scale=scale,
    )
