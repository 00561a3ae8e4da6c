"""``make validate-gpu``: the GPU checks, prepared for a machine with one or more NVIDIA GPUs, in
at most ten minutes. Never part of CI (there is no GPU there).

1. First, the development set's LoRA row (``LORA_ROW``: llama-recipes PR #41's step at one rank),
   whose peak reserved memory the simulator misses: the step run once with the caching
   allocator's history recorded, against the built-in profile's prediction, and the GPU's own
   trace through the allocator model (``validation.allocator_trace``), which tells an error of
   the allocator model from one of the simulated sequence. The trace itself is saved in ``$OUT``
   (``lora-row-trace.json.gz``) when the device tool runs it, to be read here afterwards.
2. The built-in profile of this GPU (matched by ``torch.cuda.get_device_name``) predicts real
   FSDP2 steps at world size 1 (bf16, fp32 reduce) for a few model sizes: step time, allocated
   and reserved peaks, predicted from the published kernel figures alone (no calibration).
3. The same steps predicted from this machine's calibrated per-unit compute.
4. The caching allocator's model fed each step's own allocation trace: its reserved and active
   peaks against what the GPU's allocator reserved and held.
5. With two or more GPUs: a 2-rank FSDP2 step.
Every figure goes into VALIDATION.md between markers, rewritten after each item, so that a run
cut short keeps what it measured.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

from sim.errors import UserError
from sim.hardware.builtin import BUILTIN_PROFILES
from sim.hardware.registry import load_profile
from sim.outputs.report import build_report
from sim.scenario.loader import load_scenario
from sim.simulate import simulate
from validation.compare import compare, format_markdown
from validation.launch import run_real
from validation.marked_sections import write_between_markers
from validation.run import calibrated_profile

BASE = "scenarios/tiny.toml"
# (name, scenario, overrides): models a single GPU trains in seconds; the last two a sliding window
# its keys reach and padded rows (SDPA given a mask: memory-efficient attention, k and v copied to
# every head; on an H100-family part timed at the derived curve, ``sim.costs.attention_curves``)
CONFIGS: list[tuple[str, str, list[str]]] = [
    (
        "llama-34m, bf16, 8 x 1024",
        BASE,
        ["model.preset=llama-34m", "training.micro_batch=8", "training.seq_len=1024"],
    ),
    (
        "1.2B (16 x 2048 hidden), bf16, 4 x 2048",
        BASE,
        [
            "model.preset=llama2-7b",
            "model.n_layers=16",
            "model.hidden=2048",
            "model.n_heads=16",
            "model.n_kv_heads=16",
            "model.ffn_hidden=5504",
            "training.micro_batch=4",
            "training.seq_len=2048",
        ],
    ),
    ("Mistral-shaped 0.2B, window 1024, bf16, 4 x 2048", "validation/hf/mistral-small.toml", []),
    (
        "llama-34m, bf16, 8 x 1024 padded rows (512 real tokens each: SDPA given the padding mask)",
        BASE,
        [
            "model.preset=llama-34m",
            "training.micro_batch=8",
            "training.seq_len=1024",
            "training.avg_seq_len=512",
        ],
    ),
]
COMMON = ["precision.param_dtype=bf16", "precision.reduce_dtype=fp32", "parallel.strategy=FULL_SHARD"]
# The development set's first LoRA row (validation.published_memory: Llama-2-7B, LoRA r 8 on
# q_proj and v_proj, FSDP1 over the bf16 base with no mixed precision, eager attention, every
# block checkpointed, 4 x 2048 tokens) at one rank, its KV cache off: today's transformers cannot
# keep it under checkpointing (model.use_cache, sim.scenario.checks).
LORA_ROW: tuple[str, list[str]] = (
    "llama-recipes PR #41's LoRA step (Llama-2-7B, eager attention, full AC, 4 x 2048) at one rank, no KV cache",
    [
        'model.preset="meta-llama/Llama-2-7b-hf"',
        "training.micro_batch=4",
        "training.seq_len=2048",
        'training.attention="eager"',
        "parallel.world_size=1",
        "parallel.fsdp_version=1",
        'parallel.wrap="peft"',
        "fsdp1.mixed_precision=false",
        "fsdp1.limit_all_gathers=true",
        'precision.param_dtype="bf16"',
        'checkpointing.mode="full"',
        'finetune.method="lora"',
        "finetune.rank=8",
        "finetune.alpha=32",
        "finetune.dropout=0.05",
        'finetune.target_modules=["q_proj", "v_proj"]',
    ],
)


def builtin_for(device_name: str) -> str:
    """The built-in profile whose device name this GPU reports (the longest match wins)."""
    matches = [n for n in BUILTIN_PROFILES if load_profile(n).device.name in device_name]
    if not matches:
        raise UserError(f"no built-in profile for {device_name!r}; built-in: {', '.join(BUILTIN_PROFILES)}")
    return max(matches, key=lambda n: len(load_profile(n).device.name))


def _one(
    name: str, scenario: str, sets: list[str], nproc: int, profile: str, calibrated: str | None
) -> list[str]:
    spec = {"scenario": scenario, "overrides": sets, "steps": 10, "warmup": 3}
    return _compared(name, scenario, sets, nproc, run_real(spec, nproc, 300.0), profile, calibrated)


def _compared(
    name: str,
    base: str,
    sets: list[str],
    nproc: int,
    ranks: list[dict],
    profile: str,
    calibrated: str | None,
) -> list[str]:
    """The real run's ranks against the prediction from each profile given."""
    lines = []
    for label, prof in (("built-in, uncalibrated", profile), ("calibrated compute", calibrated)):
        if prof is None:
            continue
        scenario = load_scenario(base, [*sets, f'cluster.profile="{prof}"'])
        result = simulate(scenario)
        lines.append(
            format_markdown(
                f"{name} on {nproc} GPU(s), {label}", compare(build_report(result), result.events, ranks)
            )
        )
    return lines


