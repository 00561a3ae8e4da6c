"""``fsdpsim sweep``: axis parsing and expansion, invalid points in rows, outputs, executors."""

import csv
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sim.cli.main import main as fsdpsim_main
from sim.errors import UserError
from sim.study.sweep.execute import ExecutorSpec, chunk_size, parse_executor, run_points
from sim.study.sweep.plan import Axis, axes_from_table, axis_from_flag, expand, make_plan, merge_axes

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "scenarios" / "sweep-7b-strategies.toml"
CSV_TAIL = [
    "step_time_s",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "mfu",
    "peak_memory_bytes",
    "fits",
    "error",
]
MD_TAIL = ["step (ms)", "tokens/s", "tokens/s/GPU", "MFU", "peak (GiB)", "fits"]

TINY = """\
[model]
preset = "tiny"

[training]
micro_batch = 2
seq_len = 64

[parallel]
world_size = 4
strategy = "FULL_SHARD"

[cluster]
gpus_per_node = 2
"""


def scenario(tmp_path: Path, sweep: str = "") -> Path:
    """A tiny-model scenario file with ``sweep`` appended (a ``[sweep]`` table or nothing)."""
    path = tmp_path / "s.toml"
    path.write_text(TINY + sweep)
    return path


def sweep(*args: Any) -> int:
    return fsdpsim_main(["sweep", *map(str, args)])


def read_csv(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(path.read_text())))


def md_header(text: str) -> list[str]:
    return [cell.strip() for cell in text.splitlines()[0].strip("|").split("|")]


# --- axes and expansion ---------------------------------------------------------------------


def test_grid_is_the_product_with_the_last_axis_fastest() -> None:
    axes = [
        Axis(key="training.micro_batch", values=(1, 2)),
        Axis(key="parallel.wrap", values=("a", "b", "c")),
    ]
    points = expand(axes, "grid", "f")
    assert len(points) == 6
    assert [tuple(v for _, v in p) for p in points] == [
        (1, "a"),
        (1, "b"),
        (1, "c"),
        (2, "a"),
        (2, "b"),
        (2, "c"),
    ]
    assert points[0] == (("training.micro_batch", 1), ("parallel.wrap", "a"))


def test_zip_pairs_the_ith_values_and_needs_equal_lengths() -> None:
    axes = [
        Axis(key="training.micro_batch", values=(1, 2, 4)),
        Axis(key="training.seq_len", values=(8, 4, 2)),
    ]
    assert [tuple(v for _, v in p) for p in expand(axes, "zip", "f")] == [(1, 8), (2, 4), (4, 2)]
    short = [axes[0], Axis(key="training.seq_len", values=(8, 4))]
    with pytest.raises(
        UserError,
        match="f: zip mode needs lists of equal length: training.micro_batch has 3, training.seq_len has 2",
    ):
        expand(short, "zip", "f")


def test_nothing_to_sweep_is_a_user_error() -> None:
    with pytest.raises(UserError, match="nothing to sweep"):
        expand([], "grid", "f")


def test_sweep_table_reads_quoted_and_nested_dotted_keys() -> None:
    table = {"mode": "zip", "training.micro_batch": [1, 2], "parallel": {"wrap": ["model", "block"]}}
    axes, mode = axes_from_table(table, "f.toml")
    assert mode == "zip"
    assert axes == (
        Axis(key="training.micro_batch", values=(1, 2)),
        Axis(key="parallel.wrap", values=("model", "block")),
    )


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            {"parallel.stratgy": ["FULL_SHARD"]},
            "f.toml: [sweep]: unknown key 'parallel.stratgy' (did you mean 'parallel.strategy'?)",
        ),
        (
            {"paralel.wrap": ["model"]},
            "f.toml: [sweep]: 'paralel.wrap': unknown section 'paralel' (did you mean 'parallel'?)",
        ),
        (
            {"training.micro_batch": []},
            "f.toml: [sweep] 'training.micro_batch' must be a non-empty list of values, got []",
        ),
        (
            {"training.micro_batch": 4},
            "f.toml: [sweep] 'training.micro_batch' must be a non-empty list of values, got 4",
        ),
        (
            {"mode": "cross", "training.micro_batch": [1]},
            "f.toml: [sweep] mode = 'cross' is not allowed; allowed: grid, zip",
        ),
    ],
)
def test_sweep_table_mistakes_name_file_and_key(table: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError) as e:
        axes_from_table(table, "f.toml")
    assert str(e.value) == message


