"""A per-rank deadline: a collective that does not finish in time ends the process with one line.

A dead or hung peer otherwise leaves the survivors blocked inside gloo or NCCL. The watchdog
runs in a daemon thread; when an armed deadline passes it prints a one-line error to stderr and
calls ``os._exit`` (no atexit handlers, so nothing half-written is flushed). Profiles are written
only after every measurement finished, so an exit here leaves no profile behind.
"""

import os
import sys
import threading
import time

EXIT_TIMEOUT = 3


class Watchdog:
    def __init__(self, rank: int):
        self._rank = rank
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._label = ""
        self._timeout_s = 0.0
        threading.Thread(target=self._run, name="calibrate-watchdog", daemon=True).start()

    def arm(self, label: str, timeout_s: float) -> None:
        with self._cond:
            self._label, self._timeout_s = label, timeout_s
            self._deadline = time.monotonic() + timeout_s
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(timeout=left)
                    continue
                sys.stderr.write(
                    f"calibrate: error: rank {self._rank}: {self._label} did not finish within "
                    f"{self._timeout_s:g} s (a rank died or hangs); no profile written\n"
                )
                sys.stderr.flush()
                os._exit(EXIT_TIMEOUT)
