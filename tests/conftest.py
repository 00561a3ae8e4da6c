"""Fixtures shared across test files. Under ``pytest -n 2 --dist loadfile`` each worker builds a
session fixture at most once, for the files it runs."""

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from simtest import run_calibrate

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "scenarios" / "tiny.toml"

# The longest files, longest first (each one's seconds on one of `make test`'s two workers, from 55
# down to 20, measured 2026-12-08). Under `make test` (`--dist loadfile --no-loadscope-reorder`) a
# worker takes whole files in collection order, so these start first and the two workers finish
# together (longest processing time first) instead of one running a long file alone at the end
# (its last 45 s, measured before); the rest keep pytest's order. A file renamed away only loses
# its place (``tests/test_suite_order.py`` names what is missing).
LONGEST_FIRST = (
    "test_validation.py",
    "test_readme_answers.py",
    "test_validation_deepspeed.py",
    "test_tune.py",
    "test_cli.py",
    "test_childproc.py",
    "test_fsdp1_lora.py",
    "test_timeline.py",
    "test_calibrate_comm.py",
    "test_calibrate_hf_units.py",
    "test_calibrate_lora_units.py",
    "test_fake_memory.py",
    "test_golden.py",
    "test_deepspeed_step_calibration.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``LONGEST_FIRST``'s files first, in its order; a stable sort keeps every file's own order."""
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))


@pytest.fixture(scope="session", autouse=True)
def _model_descriptions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One description cache (``FSDPSIM_CACHE_DIR``) for the whole run, shared by the xdist workers
    (their base folders' parent), never the user's: a model described at the same dims and
    settings is measured once per run, whichever file asks first. Descriptions are written
    atomically, so two workers measuring one at once both leave a whole file. Tests of the
    cache's own behaviour (a miss measures, a hit does not) point it at a folder of their own."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if base.name.startswith("popen-gw") else base) / "model-descriptions"
    shared.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FSDPSIM_CACHE_DIR", str(shared))
        yield shared


def _calibrate(*args: str) -> None:
    proc = run_calibrate(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.fixture(scope="session")
def cpu_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This machine's collectives on 2 gloo ranks, measured quickly (small sizes are all the tiny
    model needs). No compute section: ``fsdpsim validate`` then calibrates the scenario's own."""
    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    _calibrate(
        *("comm", "--nproc", "2", "--out", str(path), "--max-bytes", "1M"),
        *("--dtypes", "fp32,bf16", "--iters", "3", "--max-iters", "5"),
    )
    return path


def _with_tiny_compute(base: Path, folder: Path, param_dtype: str) -> Path:
    """``base`` plus the tiny scenario's per-unit compute at ``param_dtype`` on 2 ranks.

    What ``calibrate compute`` measures depends on the model, micro-batch, sequence length, compute
    dtype, world size and DeepSpeed config only (``calibrate.compute.ComputeTarget``): FSDP1, FSDP2,
    HSDP and checkpointing runs of one dtype share it, as ``validate --profile`` lets them."""
    path = folder / f"cpu-tiny-{param_dtype}.json"
    shutil.copyfile(base, path)
    _calibrate(
        *("compute", str(TINY), "--profile", str(path), "--nproc", "2"),
        *("--set", "parallel.world_size=2", "--set", f"precision.param_dtype={param_dtype}"),
    )
    return path


@pytest.fixture(scope="session")
def tiny_fp32_profile(cpu_profile: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_tiny_compute(cpu_profile, tmp_path_factory.mktemp("tiny-fp32"), "fp32")


@pytest.fixture(scope="session")
def tiny_bf16_profile(cpu_profile: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_tiny_compute(cpu_profile, tmp_path_factory.mktemp("tiny-bf16"), "bf16")