def test_sweep_flag_values_are_read_like_set() -> None:
    assert axis_from_flag("training.micro_batch=1,2, 4").values == (1, 2, 4)
    assert axis_from_flag('parallel.strategy=FULL_SHARD,"NO_SHARD"').values == ("FULL_SHARD", "NO_SHARD")
    assert axis_from_flag("parallel.reshard_after_forward=true,false").values == (True, False)
    assert axis_from_flag("parallel.ddp_bucket_mb=25,12.5").values == (25, 12.5)


@pytest.mark.parametrize(
    "text", ["training.micro_batch", "micro_batch=1,2", "training.micro_batch=1,,2", "training.micro_batch="]
)
def test_sweep_flag_syntax_mistakes(text: str) -> None:
    with pytest.raises(UserError, match="expected section.key=v1,v2"):
        axis_from_flag(text)


def test_flags_replace_file_axes_in_place_add_new_ones_and_set_pins_a_key() -> None:
    file_axes = [
        Axis(key="training.micro_batch", values=(1, 2)),
        Axis(key="parallel.wrap", values=("model",)),
    ]
    flags = [
        Axis(key="parallel.wrap", values=("block", "linear")),
        Axis(key="training.seq_len", values=(64,)),
    ]
    merged = merge_axes(file_axes, flags, fixed=[])
    assert [a.key for a in merged] == ["training.micro_batch", "parallel.wrap", "training.seq_len"]
    assert merged[1].values == ("block", "linear")
    assert [a.key for a in merge_axes(file_axes, [], fixed=["training.micro_batch"])] == ["parallel.wrap"]
    with pytest.raises(UserError, match="contradict"):
        merge_axes([], flags, fixed=["parallel.wrap"])
    with pytest.raises(UserError, match="given twice"):
        merge_axes([], [flags[0], flags[0]], fixed=[])


def test_plan_merges_file_flags_zip_and_set(tmp_path: Path) -> None:
    path = scenario(
        tmp_path, '[sweep]\n"training.micro_batch" = [1, 2]\n"parallel.wrap" = ["model", "block"]\n'
    )
    assert len(make_plan(str(path), [], [], zip_mode=False).points) == 4
    assert len(make_plan(str(path), [], [], zip_mode=True).points) == 2
    plan = make_plan(str(path), ["training.seq_len=32,64,128"], ["training.micro_batch=4"], zip_mode=False)
    assert [a.key for a in plan.axes] == ["parallel.wrap", "training.seq_len"]
    assert len(plan.points) == 6
    assert plan.base["training"]["micro_batch"] == 4
    assert "sweep" not in plan.base


def test_executor_spec() -> None:
    assert parse_executor("local") == ExecutorSpec(kind="local")
    assert parse_executor("ray") == ExecutorSpec(kind="ray")
    assert parse_executor("dask://10.0.0.1:8786") == ExecutorSpec(kind="dask", address="tcp://10.0.0.1:8786")
    for bad in ("dask://", "dask://host", "spark", "dask:host:1"):
        with pytest.raises(UserError, match="expected local, ray or dask://HOST:PORT"):
            parse_executor(bad)


def test_chunks_give_each_worker_several_tasks_of_at_most_64_points() -> None:
    assert chunk_size(10_000, 2) == 64
    assert chunk_size(24, 2) == 2
    assert chunk_size(3, 16) == 1


# --- running and output ---------------------------------------------------------------------


