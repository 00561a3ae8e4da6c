"""``python -m calibrate comm|compute ...`` (also under ``torchrun -m calibrate``)."""

import sys

from calibrate.cli import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
