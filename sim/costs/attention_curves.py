"""Which published attention curves a part's kernels run at: its own, else its architecture
family's borrowed, and a memory-efficient curve derived where its measurements have only
FlashAttention-2's (the H100 family). Pure functions over ``DeviceSpec``s.

SDPA runs memory-efficient attention wherever transformers gives it a mask (a reached window, a
collator's padding, T5's bias; ``sim.costs.gpu.GpuKernelModel.attention_s``). Its only published
kernel-level curve is the A100's (the xformers CUTLASS bars of FlashAttention-2's A100
benchmark image); the H100 image that gives the H100 family its FlashAttention-2 curve has no
xformers bars. Both kernels are sm80 kernels (``mma.sync`` tensor-core instructions; neither
uses Hopper's ``wgmma`` or TMA): PyTorch's memory-efficient attention runs its ``Sm80`` build on
every newer GPU (pytorch/pytorch ``aten/src/ATen/native/transformers/cuda/attention.cu`` and
``attention_backward.cu``, ``DISPATCH_ARCHTAG``: ``computeCapability >= 80`` takes
``cutlass::arch::Sm80``), as FlashAttention-2 does its sm80 code. So the cross-generation
speedup that the same benchmark script measures for FlashAttention-2 (this part's curve over the
A100's, at each sequence length, head dimension and causality) is what the derived curve applies
to the A100's memory-efficient one; only for the parts that run that sm80 code on a newer
architecture (``DERIVED_FOR``: Hopper, and Blackwell, which borrows Hopper's curves). An
assumption, not a measurement of this part; named in the README and in the report.
"""

import math

from sim.hardware.schema import AttentionCurve, DeviceSpec

# the architecture whose published curves a part without its own borrows
NEAREST_ARCH = {"sm80": "sm80", "sm86": "sm80", "sm89": "sm80", "sm90": "sm90", "sm100": "sm90"}
# the architecture whose memory-efficient curve is published (the A100's, ``device.attention``)
EFFICIENT_ARCH = "sm80"
# the families (``NEAREST_ARCH``'s values) that run the sm80 kernels on a newer architecture
DERIVED_FOR = frozenset({"sm90"})


def curve_rate(curve: AttentionCurve, seq_len: int) -> float:
    """FLOP/s of ``curve`` at ``seq_len``: log-log interpolation, clamped to its ends."""
    xs = [math.log(s) for s in curve.seq_lens]
    ys = [math.log(f) for f in curve.fwd_bwd_flops]
    x = min(max(math.log(seq_len), xs[0]), xs[-1])
    i = max(0, min(len(xs) - 2, next((j for j in range(len(xs) - 1) if x <= xs[j + 1]), len(xs) - 2)))
    frac = 0.0 if xs[i + 1] == xs[i] else (x - xs[i]) / (xs[i + 1] - xs[i])
    return math.exp(ys[i] + frac * (ys[i + 1] - ys[i]))


def _find(
    curves: tuple[AttentionCurve, ...], kernel: str, head_dim: int, causal: bool
) -> AttentionCurve | None:
    return next((c for c in curves if (c.kernel, c.head_dim, c.causal) == (kernel, head_dim, causal)), None)


def derived_efficient(
    curves: tuple[AttentionCurve, ...], lenders: dict[str, DeviceSpec]
) -> tuple[AttentionCurve, ...]:
    """Memory-efficient curves for a set of ``curves`` that has FlashAttention-2's and none of its
    own: the published sm80 part's memory-efficient curve times, at each of its sequence lengths,
    the ratio of the two sets' FlashAttention-2 rates at the same head dimension and causality
    (the module's reasoning). Nothing where the set has its own, or no sm80 lender has both."""
    if any(c.kernel == "efficient" for c in curves):
        return ()
    lender = next(
        (
            d
            for _, d in sorted(lenders.items())
            if d.architecture == EFFICIENT_ARCH and any(c.kernel == "efficient" for c in d.attention)
        ),
        None,
    )
    if lender is None:
        return ()
    derived = []
    for own_flash in (c for c in curves if c.kernel == "flash"):
        key = (own_flash.head_dim, own_flash.causal)
        base_flash = _find(lender.attention, "flash", *key)
        base_efficient = _find(lender.attention, "efficient", *key)
        if base_flash is None or base_efficient is None:
            continue
        rates = tuple(
            rate * curve_rate(own_flash, s) / curve_rate(base_flash, s)
            for s, rate in zip(base_efficient.seq_lens, base_efficient.fwd_bwd_flops, strict=True)
        )
        derived.append(
            AttentionCurve(
                kernel="efficient",
                head_dim=key[0],
                causal=key[1],
                seq_lens=base_efficient.seq_lens,
                fwd_bwd_flops=rates,
            )
        )
    return tuple(derived)


def _published_curves(
    device: DeviceSpec, lenders: dict[str, DeviceSpec], dtype: str
) -> tuple[tuple[AttentionCurve, ...], float]:
    """The device's own curves, else those of the nearest architecture's part that has them, with
    the ratio of the two parts' achievable matmul rates to scale them by."""
    if device.attention:
        return device.attention, 1.0
    arch = NEAREST_ARCH.get(device.architecture)
    for lender in lenders.values():
        if arch and lender.architecture == arch and lender.attention and dtype in lender.matmul_flops:
            return lender.attention, device.matmul_flops[dtype] / lender.matmul_flops[dtype]
    return (), 1.0


def attention_curves(
    device: DeviceSpec, lenders: dict[str, DeviceSpec], dtype: str
) -> tuple[tuple[AttentionCurve, ...], float]:
    """The curves ``device``'s attention runs at, with the factor to scale them by: its own, else
    those of the nearest architecture's part that has them with the ratio of the two parts'
    achievable matmul rates; either completed by ``derived_efficient``."""
    curves, scale = _published_curves(device, lenders, dtype)
    return (*curves, *_derived_for(device, curves, lenders)), scale


def _derived_for(
    device: DeviceSpec, curves: tuple[AttentionCurve, ...], lenders: dict[str, DeviceSpec]
) -> tuple[AttentionCurve, ...]:
    """``derived_efficient`` for a part of a family in ``DERIVED_FOR``, else nothing."""
    if NEAREST_ARCH.get(device.architecture) not in DERIVED_FOR:
        return ()
    return derived_efficient(curves, lenders)


def curve_origin(device: DeviceSpec, lenders: dict[str, DeviceSpec], dtype: str, kernel: str) -> str | None:
    """Where the curve ``device``'s ``kernel`` runs at comes from: "measured" (the part's own
    published curve), "borrowed" (its architecture family's, scaled by matmul rate), "derived"
    (``derived_efficient``), or None (no curve: the math path times it)."""
    published, _ = _published_curves(device, lenders, dtype)
    if any(c.kernel == kernel for c in device.attention):
        return "measured"
    if any(c.kernel == kernel for c in published):
        return "borrowed"
    if any(c.kernel == kernel for c in _derived_for(device, published, lenders)):
        return "derived"
    return None