def test_sweep_writes_csv_markdown_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = scenario(
        tmp_path,
        '[sweep]\n"parallel.strategy" = ["FULL_SHARD", "SHARD_GRAD_OP"]\n"training.micro_batch" = [1, 2]\n',
    )
    out = tmp_path / "out"
    assert sweep(path, "--out", out, "--jobs", "2") == 0
    assert sorted(p.name for p in out.iterdir()) == ["sweep.csv", "sweep.html", "sweep.md"]
    rows = read_csv(out / "sweep.csv")
    assert list(rows[0]) == ["point", "parallel.strategy", "training.micro_batch", *CSV_TAIL]
    assert [(r["point"], r["parallel.strategy"], r["training.micro_batch"]) for r in rows] == [
        ("0", "FULL_SHARD", "1"),
        ("1", "FULL_SHARD", "2"),
        ("2", "SHARD_GRAD_OP", "1"),
        ("3", "SHARD_GRAD_OP", "2"),
    ]
    assert all(r["error"] == "" and r["fits"] == "true" and float(r["step_time_s"]) > 0 for r in rows)
    assert float(rows[1]["tokens_per_s"]) > float(rows[0]["tokens_per_s"])  # twice the tokens per step
    md = (out / "sweep.md").read_text()
    assert capsys.readouterr().out == md
    assert md_header(md) == ["#", "parallel.strategy", "training.micro_batch", *MD_TAIL]
    assert len(md.splitlines()) == 2 + 4
    html = (out / "sweep.html").read_text()
    assert 'class="plotly-graph-div"' in html and "Pareto front" in html


def test_invalid_points_are_reported_in_their_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = scenario(
        tmp_path, '[sweep]\n"parallel.world_size" = [4, 6]\n"training.micro_batch" = [1, "two"]\n'
    )
    out = tmp_path / "out"
    assert (
        sweep(
            path,
            "--out",
            out,
            "--jobs",
            "1",
            "--set",
            "parallel.strategy=HYBRID_SHARD",
            "--set",
            "parallel.shard_group_size=4",
        )
        == 0
    )
    rows = read_csv(out / "sweep.csv")
    assert [r["error"] for r in rows] == [
        "",
        "training.micro_batch must be an integer, got 'two'",
        "parallel.world_size (6) must be divisible by parallel.shard_group_size (4)",
        "training.micro_batch must be an integer, got 'two'",
    ]
    assert all(r["step_time_s"] == r["fits"] == "" for r in rows[1:])
    md = capsys.readouterr().out
    assert md_header(md)[-1] == "error"
    assert "must be divisible" in md.splitlines()[4]


def test_every_point_invalid_exits_1_without_a_plot(tmp_path: Path) -> None:
    path = scenario(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.html").write_text("an older sweep's plot")
    assert (
        sweep(
            path,
            "--out",
            out,
            "--sweep",
            "parallel.world_size=3,5",
            "--set",
            "parallel.strategy=HYBRID_SHARD",
            "--set",
            "parallel.shard_group_size=2",
            "--jobs",
            "1",
        )
        == 1
    )
    assert sorted(p.name for p in out.iterdir()) == ["sweep.csv", "sweep.md"]


def test_parallel_rows_equal_serial_rows_bit_for_bit(tmp_path: Path) -> None:
    plan = make_plan(
        str(EXAMPLE), ["parallel.wrap=model,block"], ["model.preset=tiny", "training.seq_len=64"], False
    )
    serial = run_points(plan.base, plan.where, plan.points, jobs=1)
    parallel = run_points(plan.base, plan.where, plan.points, jobs=2)
    assert len(serial) == 48
    assert serial == parallel
    assert [r["step_time_s"].hex() for r in serial] == [r["step_time_s"].hex() for r in parallel]


def test_example_scenario_answers_its_question(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sweep(EXAMPLE, "--out", tmp_path, "--jobs", "2") == 0
    rows = read_csv(tmp_path / "sweep.csv")
    assert len(rows) == 24 and all(r["error"] == "" for r in rows)
    assert all(r["fits"] == "false" for r in rows if r["parallel.strategy"] == "NO_SHARD")  # 16 B/param of 7B
    best = max((r for r in rows if r["fits"] == "true"), key=lambda r: float(r["tokens_per_s"]))
    # ZeRO-2 does not re-gather in backward, and its 66 GiB at micro-batch 2 still fits
    assert (best["parallel.strategy"], best["checkpointing.mode"], best["training.micro_batch"]) == (
        "SHARD_GRAD_OP",
        "none",
        "2",
    )


# --- user mistakes: one line, exit 2, nothing written ---------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["--sweep", "training.micro_bach=1,2"],
            "unknown key 'training.micro_bach' (did you mean 'training.micro_batch'?)",
        ),
        (
            ["--sweep", "training.micro_batch=1,2", "--sweep", "training.seq_len=8", "--zip"],
            "zip mode needs lists of equal length",
        ),
        (["--sweep", "training.micro_batch=1,2", "--executor", "spark"], "--executor 'spark'"),
        (["--sweep", "training.micro_batch=1,2", "--jobs", "0"], "expected a positive integer"),
        (["--sweep", "training.micro_batch=1,2", "--set", "training.micro_batch=4"], "contradict"),
        (["--set", "trainig.seq_len=4", "--sweep", "training.micro_batch=1"], "unknown section 'trainig'"),
        ([], "nothing to sweep"),
    ],
)
def test_user_mistakes_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], fragment: str
) -> None:
    out = tmp_path / "out"
    assert sweep(scenario(tmp_path), "--out", out, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fsdpsim: error: ") and fragment in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_a_missing_extra_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "distributed", None)
    path = scenario(tmp_path)
    for executor, extra in (("ray", "sweep-ray"), ("dask://127.0.0.1:1", "sweep-dask")):
        assert (
            sweep(path, "--out", tmp_path / "o", "--sweep", "training.micro_batch=1", "--executor", executor)
            == 2
        )
        assert f"pip install -e '.[{extra}]'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_without_plotly_nothing_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "plotly", None)
    assert sweep(scenario(tmp_path), "--out", tmp_path / "o", "--sweep", "training.micro_batch=1,2") == 2
    assert "pip install -e '.[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_subprocess_error_is_one_line(tmp_path: Path) -> None:
    path = scenario(
        tmp_path, '[sweep]\n"training.micro_batch" = [1, 2]\n"training.seq_len" = [64]\nmode = "zip"\n'
    )
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "sim.cli.main", "sweep", str(path), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr
        == f"fsdpsim: error: {path}: zip mode needs lists of equal length: training.micro_batch has 2, training.seq_len has 1\n"
    )
    assert not (tmp_path / "o").exists()


