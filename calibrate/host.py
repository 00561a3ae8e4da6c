"""``calibrate host``: the host side offload uses, measured on this machine, into a profile's
``node`` section (``sim.hardware.schema.NodeSpec``).

- Host-to-device and device-to-host copies (CUDA only): ``dev.copy_(host, non_blocking=True)``
  of ``COPY_BYTES`` from pinned (``pin_memory()``) and from pageable host memory, synchronised,
  best of the repetitions. Without an accelerator there is no device to copy to and
  ``pin_memory`` fails, so the fields stay as they were; the host's own memcpy rate is recorded
  in ``source.host`` for reference.
- The optimizer on the host: ``torch.optim.AdamW`` and ``torch.optim.SGD`` with momentum (foreach, fp32 CPU tensors of ``ADAM_ELEMENTS``
  elements in ``ADAM_TENSORS`` parts) and, where it builds, DeepSpeed's ``DeepSpeedCPUAdam``
  (its C++/AVX op, JIT-built by ``deepspeed.ops``), both at ``threads`` threads: the cores one rank
  gets when ``--ranks-per-node`` ranks share the host (torchrun's cores / ranks). Seconds per
  element, the mean of the repetitions after a warm-up step.
- NVMe (``--nvme-path DIR``): a ``NVME_BYTES`` file written with ``O_DIRECT`` and ``fsync``, then
  read back with ``O_DIRECT`` (no page cache), in 8 MiB aligned blocks; where ``O_DIRECT`` is
  refused, buffered I/O with the page cache dropped by ``posix_fadvise`` (recorded).
"""

import mmap
import os
import statistics
import time
from pathlib import Path
from typing import Any

COPY_BYTES = 256 << 20
ADAM_ELEMENTS = 32 << 20
ADAM_TENSORS = 8
NVME_BYTES = 512 << 20
BLOCK = 8 << 20


def _mean_s(fn: Any, reps: int) -> float:
    fn()  # warm-up: state allocation, the JIT op's first call
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.fmean(times)


def copy_rates(reps: int) -> dict[str, float]:
    """Pinned and pageable H2D/D2H rates (CUDA), or the host memcpy rate alone."""
    import torch

    n = COPY_BYTES // 4
    host = torch.empty(n)
    out: dict[str, float] = {
        "host_memcpy_Bps": COPY_BYTES / _mean_s(lambda: torch.empty(n).copy_(host), reps)
    }
    if not torch.cuda.is_available():
        return out
    dev = torch.empty(n, device="cuda")
    pinned = host.pin_memory()

    def timed(dst: Any, src: Any) -> float:
        def run() -> None:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()

        return COPY_BYTES / min(_mean_s(run, 1) for _ in range(reps))

    out["host_to_device_Bps"] = timed(dev, pinned)
    out["device_to_host_Bps"] = timed(pinned, dev)
    out["pageable_host_to_device_Bps"] = timed(dev, host)
    out["pageable_device_to_host_Bps"] = timed(host, dev)
    return out


def _params(torch: Any) -> list[Any]:
    params = [torch.nn.Parameter(torch.randn(ADAM_ELEMENTS // ADAM_TENSORS)) for _ in range(ADAM_TENSORS)]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def adam_rates(reps: int, threads: int) -> dict[str, Any]:
    """Seconds per element of torch's AdamW and DeepSpeed's CPU Adam on CPU tensors."""
    import torch

    torch.set_num_threads(threads)
    out: dict[str, Any] = {}
    torch_adam = torch.optim.AdamW(_params(torch), lr=1e-4, foreach=True)
    out["cpu_torch_adamw_s_per_param"] = _mean_s(torch_adam.step, reps) / ADAM_ELEMENTS
    torch_sgd = torch.optim.SGD(_params(torch), lr=1e-4, momentum=0.9, foreach=True)
    out["cpu_torch_sgd_s_per_param"] = _mean_s(torch_sgd.step, reps) / ADAM_ELEMENTS
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        ds_adam = DeepSpeedCPUAdam(_params(torch), lr=1e-4, adamw_mode=True)
        out["cpu_adam_s_per_param"] = _mean_s(ds_adam.step, reps) / ADAM_ELEMENTS
    except Exception as e:  # an op that does not build here: say why, keep torch's
        out["cpu_adam_unavailable"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return out


def _aligned_buffer() -> mmap.mmap:
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(BLOCK))
    return buf


def nvme_rates(folder: Path) -> dict[str, Any]:
    """Sequential write and read bandwidth of a file in ``folder``."""
    path = folder / f".fsdpsim-nvme-{os.getpid()}.bin"
    direct = getattr(os, "O_DIRECT", 0)
    buf = _aligned_buffer()
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
        except OSError:
            direct = 0
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        t0 = time.perf_counter()
        for _ in range(NVME_BYTES // BLOCK):
            os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | direct)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for _ in range(NVME_BYTES // BLOCK):
            os.readv(fd, [buf])
        read_s = time.perf_counter() - t0
        os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return {
        "nvme_write_Bps": NVME_BYTES / write_s,
        "nvme_read_Bps": NVME_BYTES / read_s,
        "nvme_method": "O_DIRECT" if direct else "buffered, page cache dropped with posix_fadvise",
    }


def measure_host(*, reps: int, ranks_per_node: int, nvme_path: Path | None) -> dict[str, Any]:
    """Every host figure this machine allows, with how each was taken."""
    threads = max(1, (os.cpu_count() or 1) // ranks_per_node)
    figures: dict[str, Any] = {**copy_rates(reps), **adam_rates(reps, threads)}
    if nvme_path is not None:
        figures |= nvme_rates(nvme_path)
    figures["threads"] = threads
    return figures
