"""fsdp-sim: a discrete-event simulator of PyTorch FSDP communication and memory.

The core (this package) never imports torch; calibration and validation live in ``calibrate``.
"""

__version__ = "0.1.0"
