"""How a GPU profile's kernel model times the step's attention calls, for the report: the kernel
the profile names, how many calls SDPA is given a mask (and why), the kernel those run instead
and where each kernel's curve comes from. It names the assumptions a masked call rests on (a
borrowed or derived curve, ``sim.costs.attention_curves``), which decide its time."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sim.costs.attention_curves import curve_origin
from sim.costs.gpu import MASKED_KERNEL, has_gpu_figures
from sim.hardware.schema import DeviceSpec, HardwareProfile
from sim.workload.attention_kernel import fused_kernel
from sim.workload.layer_op import LayerOp
from sim.workload.shapes import AttentionShape


@dataclass(frozen=True, kw_only=True)
class AttentionTiming:
    """Per forward of one micro-batch: ``calls`` attention calls on ``kernel``, ``masked_calls`` of
    them given a mask by SDPA (``masked_by``: "padding", "documents", "window", "bias") and timed as
    ``masked_kernel`` over every pair; ``curves``: each kernel timed, with its curve's origin
    ("measured", "borrowed", "derived"; None: no curve, timed as its matmuls and softmax: the math
    path, eager attention)."""

    kernel: str
    calls: int
    masked_calls: int
    masked_by: tuple[str, ...]
    masked_kernel: str | None
    curves: Mapping[str, str | None]

    def to_json(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "calls": self.calls,
            "masked_calls": self.masked_calls,
            "masked_by": list(self.masked_by),
            "masked_kernel": self.masked_kernel,
            "curves": dict(self.curves),
        }


def _mask_reasons(shape: AttentionShape) -> tuple[str, ...]:
    return tuple(
        reason
        for reason, given in (
            ("padding", shape.padding_mask),
            ("documents", shape.document_mask),
            ("window", shape.sdpa_window_mask),
            ("bias", shape.bias),
        )
        if given
    )


def attention_timing(
    profile: HardwareProfile, dtype: str, ops: Sequence[LayerOp], lenders: Mapping[str, DeviceSpec]
) -> AttentionTiming | None:
    """The summary of ``ops``' attention calls on ``profile`` (running the scenario's attention:
    ``sim.simulate.attention_profile``); None where the GPU kernel model does not time them (a
    CPU profile, a calibrated compute section) or there are none."""
    device, kernel = profile.device, profile.attention_kernel
    shapes = [op.attention for op in ops if op.attention is not None]
    if not shapes or profile.compute is not None or not has_gpu_figures(device, dtype):
        return None
    fused = fused_kernel(kernel)
    masked = [a for a in shapes if fused and a.sdpa_given_mask]
    timed = ([kernel] if len(masked) < len(shapes) else []) + ([MASKED_KERNEL] if masked else [])
    return AttentionTiming(
        kernel=kernel,
        calls=len(shapes),
        masked_calls=len(masked),
        masked_by=tuple(dict.fromkeys(r for a in masked for r in _mask_reasons(a))),
        masked_kernel=MASKED_KERNEL if masked else None,
        curves={k: curve_origin(device, dict(lenders), dtype, k) if fused_kernel(k) else None for k in timed},
    )
