"""Eager elementwise kernels move their bytes slower than a streaming benchmark: the GPU kernel model
(``sim.costs.gpu``) charges them at ``eager_memory_efficiency`` of the streaming rate, a figure
``validation.eager_bandwidth`` derives from Liger-Kernel's published timings of the HF/torch
reference ops; parts without a measurement borrow from their architecture family."""

import pytest

from sim.costs.gpu import eager_memory_efficiency, kernel_model
from sim.hardware.registry import builtin_devices
from validation.eager_bandwidth import MIN_STREAM_S, PROFILE_OF_GPU, efficiency_by_profile, mlp_checks, passes

DEVICES = builtin_devices()


@pytest.fixture(scope="module")
def all_passes():  # type: ignore[no-untyped-def]
    return passes()


def test_the_profiles_carry_the_figure_the_published_timings_give(all_passes) -> None:  # type: ignore[no-untyped-def]
    derived = efficiency_by_profile(all_passes)
    assert set(derived) == set(PROFILE_OF_GPU.values())
    for profile, value in derived.items():
        assert DEVICES[profile].eager_memory_efficiency == value, profile
        assert 0.3 < value < 1.0  # eager kernels reach part of the streaming rate, never all of it


def test_every_gpu_counts_only_bandwidth_bound_passes_of_every_op(all_passes) -> None:  # type: ignore[no-untyped-def]
    for gpu in PROFILE_OF_GPU:
        counted = [p for p in all_passes if p.gpu == gpu and p.counted]
        assert {p.kernel for p in counted} == {"rms_norm", "rope", "cross_entropy", "layer_norm"}
        assert {p.direction for p in counted} == {"forward", "backward"}
        assert all(p.moved_bytes / p.streaming_Bps >= MIN_STREAM_S for p in counted)
        left_out = [p for p in all_passes if p.gpu == gpu and not p.counted]
        assert all(p.moved_bytes / p.streaming_Bps < MIN_STREAM_S for p in left_out)


def test_the_tracer_counts_hf_rmsnorm_forward_to_the_byte(all_passes) -> None:  # type: ignore[no-untyped-def]
    """HF's RMSNorm (fp32 weight) over a (2048, 4096) bf16 input: to(fp32) 2+4 B per element, pow
    4+4, mean 4 (+4 per row), add and rsqrt 2×(4+4) per row, x·rsqrt 4+4 (+4 per row), to(bf16)
    4+2, weight·x 2+4 (+4 per column); the tracer's rule gives exactly this sum."""
    m, h = 2048, 4096
    per_element = (2 + 4) + (4 + 4) + 4 + (4 + 4) + (4 + 2) + (2 + 4)
    per_row = 4 + (4 + 4) + (4 + 4) + 4
    expected = m * h * per_element + m * per_row + h * 4
    rms = next(
        p
        for p in all_passes
        if p.kernel == "rms_norm" and p.size == f"M={m} H={h}" and p.direction == "forward"
    )
    assert rms.moved_bytes == expected


def test_eager_work_runs_at_the_eager_rate_and_matmul_operands_stream() -> None:
    device = DEVICES["a100-sxm-80g"]
    model = kernel_model(device, "bf16", DEVICES)
    assert device.achievable_hbm_bandwidth_Bps is not None and device.eager_memory_efficiency is not None
    assert model.hbm_Bps == device.achievable_hbm_bandwidth_Bps
    assert model.eager_Bps == pytest.approx(
        device.achievable_hbm_bandwidth_Bps * device.eager_memory_efficiency
    )
    assert model.memory_s(1e9) == pytest.approx(1e9 / model.eager_Bps)
    # a matmul too thin to be compute-bound moves its operands at the streaming rate
    m, n, k = 1 << 20, 8, 8
    assert model.gemm_s(m, n, k) >= (m * k + k * n + m * n) * 2 / model.hbm_Bps


@pytest.mark.parametrize(
    ("name", "lender"),
    [
        ("a100-sxm-40g", "a100-pcie-80g"),  # 1382 GB/s: nearer the PCIe part's 1648 than the SXM's 1737
        ("rtx-4090", "a100-pcie-80g"),  # sm89 borrows from sm80
        ("h100-sxm", "h100-nvl"),
        ("h200", "h100-nvl"),
        ("b200", "h100-nvl"),  # sm100 borrows from sm90
    ],
)
def test_a_part_without_a_measurement_borrows_its_familys_nearest(name: str, lender: str) -> None:
    assert DEVICES[name].eager_memory_efficiency is None
    assert eager_memory_efficiency(DEVICES[name], DEVICES) == DEVICES[lender].eager_memory_efficiency


def test_a_part_with_no_measured_family_streams() -> None:
    assert eager_memory_efficiency(DEVICES["mi300x"], DEVICES) == 1.0
    assert eager_memory_efficiency(DEVICES["h100-sxm"], {}) == 1.0


def test_the_kernel_model_times_hf_llama_mlp_as_liger_measured_it() -> None:
    """Out of sample (no figure is derived from these timings): HF's LlamaMLP, SwiGLU and GeGLU at
    hidden 4096 / intermediate 11008 in bf16 on an A100-SXM4-80GB, forward and backward, predicted
    as the simulator times an op (matmuls at ``gemm_s``, elementwise bytes at the eager rate),
    within 5 % of Liger-Kernel's published medians."""
    checks = mlp_checks()
    assert {(c.kernel, c.direction) for c in checks} == {
        ("swiglu", "forward"),
        ("geglu", "forward"),
        ("geglu", "backward"),
    }
    assert len(checks) == 12
    for c in checks:
        assert abs(c.error) <= 0.05, c
