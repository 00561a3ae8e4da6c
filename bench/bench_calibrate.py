"""Calibration on this CPU: wall time of the default ``calibrate comm`` sweep, and how well the
α–β fit describes the measured points.

Target (calibration issue): the default CPU sweep (2 gloo ranks, 1 KiB–64 MiB ×4, fp32 and bf16,
three collectives) under 2 minutes. The residual is (fit − median) / median per point; the
simulator interpolates the measured points inside the range and uses the fit only outside it.
Run: ``python -m bench calibrate`` (or ``python bench/bench_calibrate.py``).
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 120.0


def _run(out: Path) -> float:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "calibrate", "comm", "--nproc", "2", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"calibrate comm failed: {proc.stderr.strip().splitlines()[-1]}")
    return wall


def _residuals(curve: dict) -> list[float]:  # type: ignore[type-arg]
    from calibrate.busbw import bus_factor

    fit, f = curve["fit"], bus_factor(curve["collective"], curve["group_size"])
    return [
        (fit["latency_s"] + p["bytes"] * f / fit["bus_bw_Bps"] - p["time_s"]) / p["time_s"]
        for p in curve["points"]
    ]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cpu.json"
        wall = _run(out)
        doc = json.loads(out.read_text())
    src = doc["source"]
    verdict = "OK" if wall < TARGET_S else "OVER TARGET"
    print(
        f"default CPU sweep: {wall:.1f} s end to end ({src['wall_s']:.1f} s measuring), target < {TARGET_S:.0f} s: {verdict}"
    )
    print(
        f"  {src['world_size']} ranks, {src['threads']} thread(s) each, {src['cpu_model']}, torch {src['torch_version']}"
    )
    print(
        f"{'collective':>14} {'dtype':>5} {'pts':>3} {'latency us':>10} {'busbw GB/s':>10} {'max busbw':>9} {'rms res':>8} {'max res':>8} {'spread':>7}"
    )
    for c in doc["collectives"]:
        res = _residuals(c)
        rms = (sum(r * r for r in res) / len(res)) ** 0.5
        spread = max(p["spread"] for p in c["points"])
        print(
            f"{c['collective']:>14} {c['dtype']:>5} {len(res):>3} {c['fit']['latency_s'] * 1e6:>10.1f} "
            f"{c['fit']['bus_bw_Bps'] / 1e9:>10.3f} {max(p['busbw_Bps'] for p in c['points']) / 1e9:>9.3f} "
            f"{rms:>8.1%} {max(abs(r) for r in res):>8.1%} {spread:>7.1f}"
        )
    dev = doc["device"]
    flops = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in dev["peak_flops"].items())
    print(
        f"device: {flops}; copy {dev['hbm_bandwidth_Bps'] / 1e9:.1f} GB/s; launch {doc['backend']['collective_launch_s'] * 1e6:.0f} us"
    )


if __name__ == "__main__":
    main()
