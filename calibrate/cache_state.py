"""Caches as a training step leaves them, before each timed repetition.

A calibration repeats one piece of work back to back, so from the second repetition on its
weights, inputs and optimizer state are still in the last-level cache. In a training step they
are not: between one optimizer step and the next, or a block's forward and its backward, the
rest of the step has passed through the cache. Measured on this project's 2-core Xeon (L3
480 MiB, the 5m Llama under FSDP2 on 2 gloo ranks): AdamW over the rank's shards took 9.0 ms
back to back and 13.5 ms inside the real step; back to back after writing a buffer the size of
the cache, 13.2 ms.

So a timed repetition either works on its own copy of the data, the copies made, then the
cache overwritten once (``copies_for``: the collectives, the copy-in), or is preceded by reading
a buffer as large as that cache (``evict``: whole-model steps, the optimizer), as
``triton.testing.do_bench`` zeroes a 256 MB buffer before each repetition on a GPU. Reading
evicts as writing does and costs less: here, AdamW after a read of the buffer 11.7 / 12.6 ms,
after a write 11.8 / 12.6 ms (two ranks at once); the read 40 ms, the write 61 ms. The size
is the machine's own: the largest data cache sysfs lists on a CPU, the device's L2 on a GPU.
"""

import math
from functools import cache
from pathlib import Path

import torch

SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
FALLBACK_BYTES = 256 * 2**20  # triton.testing.do_bench's buffer, where the machine lists no cache
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def sysfs_size_bytes(text: str) -> int:
    """A sysfs cache ``size`` (``48K``, ``2048K``, ``32M``) in bytes."""
    text = text.strip()
    return int(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else int(text)


def cache_sizes_bytes(root: Path = SYSFS_CACHES) -> list[int]:
    """The data (and unified) caches of the first CPU, as sysfs lists them."""
    return [
        sysfs_size_bytes((index / "size").read_text())
        for index in sorted(root.glob("index*"))
        if (index / "size").exists() and (index / "type").read_text().strip() != "Instruction"
    ]


def last_level_cache_bytes(device: torch.device, root: Path = SYSFS_CACHES) -> int:
    """The largest cache in front of ``device``'s memory (bytes)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    return max(cache_sizes_bytes(root), default=FALLBACK_BYTES)


def copies_for(set_bytes: int, *, uses: int, cache_bytes: int) -> int:
    """Copies of a repetition's data to rotate through, the cheaper way to cold repetitions
    where the data is small and the cache large (a 480 MiB L3 takes 40 ms to read through here),
    like hipBLASLt-bench's ``--rotating`` buffers.

    With one ``evict`` after the copies are made, a copy used once is cold; one used again has
    had the ``copies - 1`` others pass through the cache since, at least ``cache_bytes`` of
    them. So: one copy per use, or enough that the others outgrow the cache, whichever is fewer.
    """
    return max(1, min(uses, math.ceil(cache_bytes / max(set_bytes, 1)) + 1))


@cache
def _buffer(device: torch.device) -> torch.Tensor:
    return torch.zeros(last_level_cache_bytes(device) // 4, dtype=torch.int32, device=device)


def evict(device: torch.device) -> None:
    """Fill the last-level cache with a buffer of its size, so what the next repetition reads
    comes from memory."""
    _buffer(device).amax()
