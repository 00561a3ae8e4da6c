"""The plotly timeline and sweep plots: figure contents checked directly, then the HTML opened in a
real headless Chromium (no console errors, the plot renders, the screenshot shows the bars)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sim.core.events import OpKind
from sim.outputs.intervals import exposed_comm_intervals, step_time, union_length
from sim.outputs.report import build_report
from sim.outputs.timeline import KIND_COLOURS, DeviceLines, timeline_figure, write_timeline_html
from sim.study.sweep.plots import pareto_front, write_sweep_plots

try:
    from browser import DevTools, decode_png, find_chromium, synthetic_table
except ImportError:  # tests/ is a package
    from tests.browser import DevTools, decode_png, find_chromium, synthetic_table

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


def traces_named(fig, name):
    return [t for t in fig.data if t.name == name]


# --- figure contents (no browser) --------------------------------------------------------------


def test_importing_timeline_does_not_import_plotly():
    code = "import sys, sim.outputs.timeline, sim.outputs.chrome_trace; assert 'plotly' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bars_lanes_and_exposed_spans_come_from_the_table():
    table = synthetic_table(4, 5)
    fig = timeline_figure(table, title="t")
    lanes = fig.layout.yaxis.ticktext
    assert len(lanes) == 4 * 3 and lanes[0] == "rank 0 · compute"
    forward = traces_named(fig, "forward")[0]
    assert len(forward.x) == 4 * len([o for o in table.ops if o.kind is OpKind.FORWARD])
    assert "waited" in traces_named(fig, "all_gather")[0].hovertext[0]
    exposed = traces_named(fig, "exposed communication")[0]
    xs = np.asarray(exposed.x, dtype=float).reshape(-1, 4)
    drawn_ms = float(np.sum(xs[:, 2] - xs[:, 0]))
    want_ms = sum(union_length(exposed_comm_intervals(table.ops_of(r))) for r in range(4)) * 1e3
    assert drawn_ms == pytest.approx(want_ms, rel=1e-9)
    assert fig.layout.updatemenus[0].buttons[0].label == "all shown ranks"


def test_representative_ranks_for_many_ranks():
    table = synthetic_table(32, 4)
    fig = timeline_figure(table, title="t", device=DeviceLines(memory_bytes=80 << 30))
    labels = [b.label for b in fig.layout.updatemenus[0].buttons]
    assert labels == ["all shown ranks", "rank 0", "rank 1 (slowest)", labels[3]]
    assert labels[3].endswith("(fastest)")
    assert len(fig.layout.yaxis.ticktext) == 9
    peaks = [t for t in fig.data if t.name and t.name.startswith("peak")]
    assert len(peaks) == 3 and sum(bool(t.visible) for t in peaks) == 1
    assert any(t.name == "device memory 80.00 GiB" for t in fig.data)


def device_lines(result):
    from sim.outputs.report import device_overhead_bytes, reserved_of

    return DeviceLines(
        memory_bytes=result.profile.device.memory_bytes,
        reserved_of=lambda rank: reserved_of(result, rank),
        overhead_of=lambda rank: device_overhead_bytes(result, rank),
    )


def test_reserved_and_device_lines_are_the_reports_figures():
    """On a CUDA profile the memory row draws the allocator's reserved curve and reserved + context
    + NCCL; their highest points are the report's peak_reserved_bytes and required_bytes (what
    ``fits`` is judged on), and they sit at or above the allocated curve at every instant."""
    from sim.scenario.loader import load_scenario
    from sim.simulate import simulate

    result = simulate(load_scenario(SCENARIOS / "tiny.toml"))
    report = build_report(result)
    fig = timeline_figure(result.events, title="t", device=device_lines(result))
    reserved = [t for t in fig.data if t.name and t.name.startswith("reserved (")]
    whole = [t for t in fig.data if t.name and t.name.startswith("reserved + context + NCCL (")]
    assert len(reserved) == len(whole) == 1
    gib = 2**30
    assert max(reserved[0].y) * gib == pytest.approx(report.peak_reserved_bytes, rel=1e-12)
    assert max(whole[0].y) * gib == pytest.approx(report.required_bytes, rel=1e-12)
    assert report.device_overhead_bytes > 0
    # both lines span the step and are drawn for the rank whose allocated memory is drawn
    end_ms = step_time(result.events) * 1e3
    assert reserved[0].x[0] == 0 and reserved[0].x[-1] == pytest.approx(end_ms)
    assert reserved[0].visible is not False and whole[0].visible is not False


def test_the_active_line_is_the_reports_and_never_above_reserved():
    """The dotted active line is the caching allocator's active bytes at its own times: its highest
    point is the report's peak_active_bytes, and at every point the allocator reserves at least
    what it holds active. On llama-recipes' 70B FSDP1 row it rises above the allocated peak: the
    blocks the host freed that the device still uses (record_stream)."""
    from sim.scenario.loader import scenario_from_dict
    from sim.simulate import simulate
    from validation.published_memory import MEMORY_RUNS

    run = MEMORY_RUNS[-1]
    result = simulate(scenario_from_dict(run.tables, run.name, []))
    report = build_report(result)
    fig = timeline_figure(result.events, title="t", device=device_lines(result))
    active = [t for t in fig.data if t.name and t.name.startswith("active (")]
    reserved = [t for t in fig.data if t.name and t.name.startswith("reserved (")]
    assert len(active) == len(reserved) == 1
    gib = 2**30
    assert max(active[0].y) * gib == pytest.approx(report.peak_active_bytes, rel=1e-12)
    assert all(a <= r for a, r in zip(active[0].y, reserved[0].y, strict=True))
    assert report.peak_active_bytes > report.peak_memory_bytes


def test_no_reserved_lines_without_a_caching_allocator():
    """A CPU host (gloo) has no caching allocator: ``reserved_of`` gives None and nothing is drawn."""
    table = synthetic_table(2, 3)
    fig = timeline_figure(
        table, title="t", device=DeviceLines(memory_bytes=1 << 30, reserved_of=lambda r: None)
    )
    assert not [t for t in fig.data if t.name and t.name.startswith("reserved")]
    assert traces_named(fig, "device memory 1.00 GiB")


def test_single_simulated_rank_and_comparison():
    table = synthetic_table(1024, 3, simulate_all=False)
    other = synthetic_table(8, 3, seed=2)
    fig = timeline_figure(table, title="zero3", compare=("zero2", other))
    assert fig.layout.yaxis.ticktext[0] == "rank 0 (stands for all 1024) · compute"
    assert len(fig.layout.yaxis2.ticktext) == 8 * 3
    assert fig.layout.xaxis.matches == fig.layout.xaxis2.matches == "x3"  # one time axis
    assert not fig.layout.updatemenus
    assert any(t.name and t.name.startswith("total (zero2") for t in fig.data)


def test_memory_peak_is_the_largest_total():
    table = synthetic_table(2, 6)
    fig = timeline_figure(table, title="t", memory_rank=1)
    peak = next(t for t in fig.data if t.name == "peak (rank 1 (memory))")
    assert peak.visible
    stacked = [t for t in fig.data if t.name and t.name.endswith("(rank 1 (memory))") and t.stackgroup]
    totals = np.sum([np.asarray(t.y, dtype=float) for t in stacked], axis=0)
    assert peak.y[0] == pytest.approx(totals.max())
    assert peak.x[0] == pytest.approx(stacked[0].x[int(np.argmax(totals))])


@pytest.mark.parametrize(
    "sets",
    [[], ["checkpointing.mode=full", "training.grad_accum=2"], ["parallel.strategy=NO_SHARD"]],
    ids=["zero3", "ckpt-accum", "ddp"],
)
def test_report_and_timeline_name_the_same_peak(sets):
    """One memory curve: the timeline's peak marker is the report's peak, to the byte (in GiB)."""
    from sim.outputs.display import BYTES_PER_GIB
    from sim.scenario.loader import load_scenario
    from sim.simulate import simulate

    result = simulate(load_scenario(SCENARIOS / "tiny.toml", sets))
    report = build_report(result)
    fig = timeline_figure(result.events, title="t")
    (peak,) = [t for t in fig.data if t.name and t.name.startswith("peak (")]
    assert peak.y[0] * BYTES_PER_GIB == pytest.approx(report.peak_memory_bytes, rel=1e-12)
    stacked = [t for t in fig.data if t.type == "scatter" and t.stackgroup]
    totals = np.sum([np.asarray(t.y, dtype=float) for t in stacked], axis=0) * BYTES_PER_GIB
    assert totals.max() == pytest.approx(report.peak_memory_bytes, rel=1e-12)


def test_pareto_front():
    points = [(3.0, 1.0), (1.0, 3.0), (2.0, 2.0), (2.5, 2.5), (1.0, 4.0), (4.0, 1.0)]
    assert pareto_front(points) == [1, 2, 0]


def test_large_step_file_is_small(tmp_path):
    """256 distinct ranks × 80 layers: only representative ranks are drawn, so the file stays small."""
    table = synthetic_table(256, 80)
    path = tmp_path / "big.html"
    write_timeline_html(table, path, title="big", device=DeviceLines(memory_bytes=80 << 30))
    assert path.stat().st_size < 20e6


# --- in a real browser -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium found on $CHROMIUM or PATH (Debian: apt-get install -y chromium)")
    devtools = DevTools(binary)
    yield devtools
    devtools.close()


def colour_pixels(png: bytes, hex_colour: str, tol: int = 12) -> int:
    pixels = decode_png(png)[..., :3].astype(int)
    rgb = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)])
    return int(np.sum(np.all(np.abs(pixels - rgb) <= tol, axis=-1)))


def assert_rendered(report, graphs=1):
    assert report.errors == []
    assert report.render_ms > 0, "plotly did not render"
    assert report.facts["graphs"] == graphs and report.facts["mainSvg"] >= graphs
    pixels = decode_png(report.screenshot_png)
    assert pixels.std() > 10 and len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 50


def test_timeline_renders_in_chromium(browser, tmp_path):
    table = synthetic_table(4, 6)
    path = tmp_path / "step.html"
    write_timeline_html(
        table,
        path,
        title="step",
        device=DeviceLines(memory_bytes=80 << 30),
        compare=("other", synthetic_table(4, 6, seed=3)),
    )
    report = browser.load(path)
    assert_rendered(report)
    assert report.facts["glCanvases"] >= 1 and report.facts["updatemenus"] == 1
    # The WebGL bars really drew: forward and backward colours cover many pixels.
    assert colour_pixels(report.screenshot_png, KIND_COLOURS[OpKind.FORWARD]) > 2000
    assert colour_pixels(report.screenshot_png, KIND_COLOURS[OpKind.BACKWARD]) > 2000


def test_broken_page_is_caught(browser, tmp_path):
    """The harness can fail: a console error and a missing plot are reported."""
    path = tmp_path / "bad.html"
    path.write_text("<html><body><script>console.error('boom'); notDefined();</script></body></html>")
    report = browser.load(path, screenshot=False, timeout_s=1.0)
    assert report.render_ms == -1 and any("boom" in e for e in report.errors) and len(report.errors) == 2


def test_real_scenario_timeline_renders(browser, tmp_path):
    from sim.scenario.loader import load_scenario
    from sim.simulate import simulate

    result = simulate(load_scenario(SCENARIOS / "tiny.toml"))
    path = tmp_path / "tiny.html"
    write_timeline_html(result.events, path, title="tiny", device=device_lines(result))
    assert_rendered(browser.load(path))


def test_sweep_plots_render(browser, tmp_path):
    rows = [
        dict(
            name=f"{s}-{w}",
            strategy=s,
            wrap=w,
            step_time_s=t,
            peak_memory_bytes=m << 30,
            device_memory_bytes=80 << 30,
            breakdown_s=dict(compute=t * 0.7, exposed_comm=t * 0.2, idle=t * 0.1),
        )
        for s, w, t, m in [
            ("FULL_SHARD", "block", 0.5, 30),
            ("SHARD_GRAD_OP", "block", 0.4, 60),
            ("FULL_SHARD", "model", 0.7, 20),
            ("NO_SHARD", "model", 0.45, 90),
        ]
    ]
    path = tmp_path / "sweep.html"
    write_sweep_plots(rows, path)
    report = browser.load(path)
    assert_rendered(report)
    assert report.facts["traces"] == [4 + 1 + 3]  # 4 (strategy, wrap) groups, the front, 3 bars


def test_cluster_drawing_renders_in_chromium(browser, tmp_path):
    """``fsdpsim cluster show dgx-h100 --nodes 2 --plot``: the graph's page draws (nodes and links)."""
    from sim.cli.cluster import write_graph_html
    from sim.hardware.cluster import cluster_graph
    from sim.hardware.cluster_spec import load_cluster

    path = tmp_path / "cluster.html"
    write_graph_html(cluster_graph(load_cluster("dgx-h100"), 2), str(path), "dgx-h100, 2 nodes")
    assert_rendered(browser.load(path))