# --- distributed executors (local clusters started here) ------------------------------------


TINY_SET = ["--set", "model.preset=tiny", "--set", "training.seq_len=64", "--set", "training.micro_batch=1"]


def local_csv(tmp_path: Path) -> str:
    """The example sweep on the tiny model, run on the local cores: the reference for executors."""
    assert sweep(EXAMPLE, *TINY_SET, "--out", tmp_path / "local", "--jobs", "1") == 0
    return (tmp_path / "local" / "sweep.csv").read_text()


@pytest.mark.slow
def test_dask_executor_gives_the_local_rows(tmp_path: Path) -> None:
    distributed = pytest.importorskip("distributed", reason="the sweep-dask extra is not installed")
    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=2, processes=False, protocol="tcp", dashboard_address=None
    ) as cluster:
        address = cluster.scheduler_address.removeprefix("tcp://")
        assert sweep(EXAMPLE, *TINY_SET, "--out", tmp_path / "dask", "--executor", f"dask://{address}") == 0
    assert (tmp_path / "dask" / "sweep.csv").read_text() == local_csv(tmp_path)


@pytest.mark.slow
def test_ray_executor_connects_to_ray_address(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray", reason="the sweep-ray extra is not installed")
    ray.init(num_cpus=2, include_dashboard=False)  # an existing cluster the sweep connects to
    try:
        env = os.environ | {"RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "sim.cli.main",
                "sweep",
                str(EXAMPLE),
                *TINY_SET,
                "--executor",
                "ray",
                "--out",
                str(tmp_path / "ray"),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        ray.shutdown()
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "ray" / "sweep.csv").read_text() == local_csv(tmp_path)


@pytest.mark.slow
def test_ray_executor_starts_a_local_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray", reason="the sweep-ray extra is not installed")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    plan = make_plan(str(EXAMPLE), ["parallel.strategy=FULL_SHARD"], TINY_SET[1::2], False)
    results = run_points(plan.base, plan.where, plan.points, executor=ExecutorSpec(kind="ray"), jobs=2)
    assert not ray.is_initialized()  # the sweep started its own Ray and shut it down
    assert results == run_points(plan.base, plan.where, plan.points, jobs=1)
