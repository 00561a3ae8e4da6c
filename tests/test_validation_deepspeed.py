"""``fsdpsim validate`` end to end for DeepSpeed ZeRO: real runs on 2 gloo processes (DeepSpeed's
CPU accelerator) against the simulator. The profile has collectives only, so ``validate``
calibrates each scenario's compute itself (its DeepSpeed config is part of what it measures).
"""

from pathlib import Path

import pytest
from validation_runs import row, validate_tiny

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "overrides",
    [
        ("deepspeed.stage=2", "deepspeed.reduce_bucket_size=20000", "deepspeed.overlap_comm=true"),
        (
            "deepspeed.stage=3",
            "deepspeed.stage3_param_persistence_threshold=100",
            "deepspeed.stage3_max_reuse_distance=0",
            "deepspeed.stage3_prefetch_bucket_size=5000",
            "deepspeed.reduce_bucket_size=50000",
            "checkpointing.mode=full",
        ),
    ],
    ids=["zero2-buckets-overlap", "zero3-fetch-prefetch-release-ckpt"],
)
def test_real_deepspeed_run_matches_the_simulation(cpu_profile: Path, overrides: tuple[str, ...]) -> None:
    """DeepSpeed 0.19.8 ZeRO on 2 gloo ranks (its CPU accelerator): collectives exact, the peak
    (every tensor alive at the step's start, then storage by storage) within 1 %."""
    result = validate_tiny(cpu_profile, "deepspeed.enabled=true", "precision.param_dtype=bf16", *overrides)
    assert result["collectives_match"], result["collectives"]
    peak = row(result, "peak memory")
    assert abs(peak["error"]) <= 0.01, peak
