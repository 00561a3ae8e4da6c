"""Benchmark: a 1,024-rank, 80-layer step written as a plotly timeline and a Chrome trace.

Checks the file-size (< 20 MB) and open-time (< 5 s, from navigation to every plot drawn, measured
inside headless Chromium) targets. Run: ``.venv/bin/python bench/bench_timeline.py [--ranks N --layers L]``.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from browser import DevTools, find_chromium, synthetic_table  # noqa: E402

from sim.outputs.chrome_trace import write_chrome_trace, write_chrome_trace_per_rank  # noqa: E402
from sim.outputs.timeline import DeviceLines, write_timeline_html  # noqa: E402

MAX_HTML_BYTES = 20e6
MAX_OPEN_S = 5.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--opens", type=int, default=3, help="times to open the HTML (the best counts)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    table = synthetic_table(args.ranks, args.layers)
    print(
        f"table: {args.ranks} ranks x {args.layers} layers, {len(table.ops):,} ops, "
        f"{len(table.memory):,} memory records, built in {time.perf_counter() - t0:.1f} s"
    )
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "step.html"
        t0 = time.perf_counter()
        write_timeline_html(table, html, title="bench", device=DeviceLines(memory_bytes=80 << 30))
        size = html.stat().st_size
        print(f"timeline: {size / 1e6:.2f} MB written in {time.perf_counter() - t0:.1f} s")
        ok &= size < MAX_HTML_BYTES
        t0 = time.perf_counter()
        write_chrome_trace(table, Path(tmp) / "step.json", ranks=[0, 1, 2])
        paths = write_chrome_trace_per_rank(table, Path(tmp) / "per_rank", ranks=range(8))
        print(
            f"trace: 3 ranks {(Path(tmp) / 'step.json').stat().st_size / 1e6:.2f} MB, "
            f"8 per-rank files {sum(p.stat().st_size for p in paths) / 1e6:.2f} MB, {time.perf_counter() - t0:.1f} s"
        )
        binary = find_chromium()
        if binary is None:
            print("open time: skipped, no Chromium found")
            return 0 if ok else 1
        devtools = DevTools(binary)
        try:
            times = []
            for _ in range(args.opens):
                report = devtools.load(html, screenshot=False)
                times.append(report.render_ms / 1e3)
                ok &= not report.errors and report.render_ms > 0
            print(
                f"open time (navigation to plot drawn): best {min(times):.2f} s, all {[round(t, 2) for t in times]}"
            )
            ok &= min(times) < MAX_OPEN_S
        finally:
            devtools.close()
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
