"""How fast a fused RMSNorm kernel moves its bytes on a GPU, from published kernel timings.

    python -m validation.fused_bandwidth          # the passes and the two fractions
    python -m validation.fused_bandwidth --check  # exit 1 where sim.costs.gpu disagrees

``training.norm = "fused"`` times a Triton RMSNorm (torchtitan's ``fused_rmsnorm``) as the bytes it
must move over the device's achievable streaming rate times a fraction per pass: forward reads the
input and writes the output (2 x rows x hidden x dtype bytes), backward reads the input and the
output's gradient and writes the input's (3 x). The fractions are measured on Liger-Kernel's own
fused RMSNorm, the same kind of kernel (one program per row forward; backward a fixed grid of
programs, each accumulating the weight's gradient over its rows, summed after), in its published
benchmark data (``validation/data/liger_fused_rms_norm.json``: A100-SXM4-80GB, A100 80GB PCIe,
H100 NVL). As ``validation.eager_bandwidth`` does for eager kernels, a pass counts when its bytes
take at least ``MIN_STREAM_S`` at the streaming rate (bandwidth-bound); each fraction is the median
over the counted passes of all three parts, to three decimals. The backward's is far below the
forward's: the weight's gradient is a reduction over every row.
"""

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from validation.eager_bandwidth import MIN_STREAM_S

DATA = Path(__file__).parent / "data" / "liger_fused_rms_norm.json"
BYTES_PER_ELEMENT = {"forward": 2, "backward": 3}  # tensors of rows x hidden moved per pass


@dataclass(frozen=True, kw_only=True)
class FusedPass:
    gpu: str
    direction: str
    hidden: int
    moved_bytes: int
    measured_s: float
    streaming_Bps: float

    @property
    def efficiency(self) -> float:
        return self.moved_bytes / self.measured_s / self.streaming_Bps

    @property
    def counted(self) -> bool:
        return self.moved_bytes / self.streaming_Bps >= MIN_STREAM_S


def passes() -> list[FusedPass]:
    from sim.dtypes import dtype_bytes
    from sim.hardware.registry import load_profile

    data = json.loads(DATA.read_text())
    out = []
    for gpu in data["gpus"]:
        streaming = load_profile(gpu["profile"]).device.achievable_hbm_bandwidth_Bps
        assert streaming is not None, gpu["profile"]  # every measured part's profile has its rate
        element = dtype_bytes("bf16" if gpu["dtype"] == "bfloat16" else gpu["dtype"])
        for m in gpu["measurements"]:
            out.append(
                FusedPass(
                    gpu=gpu["gpu_name"],
                    direction=m["mode"],
                    hidden=m["H"],
                    moved_bytes=BYTES_PER_ELEMENT[m["mode"]] * gpu["rows"] * m["H"] * element,
                    measured_s=m["ms"] * 1e-3,
                    streaming_Bps=streaming,
                )
            )
    return out


def fused_norm_efficiency() -> tuple[float, float]:
    """(forward, backward) fractions of the streaming rate, medians over the counted passes."""
    counted = [p for p in passes() if p.counted]
    return tuple(  # type: ignore[return-value]
        round(statistics.median(p.efficiency for p in counted if p.direction == d), 3)
        for d in ("forward", "backward")
    )


def kernel_paragraph() -> str:
    """The VALIDATION.md paragraph on the fused RMSNorm's rates, placed after the eager kernels' table."""
    fused = [p for p in passes() if p.counted]
    backward_effs = [p.efficiency for p in fused if p.direction == "backward"]
    forward, backward = fused_norm_efficiency()
    return (
        'A fused RMSNorm (`training.norm = "fused"`, `python -m validation.fused_bandwidth`): Liger-Kernel\'s own '
        "kernel in the same published data moves its input and output (forward) and its input, output "
        f"gradient and input gradient (backward) at {forward:.3f} and {backward:.3f} of the streaming rate "
        f"(medians over {sum(p.direction == 'forward' for p in fused)} and "
        f"{len(backward_effs)} bandwidth-bound passes of the three parts; "
        f"backward from {min(backward_effs):.3f} to {max(backward_effs):.3f}), "
        "`sim.costs.gpu.FUSED_NORM_EFFICIENCY`.\n"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m validation.fused_bandwidth")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    from sim.costs.gpu import FUSED_NORM_EFFICIENCY

    print("| GPU | pass | hidden | bytes | measured | of streaming | counted |")
    print("|---|---|---|---|---|---|---|")
    for p in passes():
        print(
            f"| {p.gpu} | {p.direction} | {p.hidden} | {p.moved_bytes / 2**20:.0f} MiB | "
            f"{p.measured_s * 1e6:.1f} us | {p.efficiency:.3f} | {'yes' if p.counted else 'no'} |"
        )
    derived = fused_norm_efficiency()
    print(
        f"\nforward {derived[0]}, backward {derived[1]}; sim.costs.gpu.FUSED_NORM_EFFICIENCY = {FUSED_NORM_EFFICIENCY}"
    )
    if args.check and tuple(derived) != tuple(FUSED_NORM_EFFICIENCY):
        print("error: sim.costs.gpu.FUSED_NORM_EFFICIENCY differs from the derivation", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
