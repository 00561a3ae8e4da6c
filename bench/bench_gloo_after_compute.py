"""A small gloo all-gather's latency right after compute, against back to back (2 ranks).

Why: FSDP1 with PEFT's wrap issues many small blocking collectives between compute ops, and the
hf matrix's FSDP1 LoRA row measures them at about twice their calibrated time. This separates the
call's own latency from the ranks' drift: every timed all-gather follows a world barrier, either
straight after the previous one or after about 1 ms of matmuls on both ranks; 3 rounds of 40 per
size, the median of each round, the ranks' maximum. The README's FSDP1 LoRA paragraph quotes it.
Run: ``python -m bench gloo_after_compute`` (or ``python bench/bench_gloo_after_compute.py``).
"""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES_FP32 = (1024, 16384, 262144, 4194304)  # elements per rank: 4 KiB to 16 MiB
ROUNDS, REPS = 3, 40


def _worker() -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < 0.1:
        a @ b
        count += 1
    per_ms = max(1, count // 100)

    def one(n: int, burst: bool) -> float:
        x, out = torch.randn(n), torch.empty(n * world)
        if burst:
            for _ in range(per_ms):
                a @ b
        dist.barrier()
        t = time.perf_counter()
        dist.all_gather_into_tensor(out, x)
        return time.perf_counter() - t

    medians: dict[tuple[int, bool], list[float]] = {}
    for _ in range(ROUNDS):
        for n in SIZES_FP32:
            for burst in (False, True):
                medians.setdefault((n, burst), []).append(
                    statistics.median(one(n, burst) for _ in range(REPS))
                )
    for (n, burst), rounds in sorted(medians.items()):
        value = torch.tensor([statistics.median(rounds)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            label = "after 1 ms of compute" if burst else "back to back"
            rounds_us = ", ".join(f"{r * 1e6:.0f}" for r in rounds)
            print(f"{n * 4:>9,} B {label:22s} {value.item() * 1e6:8.0f} us  (rounds {rounds_us})", flush=True)
    dist.destroy_process_group()


def main() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__],
        env={**os.environ, "FSDPSIM_BENCH_WORKER": "1"},
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"gloo benchmark failed: {proc.stderr.strip().splitlines()[-1]}")
    print("median gloo all-gather (2 ranks, after a world barrier):")
    print("\n".join(line for line in proc.stdout.splitlines() if " B " in line))


if __name__ == "__main__":
    _worker() if os.environ.get("FSDPSIM_BENCH_WORKER") else main()
