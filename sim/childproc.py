"""``python -m MODULE ARGS`` as a child process whose torch-side imports are paid once per process.

The measuring children (``python -m hfmodel describe``, ``python -m validation.fake_memory``) each
import torch and transformers first: 5-7 s of CPU on a 2-core machine, several times what a
tiny model's measurement takes. So a process forks them from one server that imported those
packages once (``python -m hfmodel.forkserver``, started on the first request and ending with
this process): a sweep over described models, or the test suite, pays the imports once. Each
child is still a process of its own, as the measurements need (fake-mode and process-group
state stays behind in it), and gets the environment, working directory and arguments a
``subprocess.run([sys.executable, "-m", MODULE, *ARGS])`` would; its stdout and stderr are
captured. Unlike ``multiprocessing``'s forkserver, nothing of the caller's ``__main__`` is
re-imported in the child.

This module imports no torch: the server does, in its own process.
"""

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SERVER_MODULE = "hfmodel.forkserver"
_ROOT = Path(__file__).resolve().parent.parent  # where hfmodel lives beside sim


@dataclass(frozen=True, kw_only=True)
class ChildResult:
    returncode: int
    stdout: str
    stderr: str


class ChildTimeout(Exception):
    """The child ran past its time limit (it has been killed)."""


class _Server:
    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
        self.owner = os.getpid()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", SERVER_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self._pending = b""  # what was read of the replies beyond the last whole line

    @property
    def usable(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def _reply(self, timeout_s: float | None) -> dict[str, object] | None:
        """The server's next reply line; None when none came within ``timeout_s``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            if deadline is not None:
                ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise ConnectionError("the fork server ended")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        reply: dict[str, object] = json.loads(line)
        return reply

    def send(self, request: dict[str, object]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def start(self, request: dict[str, object]) -> int:
        """Send ``request``; the forked child's pid once it has started."""
        self.send(request)
        return self.started()

    def started(self) -> int:
        """The pid of the child the last request forked, once the server has forked it."""
        started = self._reply(None)
        assert started is not None
        pid = started["pid"]
        assert isinstance(pid, int)
        return pid

    def ended(self, timeout_s: float | None) -> int | None:
        """The running child's exit code once it has ended; None if it has not within ``timeout_s``."""
        done = self._reply(timeout_s)
        if done is None:
            return None
        code = done["returncode"]
        assert isinstance(code, int)
        return code

    def run(self, request: dict[str, object], timeout_s: float) -> int:
        pid = self.start(request)
        code = self.ended(timeout_s)
        if code is None:
            os.kill(pid, signal.SIGKILL)
            self.ended(None)
            raise ChildTimeout
        return code


_idle: list[_Server] = []  # servers between requests: one per caller running at once
_lock = threading.Lock()


def _take() -> _Server:
    with _lock:
        while _idle:
            server = _idle.pop()
            if server.usable:
                return server
    return _Server()


def run_module(
    module: str,
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str | Path,
    timeout_s: float,
    preload: tuple[str, ...] = (),
) -> ChildResult:
    """``python -m module *argv`` with ``env`` in ``cwd``, forked from a preloaded server; raises
    ChildTimeout (after killing the child) when it runs past ``timeout_s``. ``preload``: modules
    the child imports that the server should import first, once for all its later children (a
    module's own heavy imports). Threads may call it at once: each gets a server of its own."""
    with tempfile.TemporaryDirectory(prefix="fsdpsim-child-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request: dict[str, object] = {
            "module": module,
            "argv": list(argv),
            "env": dict(env),
            "cwd": str(cwd),
            "stdout": str(out),
            "stderr": str(err),
            "preload": list(preload),
        }
        try:
            code = _served(_take(), request, module, timeout_s)
        except OSError:  # the server died (killed from outside): one fresh try
            try:
                code = _served(_Server(), request, module, timeout_s)
            except OSError as e:  # a failed child, which callers report in one line
                return ChildResult(returncode=1, stdout="", stderr=f"python -m {SERVER_MODULE} ended: {e}\n")
        return ChildResult(returncode=code, stdout=_read(out), stderr=_read(err))


def _read(path: Path) -> str:
    """A child's captured output (empty when it never wrote any)."""
    return path.read_text(errors="replace") if path.exists() else ""


def _served(server: _Server, request: dict[str, object], module: str, timeout_s: float) -> int:
    """The request's exit code; the server back among the idle ones once it has answered (after a
    timeout too: it has reaped the killed child and serves on)."""
    try:
        code = server.run(request, timeout_s)
    except ChildTimeout:
        with _lock:
            _idle.append(server)
        raise ChildTimeout(f"python -m {module} ran past {timeout_s:.0f} s") from None
    with _lock:
        _idle.append(server)
    return code


class RunningChild:
    """A child started by ``start_module``, running beside the caller until it ends or is killed."""

    def __init__(self, request: dict[str, object], folder: tempfile.TemporaryDirectory[str]):
        self._folder = folder
        self._server = _take()
        self._server.send(request)  # not waiting: servers started for several children import at once
        self._pid: int | None = None
        self.returncode: int | None = None
        self._result: ChildResult | None = None

    @property
    def pid(self) -> int:
        """The child's pid, once its server has forked it (a server just started imports first)."""
        if self._pid is None:
            self._pid = self._server.started()
        return self._pid

    def poll(self, timeout_s: float | None = 0.0) -> int | None:
        """The exit code once the child has ended (waiting up to ``timeout_s``), else None."""
        if self.returncode is None:
            _ = self.pid  # the server's "started" reply comes before its "ended" one
            self.returncode = self._server.ended(timeout_s)
            if self.returncode is not None:
                with _lock:
                    _idle.append(self._server)
        return self.returncode

    def kill(self) -> None:
        """End the child now (SIGKILL) and reap it; its server serves on."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.poll(None)

    def result(self) -> ChildResult:
        """Its exit code and captured output (killed first if still running)."""
        if self._result is None:
            self.kill()
            folder = Path(self._folder.name)
            self._result = ChildResult(
                returncode=self.returncode or 0,
                stdout=_read(folder / "stdout"),
                stderr=_read(folder / "stderr"),
            )
            self._folder.cleanup()
        return self._result


def start_module(
    module: str, argv: list[str], *, env: dict[str, str], cwd: str | Path, preload: tuple[str, ...] = ()
) -> RunningChild:
    """``python -m module *argv`` forked from a preloaded server (as ``run_module``), returned while
    it runs: the ranks of a real ``torch.distributed`` run start so, each from a server of its own,
    and a process that runs many of them (the test suite) pays their imports once per server."""
    folder = tempfile.TemporaryDirectory(prefix="fsdpsim-child-")
    request: dict[str, object] = {
        "module": module,
        "argv": list(argv),
        "env": dict(env),
        "cwd": str(cwd),
        "stdout": str(Path(folder.name) / "stdout"),
        "stderr": str(Path(folder.name) / "stderr"),
        "preload": list(preload),
    }
    return RunningChild(request, folder)
