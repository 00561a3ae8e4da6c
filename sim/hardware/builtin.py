"""Datasheet profiles, in the same JSON format ``calibrate`` writes. None of these is calibrated.

Every number names its public source. Bus bandwidths are what nccl-tests typically reaches on
these systems, below the link's nominal rate; calibrate your own cluster for real figures.
"""

from typing import Any

from sim.hardware.schema import SCHEMA_VERSION

MiB = 1 << 20

# NCCL on a GPU: collectives run on their own streams beside compute and need no staging copies;
# PyTorch's SDPA dispatches to flash attention; ~10 us of host launch per collective.
NCCL_BACKEND: dict[str, Any] = {
    "name": "nccl",
    "overlaps_comm_compute": True,
    "collective_temp_buffers": False,
    "attention_kernel": "flash",
    "collective_launch_s": 10e-6,
}

BUILTIN_PROFILES: dict[str, dict[str, Any]] = {
    "h100-sxm": {
        "schema_version": SCHEMA_VERSION,
        "name": "h100-sxm",
        "calibrated": False,
        "source": {
            "method": "datasheet",
            "note": "NVIDIA H100 Tensor Core GPU datasheet; DGX H100 user guide",
        },
        "device": {
            "name": "NVIDIA H100 80GB HBM3 (SXM5)",
            # nvidia-smi reports 81,559 MiB total on an H100 SXM5 80GB.
            "memory_bytes": 81559 * MiB,
            # H100 SXM datasheet: BF16/FP16 tensor 1,979 TFLOPS with sparsity -> 989.4 dense;
            # FP32 (non-tensor, PyTorch's default for fp32 matmul without TF32) 67 TFLOPS.
            "peak_flops": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 67e12},
            # H100 SXM datasheet: HBM3 3.35 TB/s.
            "hbm_bandwidth_Bps": 3.35e12,
            # Assumption, not a measurement: large transformer matmuls commonly reach ~50 % of peak
            # end to end (MFU figures published for Llama training on H100 are 38-55 %).
            "compute_efficiency": 0.5,
        },
        "backend": NCCL_BACKEND,
        "topology": {
            "gpus_per_node": 8,
            # NVLink 4: 900 GB/s bidirectional per GPU = 450 GB/s per direction; nccl-tests on
            # DGX H100 reports ~360 GB/s bus bandwidth for large all-gather/reduce-scatter (80 %).
            "intra_node": {"latency_s": 15e-6, "bus_bw_Bps": 360e9},
            # DGX H100: 8x ConnectX-7 400 Gb/s, one per GPU = 50 GB/s per GPU; ~80 % achievable.
            "inter_node": {"latency_s": 30e-6, "bus_bw_Bps": 40e9},
        },
        "collectives": [],
    },
    "a100-sxm-80g": {
        "schema_version": SCHEMA_VERSION,
        "name": "a100-sxm-80g",
        "calibrated": False,
        "source": {
            "method": "datasheet",
            "note": "NVIDIA A100 Tensor Core GPU datasheet; DGX A100 user guide",
        },
        "device": {
            "name": "NVIDIA A100-SXM4-80GB",
            # nvidia-smi reports 81,920 MiB total on an A100 SXM4 80GB.
            "memory_bytes": 81920 * MiB,
            # A100 datasheet: BF16/FP16 tensor 312 TFLOPS dense; FP32 19.5 TFLOPS.
            "peak_flops": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
            # A100 80GB SXM datasheet: HBM2e 2,039 GB/s.
            "hbm_bandwidth_Bps": 2.039e12,
            # Assumption, as for h100-sxm.
            "compute_efficiency": 0.5,
        },
        "backend": NCCL_BACKEND,
        "topology": {
            "gpus_per_node": 8,
            # NVLink 3: 600 GB/s bidirectional = 300 GB/s per direction; nccl-tests on DGX A100
            # reports ~230 GB/s bus bandwidth (77 %).
            "intra_node": {"latency_s": 15e-6, "bus_bw_Bps": 230e9},
            # DGX A100: 8x ConnectX-6 200 Gb/s HDR, one per GPU = 25 GB/s per GPU; ~80 % achievable.
            "inter_node": {"latency_s": 30e-6, "bus_bw_Bps": 20e9},
        },
        "collectives": [],
    },
}