def allocator_line(name: str, check: dict[str, int]) -> str:
    """One sentence: the allocator model on the GPU's own sequence against the GPU's allocator."""
    gib = 2**30
    reserved, replayed = check["gpu_reserved_bytes"], check["replayed_reserved_bytes"]
    active, replayed_active = check["gpu_active_bytes"], check["replayed_active_bytes"]
    return (
        f"{name}: the caching allocator's model fed this GPU's own allocation trace of the run "
        f"({check['entries']:,} entries, {check['streams']} streams) reserves {replayed / gib:.3f} GiB "
        f"against the GPU's {reserved / gib:.3f} GiB ({replayed / reserved - 1:+.1%}); its active peak "
        f"{replayed_active / gib:.3f} against {active / gib:.3f} GiB."
    )


def _allocator_check(name: str, scenario: str, sets: list[str]) -> str:
    spec = {"scenario": scenario, "overrides": sets, "steps": 2, "warmup": 1, "allocator_trace": True}
    return allocator_line(name, run_real(spec, 1, 300.0)[0]["allocator_trace"])


def run(out: str, nproc: int) -> str:
    import torch

    if not torch.cuda.is_available():
        raise UserError("validate-gpu needs a CUDA GPU; none is visible here")
    name = torch.cuda.get_device_name(0)
    profile = builtin_for(name)
    lines = [
        f"## GPU validation (`make validate-gpu`) on {torch.cuda.device_count()} x {name}",
        "",
        f"Built-in profile `{profile}`; torch {torch.__version__}, CUDA {torch.version.cuda}.",
        "",
    ]

    def record(new: list[str]) -> None:  # each item's figures written (and shown) as they come
        lines.extend(new)
        print("\n\n".join(new), flush=True)
        write_between_markers(out, "gpu", "\n\n".join(lines))

    try:
        record([_lora_row(profile, os.environ.get("OUT"))])
    except Exception as e:  # whatever stops it, the items after it are still worth their minutes
        record([f"{LORA_ROW[0]}: failed: {type(e).__name__}: {e}"])
    with tempfile.TemporaryDirectory(prefix="fsdpsim-gpu-") as tmp:
        for i, (config, scenario, sets) in enumerate(CONFIGS):
            world = [*COMMON, *sets, "parallel.world_size=1"]
            folder = Path(tmp) / f"c{i}"
            folder.mkdir()
            try:
                cal = calibrated_profile(scenario, world, 1, folder, str(_profile_file(profile, folder)))
            except UserError as e:  # the uncalibrated prediction is still worth recording
                print(f"calibration failed: {e}", file=sys.stderr)
                cal = None
            record(
                [*_one(config, scenario, world, 1, profile, cal), _allocator_check(config, scenario, world)]
            )
        if torch.cuda.device_count() >= 2:
            name, scenario, sets = CONFIGS[0]
            record(_one(name, scenario, [*COMMON, *sets, "parallel.world_size=2"], 2, profile, None))
    return "\n\n".join(lines)


def _lora_row(profile: str, out_dir: str | None) -> str:
    """``LORA_ROW`` run once with the allocator's history recorded: its comparison with the
    built-in profile's prediction and the allocator check, its trace saved in ``out_dir``."""
    name, sets = LORA_ROW
    spec: dict = {"scenario": BASE, "overrides": sets, "steps": 3, "warmup": 1, "allocator_trace": True}
    if out_dir:
        spec["allocator_trace_file"] = str(Path(out_dir) / "lora-row-trace.json.gz")
    ranks = run_real(spec, 1, 420.0)
    return "\n\n".join(
        [
            *_compared(name, BASE, sets, 1, ranks, profile, None),
            allocator_line(name, ranks[0]["allocator_trace"]),
        ]
    )


def _profile_file(name: str, folder: Path) -> Path:
    """A copy of a built-in profile as a file, for ``calibrate compute`` to add its section to."""
    import json

    path = folder / f"{name}.json"
    path.write_text(json.dumps(BUILTIN_PROFILES[name]))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validation.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="VALIDATION.md")
    parser.add_argument("--nproc", type=int, default=None, help="GPUs to use (default: all)")
    args = parser.parse_args(argv)
    try:
        import torch

        run(args.out, args.nproc or max(1, torch.cuda.device_count()))
        print(f"written to {args.out}")
    except UserError as e:
        print(f"validate-gpu: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
