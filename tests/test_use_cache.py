"""``model.use_cache``: HF's KV cache in a training forward (issue 11). Each checkpointed block's
key and value states stay in the ``DynamicCache``, which the checkpoint regions hold (as a keyword
argument of their recomputation) to the end of the first checkpointed block's backward; each
recompute appends its block's K/V again."""

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sim.core.events import OpKind
from sim.errors import UserError
from sim.outputs.report import build_report
from sim.scenario.loader import load_scenario
from sim.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent

DATA = Path(__file__).parent / "data" / "hf"


def _scenario(tmp_path: Path, model_lines: str, extra: str = "") -> Path:
    path = tmp_path / "s.toml"
    path.write_text(
        f"[model]\n{model_lines}\n[training]\nmicro_batch = 2\nseq_len = 256\n[parallel]\nworld_size = 4\n"
        f'[precision]\nparam_dtype = "bf16"\nreduce_dtype = "fp32"\n{extra}'
    )
    return path


def _cache_allocs(ops: list[Any]) -> list[tuple[int, Any]]:
    """(op index, allocation) of every K/V the cache takes, at an op's start or end."""
    return [
        (i, a)
        for i, op in enumerate(ops)
        for a in (*op.allocs, *op.end_allocs)
        if a.label.startswith("kv_cache")
    ]


@pytest.mark.parametrize("model", ['preset = "tiny"', f'config = "{DATA / "tiny-llama.json"}"'])
def test_the_cache_holds_each_blocks_kv_heads(tmp_path: Path, model: str) -> None:
    """tiny (2 kv heads of 16, 2 x 256 tokens, bf16): K and V, 2 x 512 x 32 x 2 bytes per block,
    the described model's from its recorded attention calls, the preset's from its dimensions."""
    path = _scenario(tmp_path, model, '[checkpointing]\nmode = "full"\n')
    on = simulate(load_scenario(path, ["model.use_cache=true"]))
    assert on.step.kv_cache_bytes == (2 * 512 * 2 * 16 * 2,) * 2 == (65536, 65536)
    assert simulate(load_scenario(path)).step.kv_cache_bytes == ()


@pytest.mark.parametrize(
    "fsdp", ["parallel.fsdp_version=2", "parallel.fsdp_version=1", "parallel.strategy=NO_SHARD"]
)
def test_the_cache_lives_from_each_blocks_forward_to_the_first_blocks_backward(
    tmp_path: Path, fsdp: str
) -> None:
    """One kv_cache per block at its forward, one more at its recompute, all freed together at
    the end of block 0's backward (the last region to let the cache go)."""
    path = _scenario(tmp_path, 'preset = "tiny"', '[checkpointing]\nmode = "full"\n')
    result = simulate(load_scenario(path, ["model.use_cache=true", fsdp]))
    ops = result.program.ops
    allocs = _cache_allocs(ops)
    kinds = [(ops[i].kind, ops[i].unit) for i, _ in allocs]
    assert kinds == [
        (OpKind.FORWARD, "model.layers.0"),
        (OpKind.FORWARD, "model.layers.1"),
        (OpKind.RECOMPUTE, "model.layers.1"),
        (OpKind.RECOMPUTE, "model.layers.0"),
    ]
    freed = {next(j for j, op in enumerate(ops) if a.label in op.frees) for _, a in allocs}
    assert len(freed) == 1
    (j,) = freed
    assert ops[j].kind is OpKind.BACKWARD and ops[j].unit == "model.layers.0"
    first_backward = next(k for k, op in enumerate(ops) if op.kind in (OpKind.BACKWARD, OpKind.RECOMPUTE))
    assert all(i < first_backward for i, _ in allocs[:2])


@pytest.mark.parametrize(
    "fsdp", ["parallel.fsdp_version=2", "parallel.fsdp_version=1", "parallel.strategy=NO_SHARD"]
)
def test_a_legacy_cache_dies_with_the_output_at_the_forwards_end(tmp_path: Path, fsdp: str) -> None:
    """transformers < 4.36 (``model.output_format = "legacy"``): each block returns its (k, v), no
    region is given it again, so the recomputes append nothing and every block's K/V is freed by
    the forward's last op, after the loss (4.31 measured: alive in lm_head's forward, dead after
    ``model(...).loss``, each recompute's own (k, v) dropped with its outputs)."""
    path = _scenario(tmp_path, 'preset = "tiny"', '[checkpointing]\nmode = "full"\n')
    result = simulate(load_scenario(path, ["model.use_cache=true", 'model.output_format="legacy"', fsdp]))
    ops = result.program.ops
    allocs = _cache_allocs(ops)
    assert [(ops[i].kind, ops[i].unit) for i, _ in allocs] == [
        (OpKind.FORWARD, "model.layers.0"),
        (OpKind.FORWARD, "model.layers.1"),
    ]
    assert sum(a.bytes for _, a in allocs) == 2 * 65536
    last_forward = max(k for k, op in enumerate(ops) if op.kind is OpKind.FORWARD)
    assert all(a.label in ops[last_forward].frees for _, a in allocs)
    assert "loss" in ops[last_forward].name


def test_a_legacy_cache_raises_the_forward_peak_by_its_bytes(tmp_path: Path) -> None:
    """With checkpointing the cache adds its bytes wherever the forward holds it: the peak of
    the last forward op (the loss, every block's K/V still alive) rises by exactly the cache."""
    path = _scenario(tmp_path, 'preset = "tiny"', '[checkpointing]\nmode = "full"\n')
    curves = {}
    for values in (["model.use_cache=false"], ["model.use_cache=true", 'model.output_format="legacy"']):
        result = simulate(load_scenario(path, values))
        ops = result.program.ops
        last_forward = max(k for k, op in enumerate(ops) if op.kind is OpKind.FORWARD)
        (temp,) = (a.label for a in ops[last_forward].allocs if a.label.startswith("forward_temp"))
        live, at_loss = 0, None
        for m in result.events.memory_of(0):
            live += m.delta_bytes
            if m.label == temp and m.delta_bytes > 0:
                at_loss = live
        curves[values[0]] = at_loss
    on, off = curves["model.use_cache=true"], curves["model.use_cache=false"]
    assert on is not None and off is not None and on - off == 2 * 65536


