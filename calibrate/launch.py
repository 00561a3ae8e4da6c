"""``--nproc N``: run a calibration on this machine without torchrun.

The launcher starts N copies of ``python -m calibrate ...`` with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT) and
watches them. It imports no torch. When a worker fails, the others are stopped and the launcher
reports which rank failed; workers write their profile only after every measurement, so a failed
run leaves no profile behind. Like torchrun, it sets OMP_NUM_THREADS (cores / N) unless set.
"""

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

WORKER_ENV = "FSDPSIM_CALIBRATE_WORKER"
COMMAND_ENV = "FSDPSIM_CALIBRATE_COMMAND"
GRACE_S = 3.0


@dataclass(frozen=True, kw_only=True)
class LaunchResult:
    ok: bool
    message: str


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def free_port() -> int:
    """A free port for the rendezvous, below the ephemeral range: a port the kernel hands out
    (``bind(0)``) is free only until someone else's connection takes it, and gloo's own
    connections (another job's, on a shared machine) take ephemeral ports by the hundred between
    this call and rank 0's listen."""
    low, _ = _ephemeral_range()
    candidates = list(range(max(1024, low - 12288), low))
    random.shuffle(candidates)
    for port in candidates[:64]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loopback_ifname() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), None)


def worker_env(rank: int, nproc: int, port: int, command: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        # what DeepSpeed's own launcher exports: without it DeepSpeed's CPU accelerator forks
        # `numactl --hardware` on every device_count() call, three times a ZeRO-3 step here
        LOCAL_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **{WORKER_ENV: "1", COMMAND_ENV: command},
    )
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    lo = _loopback_ifname()
    if lo and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = lo
    return env


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def describe(rank: int, code: int) -> str:
    if code < 0:
        return f"rank {rank} was killed by signal {-code}"
    return f"rank {rank} exited with code {code}"


class Polled(Protocol):
    """A running rank: ``subprocess.Popen``, or ``sim.childproc.RunningChild`` (a forked one)."""

    def poll(self) -> int | None: ...


def wait_all(procs: Sequence[Polled], deadline: float | None = None) -> list[tuple[int, int]]:
    """Poll the ranks until all exit 0 (returns []) or some fail (returns their (rank, code)).

    Raises TimeoutError once ``deadline`` (a ``time.monotonic()`` value) passes; stopping the
    ranks is the caller's job.
    """
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c is not None and c != 0]
        if failed or all(c == 0 for c in codes):
            return failed
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.05)


def launch(argv: list[str], nproc: int, command: str) -> LaunchResult:
    """Run ``python -m calibrate *argv`` as ``nproc`` ranks; wait for all, stop all on a failure.

    ``command`` is the user's command line, recorded in the profile by the workers.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "calibrate", *argv]
    procs = [subprocess.Popen(cmd, env=worker_env(r, nproc, port, command)) for r in range(nproc)]
    try:
        failed = wait_all(procs)
        if failed:
            stop(procs)
            what = ", ".join(describe(r, c) for r, c in failed)
            return LaunchResult(ok=False, message=f"{what}; no profile written")
        return LaunchResult(ok=True, message="")
    except KeyboardInterrupt:
        stop(procs)
        return LaunchResult(ok=False, message="interrupted; no profile written")
