"""Run all benchmarks in this folder (``python -m bench [NAME ...]``)."""

import importlib
import pkgutil
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    names = sorted(
        m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.name.startswith("bench_")
    )
    chosen = [n for n in names if not argv or any(a in n for a in argv)]
    for name in chosen:
        print(f"== {name} ==", flush=True)
        importlib.import_module(f"bench.{name}").main()
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