def test_the_output_format_is_checked(tmp_path: Path) -> None:
    """A DynamicCache with HF's eager attention under checkpointing is refused (the real run
    fails: each recompute appends its K/V, and the eager mask built in forward no longer
    broadcasts, measured with transformers 5.24), and so is a kept output holding one under
    checkpointing (not modelled); the legacy format runs both."""
    path = _scenario(tmp_path, 'preset = "tiny"', '[checkpointing]\nmode = "full"\n')
    eager = ["model.use_cache=true", 'training.attention="eager"']
    with pytest.raises(UserError, match="fails for real"):
        load_scenario(path, eager)
    load_scenario(path, [*eager, 'model.output_format="legacy"'])
    load_scenario(path, [*eager, 'checkpointing.mode="none"'])
    kept = ["model.use_cache=true", "training.keep_outputs=true"]
    with pytest.raises(UserError, match="training.keep_outputs with model.use_cache under checkpointing"):
        load_scenario(path, kept)
    load_scenario(path, [*kept, 'model.output_format="legacy"'])
    load_scenario(path, [*kept, 'checkpointing.mode="none"'])
    load_scenario(path, ['model.output_format="legacy"'])  # fp32 logits, no cache


def test_without_checkpointing_the_cache_adds_nothing(tmp_path: Path) -> None:
    """Unchecked blocks save K and V for backward anyway; the cache shares their storages."""
    path = _scenario(tmp_path, 'preset = "tiny"')
    on, off = (simulate(load_scenario(path, [f"model.use_cache={v}"])) for v in ("true", "false"))
    assert build_report(on).peak_memory_bytes == build_report(off).peak_memory_bytes
    assert not any(a.label.startswith("kv_cache") for op in on.program.ops for a in op.allocs)


def test_an_encoder_decoder_is_refused(tmp_path: Path) -> None:
    path = _scenario(tmp_path, f'config = "{DATA / "tiny-t5.json"}"')
    with pytest.raises(UserError, match="model.use_cache is not modelled for encoder-decoder"):
        load_scenario(path, ["model.use_cache=true"])


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", ["parallel.fsdp_version=2", "parallel.fsdp_version=1"])
def test_memory_matches_the_real_model_with_its_cache(tmp_path: Path, fsdp: str) -> None:
    """tiny-llama under full checkpointing, one rank of 4 in fake mode: the predicted peak within
    1 % with the cache on and off, and the cache's bytes the difference on both sides."""
    from validation.memory_only import validate_memory_only

    path = str(
        _scenario(tmp_path, f'config = "{DATA / "tiny-llama.json"}"', '[checkpointing]\nmode = "full"\n')
    )
    peaks = {}
    for value in ("true", "false"):
        comparison, _ = validate_memory_only(path, [fsdp, f"model.use_cache={value}"], timeout_s=300)
        row = next(r for r in comparison.rows if r.metric.strip() == "peak memory")
        assert abs(row.predicted / row.measured - 1) < 0.01
        peaks[value] = row
    cache = 2 * 65536
    assert peaks["true"].predicted - peaks["false"].predicted == cache
    assert peaks["true"].measured - peaks["false"].measured == cache


def test_the_legacy_probe_names_its_rows_in_one_line() -> None:
    """``validation.legacy_transformers`` (the PR's own transformers 4.31 code, run where its
    packages are given): a row outside the published memory table is one line and exit 2, before
    any old package is imported."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    for args in (["--memory-row", "9"], ["s.toml", "--memory-row", "0"]):
        proc = subprocess.run(
            [sys.executable, "-m", "validation.legacy_transformers", *args, "--site", "/nonexistent"],
            capture_output=True,
            text=True,
            cwd=root,
        )
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    from validation.published_memory import MEMORY_RUNS

    assert (
        f"allowed 0..{len(MEMORY_RUNS) - 1}, got 9"
        in subprocess.run(
            [sys.executable, "-m", "validation.legacy_transformers", "--memory-row", "9", "--site", "/x"],
            capture_output=True,
            text=True,
            cwd=root,
        ).stderr
    )


def test_a_legacy_cache_is_refused_in_one_line_on_a_newer_transformers(tmp_path: Path) -> None:
    """The real runs build the installed transformers' model: a scenario written for transformers
    < 4.36's (k, v) tuples is refused before anything runs, naming the field and the way out,
    where the run would fail in its first recompute (or measure another cache)."""
    import transformers

    from validation.build import check_output_format

    path = _scenario(tmp_path, 'preset = "tiny"', '[checkpointing]\nmode = "full"\n')
    legacy = load_scenario(path, ["model.use_cache=true", 'model.output_format="legacy"'])
    with pytest.raises(
        UserError, match=r'model.output_format = "legacy" is the cache of transformers < 4.36'
    ):
        check_output_format(legacy, transformers.__version__)
    check_output_format(legacy, "4.31.0")  # the old code's own transformers runs it
    check_output_format(load_scenario(path, ["model.use_cache=false"]), transformers.__version__)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "validation.allocator_replay",
            str(path),
            "--set",
            "model.use_cache=true",
            "--set",
            'model.output_format="legacy"',
            "--set",
            "parallel.fsdp_version=1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "output_format" in out.stderr and "Traceback" not in out.stderr
