"""FSDP2's ``CPUOffloadPolicy`` in fake mode: ``VALIDATION.md``'s "FSDP2's CPU offload" section.

    python -m validation.offload_memory --out VALIDATION.md

Each configuration runs real FSDP2 for one rank twice under the fake process group
(``validation.fake_memory``): with ``parallel.cpu_offload = true`` (``CPUOffloadPolicy``, unpinned:
``pin_memory()`` needs an accelerator) and without, and compares the offloaded run's peak with the
simulator's (``validation.memory_only.compare_memory``: the device is the host, as the fake run's
CPU mesh is). What runs here is the CPU case only: ``fully_shard`` on a ``cuda`` mesh calls
``torch.cuda.current_device()``, which a CPU build of torch refuses even under ``FakeTensorMode``.
The section is written between ``<!-- fsdp2-offload:begin -->`` and its end marker, the rest of
the file kept.
"""

import argparse
import platform
import sys
import time
from collections.abc import Sequence

import torch

from sim.outputs.display import gib
from sim.scenario.loader import load_scenario
from validation.fake_memory_child import measure_fake_memory_subprocess
from validation.marked_sections import write_between_markers
from validation.matrix_rows import MEMORY_BASE
from validation.memory_only import compare_memory

TINY = "scenarios/tiny.toml"
_BF16 = ["precision.param_dtype=bf16", "precision.reduce_dtype=fp32"]
# (name, scenario, overrides): the offload is added to each
CONFIGS: list[tuple[str, str, list[str]]] = [
    ("tiny, 4 ranks, bf16", TINY, ["parallel.world_size=4", *_BF16]),
    ("tiny, 4 ranks, fp32, checkpointing", TINY, ["parallel.world_size=4", "checkpointing.mode=full"]),
    ("Llama-2-7B, 8 ranks, bf16", MEMORY_BASE, _BF16),
    ("Llama-2-7B, 8 ranks, bf16, checkpointing", MEMORY_BASE, [*_BF16, "checkpointing.mode=full"]),
    (
        "Llama-2-7B, 8 ranks, bf16, LoRA r16 all linear",
        MEMORY_BASE,
        [*_BF16, "finetune.method=lora", "finetune.rank=16", 'finetune.target_modules="all-linear"'],
    ),
    (  # QLoRA runs on real bitsandbytes tensors (validation.fake_memory): a small model
        "OLMo-2-1B, 8 ranks, 1 × 256, QLoRA r16 all linear",
        MEMORY_BASE,
        [
            "model.preset=olmo-2-1b",
            "training.micro_batch=1",
            "training.seq_len=256",
            *_BF16,
            "finetune.method=qlora",
            "finetune.rank=16",
            'finetune.target_modules="all-linear"',
        ],
    ),
]
OFFLOAD = ["parallel.cpu_offload=true", "parallel.cpu_offload_pin_memory=false"]


def _size(nbytes: float) -> str:
    return gib(nbytes) if nbytes >= 1 << 30 else f"{nbytes / 2**20:.2f} MiB"


def _row(name: str, path: str, sets: list[str], timeout_s: float) -> str:
    start = time.perf_counter()
    on = measure_fake_memory_subprocess(path, [*sets, *OFFLOAD], timeout_s)
    off = measure_fake_memory_subprocess(path, sets, timeout_s)
    peak = compare_memory(load_scenario(path, [*sets, *OFFLOAD]), on).rows[0]
    error = f"{peak.error:+.1%}" if peak.error is not None else "n/a"
    same = "yes" if on["total"] == off["total"] else f"no ({_size(off['total'])})"
    return (
        f"| {name} | {_size(peak.predicted)} | {_size(peak.measured)} | {error} | {same} | "
        f"{time.perf_counter() - start:.0f} s |"
    )


def section(timeout_s: float) -> str:
    rows = [_row(name, path, sets, timeout_s) for name, path, sets in CONFIGS]
    return "\n".join(
        [
            "## FSDP2's CPU offload (`CPUOffloadPolicy`, `fsdpsim validate --memory-only`)",
            "",
            "One rank of real FSDP2 with `CPUOffloadPolicy(pin_memory=False)` under the fake process group",
            "(`python -m validation.offload_memory`), against the simulator's prediction for a device that",
            "is the host. Real FSDP2 runs the policy here only on the CPU device, where it moves nothing:",
            '`fully_shard` on a `cuda` mesh asks `torch.cuda.current_device()` ("Torch not compiled with',
            'CUDA enabled", also under `FakeTensorMode`) and `pin_memory()` needs an accelerator. These rows',
            "check the wiring and the no-op, not the device memory on a GPU (that is tested against the",
            "source, `tests/test_fsdp2_offload.py`). Measured with torch "
            f"{torch.__version__} on this {platform.machine()} VM (2 cores, shared).",
            "",
            "| configuration | predicted peak | measured peak (offload) | error | same as without offload | wall |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m validation.offload_memory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", default="VALIDATION.md", help="file to write the section into")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per fake run")
    args = parser.parse_args(argv)
    write_between_markers(args.out, "fsdp2-offload", section(args.timeout))
    print(f"wrote the fsdp2-offload section of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
