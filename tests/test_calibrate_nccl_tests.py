"""Parsing stored nccl-tests outputs (text table and -J JSON) into curves and a profile."""

import json
from pathlib import Path

import pytest

from calibrate.busbw import bus_factor
from calibrate.cli import main
from calibrate.nccl_tests import collective_from_name, curves_from_runs, parse_file
from sim.errors import UserError
from sim.hardware.registry import load_profile

DATA = Path(__file__).parent / "data" / "nccl_tests"
AG_TEXT = DATA / "all_gather_perf_8xh100.txt"
AR_TEXT = DATA / "all_reduce_perf_2x8xh100.txt"
RS_JSON = DATA / "reduce_scatter_perf_2x8xh100_bf16.json"


def test_current_text_format() -> None:
    run = parse_file(AG_TEXT)
    assert (run.collective, run.ranks, run.hosts) == ("all_gather", 8, ("dgx-h100-07",))
    assert run.device_name == "NVIDIA H100 80GB HBM3"
    assert run.nccl_version == "2.26.2"
    assert len(run.rows) == 28 and run.rows[-1].size == 1 << 30
    assert all(r.iters == 20 and r.wrong == 0 for r in run.rows)
    assert run.rows[-1].time_us == 2624.62  # the out-of-place column for all-gather


def test_older_text_format_names_the_test_by_its_file() -> None:
    run = parse_file(AR_TEXT)
    assert (run.collective, run.ranks, run.hosts) == ("all_reduce", 16, ("node-a01", "node-a02"))
    assert run.rows[-1].time_us == 49082.1  # the in-place column for all-reduce


def test_json_format() -> None:
    run = parse_file(RS_JSON)
    assert (run.collective, run.ranks, run.nccl_version) == ("reduce_scatter", 16, "2.27.3")
    assert run.rows[0].size == 1024 and run.rows[0].dtype_name == "bfloat16"
    doc = json.loads(RS_JSON.read_text())
    assert run.rows[-1].time_us == doc["results"][-1]["out_of_place"]["time"]
    # time_us is nccl-tests' average (a mean, like calibrate comm's time_s); without -I per-iteration
    # statistics the median is that average too
    assert "out_of_place_per_iter" not in doc["results"][-1]
    assert run.rows[-1].median_us == run.rows[-1].time_us


@pytest.mark.parametrize("path", [AG_TEXT, AR_TEXT])
def test_printed_bandwidths_follow_from_the_printed_times(path: Path) -> None:
    """The stored files obey nccl-tests' algbw = S/t and busbw = algbw * factor, like real ones."""
    run = parse_file(path)
    n = run.ranks
    for line in path.read_text().splitlines():
        tok = line.split()
        if line.startswith("#") or len(tok) != 13 or int(tok[0]) == 0:
            continue
        size, t_us, alg, bus = int(tok[0]), float(tok[5]), float(tok[6]), float(tok[7])
        decimals = len(tok[5].split(".")[1]) if "." in tok[5] else 0
        time_rounding = 0.5 * 10**-decimals / t_us  # relative error of the printed time
        assert size / t_us / 1e3 == pytest.approx(alg, abs=0.005 + alg * time_rounding)
        assert alg * bus_factor(run.collective, n) == pytest.approx(bus, abs=0.01 + alg * 0.001)


def test_curves_skip_empty_sizes_and_recover_the_generator() -> None:
    curves, skipped = curves_from_runs([parse_file(p) for p in (AG_TEXT, AR_TEXT, RS_JSON)])
    assert skipped == []
    by = {c.key.collective: c for c in curves}
    ag, ar, rs = by["all_gather"], by["all_reduce"], by["reduce_scatter"]
    assert (ag.key.group_size, ag.key.dtype, ag.key.spans_nodes) == (8, "fp32", False)
    assert (rs.key.group_size, rs.key.dtype, rs.key.spans_nodes) == (16, "bf16", True)
    assert all(p.bytes > 0 for p in ag.points) and len(ag.points) == 24
    # Generator parameters (tests/data/nccl_tests/README.md), ±3 % noise.
    for curve, alpha, bw in ((ag, 14e-6, 360e9), (ar, 45e-6, 42e9), (rs, 40e-6, 45e9)):
        assert curve.fit.latency_s == pytest.approx(alpha, rel=0.1)
        assert curve.fit.bus_bw_Bps == pytest.approx(bw, rel=0.05)


def test_import_writes_a_profile_the_simulator_loads(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    argv = ["comm", "--from-nccl-tests", str(AG_TEXT), str(AR_TEXT), str(RS_JSON), "--base", "h100-sxm"]
    assert main([*argv, "--out", str(out)]) == 0
    prof = load_profile(str(out))
    assert prof.calibrated and len(prof.collectives) == 3
    assert prof.intra_node.bus_bw_Bps == pytest.approx(360e9, rel=0.05)
    assert prof.curve("all_reduce", 16, "fp32", True) is not None
    assert prof.device.name.startswith("NVIDIA H100")  # from the base profile
    doc = json.loads(out.read_text())
    assert doc["source"]["nodes"] == 2 and doc["source"]["nccl_version"] == "2.26.2"
    # NCCL's model fitted to the imported curves on the base profile's cluster: the synthesized
    # 42-45 GB/s across two H100 nodes (one NIC's worth, not eight) shows as a low inter factor
    assert prof.node.cluster == "dgx-h100"
    assert prof.nccl_fit.inter_bw_factor < 0.2 < prof.nccl_fit.intra_bw_factor
    assert "1 node(s) x 8, 2 node(s) x 8" in prof.nccl_fit.source


def test_import_without_a_device_source_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["comm", "--from-nccl-tests", str(AG_TEXT), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("calibrate: error: nccl-tests outputs carry no device data") and "\n" not in err
    assert not (tmp_path / "p.json").exists()


def test_a_file_without_a_result_table_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "all_gather_perf.txt"
    bad.write_text("# nThread 1 nGpus 1\n#\n")
    with pytest.raises(UserError, match="no nccl-tests result table"):
        parse_file(bad)


def test_a_text_table_of_unknown_collective_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "mystery.txt"
    bad.write_text(AR_TEXT.read_text())
    with pytest.raises(UserError, match="cannot tell which collective"):
        parse_file(bad)


def test_broken_json_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "rs.json"
    bad.write_text(RS_JSON.read_text()[:500])
    with pytest.raises(UserError, match="not an nccl-tests -J JSON output"):
        parse_file(bad)


def test_binary_names() -> None:
    assert collective_from_name("/opt/nccl-tests/build/all_gather_perf_mpi") == "all_gather"
    assert collective_from_name("reduce_scatter_perf") == "reduce_scatter"
    assert collective_from_name("alltoall_perf") == "all_to_all"  # expert parallelism's exchange
    assert collective_from_name("sendrecv_perf") is None
