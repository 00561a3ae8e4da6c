"""The rank's place in the job (from torchrun's environment) and process-group setup.

torchrun (and ``calibrate.launch``) export RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; ``init_process_group`` reads them through ``env://``. The backend
is NCCL when CUDA is available, else gloo.
"""

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sim.errors import UserError


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size


def rank_env() -> RankEnv | None:
    """The torchrun environment of this process, or None when it runs alone."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        world = int(os.environ["WORLD_SIZE"])
        return RankEnv(
            rank=int(os.environ["RANK"]),
            world_size=world,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        )
    except ValueError as e:
        raise UserError(f"bad torchrun environment: {e}") from None


def init_distributed(env: RankEnv, timeout_s: float, backend: str = "auto") -> tuple[str, Any]:
    """Join the process group; returns (backend name, torch.device of this rank).

    ``backend`` "auto" is NCCL on CUDA GPUs when there is one GPU per local rank, else gloo on
    the CPU. The process-group timeout is longer than the watchdog's so the watchdog speaks first.
    """
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = "nccl" if gpus else "gloo"
    if backend == "nccl":
        if env.local_world_size > gpus:
            raise UserError(
                f"{env.local_world_size} ranks per node but {gpus} CUDA GPU(s): NCCL needs one GPU per rank "
                "(use fewer ranks, or --backend gloo to calibrate the CPU)"
            )
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s + 60), device_id=device)
        return "nccl", device
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s + 60))
    return "gloo", torch.device("cpu")


def versions(backend: str) -> dict[str, Any]:
    """torch / CUDA / NCCL versions for the profile's ``source``."""
    import torch

    nccl: Any = "gloo"
    if backend == "nccl":
        v = torch.cuda.nccl.version()
        nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    return {"torch_version": torch.__version__, "cuda_version": torch.version.cuda, "nccl_version": nccl}


def mean_over_ranks(values: dict[str, Any], device: Any) -> dict[str, Any]:
    """Average a flat-or-nested dict of floats over all ranks (one all_reduce)."""
    import torch
    import torch.distributed as dist

    flat = [(k, sk) for k, v in values.items() for sk in (v if isinstance(v, dict) else [None])]
    vec = torch.tensor(
        [values[k][sk] if sk else values[k] for k, sk in flat], dtype=torch.float64, device=device
    )
    dist.all_reduce(vec)
    vec /= dist.get_world_size()
    out: dict[str, Any] = {}
    for (k, sk), x in zip(flat, vec.tolist(), strict=True):
        if sk:
            out.setdefault(k, {})[sk] = x
        else:
            out[k] = x
    return out
