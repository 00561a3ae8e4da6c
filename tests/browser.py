"""Test helpers for the timeline outputs: a headless Chromium driven over the DevTools protocol, a PNG
decoder for its screenshots, and synthetic event tables of any size.

Chromium is found on ``$CHROMIUM`` or ``PATH`` (Debian: ``apt-get install -y chromium``). It is
driven with ``--remote-debugging-pipe`` (DevTools messages, NUL-terminated JSON, on fds 3 and 4), so
no websocket package is needed. Only the standard library and numpy are used.
"""

import base64
import contextlib
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sim.core.events import EventTable, MemoryCategory, MemoryRecord, OpKind, OpRecord, Stream

BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    # WebGL (plotly's Scattergl) through the software rasteriser; headless has no GPU.
    "--use-angle=swiftshader",
    "--enable-unsafe-swiftshader",
)


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary that answers ``--version``, or None."""
    candidates = [os.environ.get("CHROMIUM", "")] + [shutil.which(n) or "" for n in BROWSER_NAMES]
    for path in candidates:
        if not path:
            continue
        try:
            subprocess.run([path, "--version"], capture_output=True, timeout=30, check=True)
        except (OSError, subprocess.SubprocessError):
            continue
        return path
    return None


# The page is ready when plotly has laid out every graph div and drawn its SVG layers.
WAIT_FOR_PLOT_JS = """
new Promise((resolve) => {
  const t0 = performance.now();
  (function poll() {
    const divs = [...document.querySelectorAll('.plotly-graph-div')];
    const ready = divs.length > 0 && divs.every((d) => d._fullLayout && d.querySelector('.main-svg'));
    if (ready) resolve(performance.now());
    else if (performance.now() - t0 > TIMEOUT_MS) resolve(-1);
    else setTimeout(poll, 10);
  })();
})
"""

PAGE_FACTS_JS = """
JSON.stringify({
  graphs: document.querySelectorAll('.plotly-graph-div').length,
  mainSvg: document.querySelectorAll('.main-svg').length,
  glCanvases: document.querySelectorAll('canvas.gl-canvas, .gl-container canvas').length,
  traces: [...document.querySelectorAll('.plotly-graph-div')].map((d) => (d.data || []).length),
  updatemenus: document.querySelectorAll('.updatemenu-container').length,
  title: (document.querySelector('.gtitle') || {}).textContent || '',
})
"""


@dataclass
class PageReport:
    """What a page load showed: console errors, uncaught exceptions, DOM facts, render time, screenshot."""

    errors: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    render_ms: float = -1.0
    screenshot_png: bytes = b""


class DevTools:
    """A headless Chromium and a DevTools-protocol session over ``--remote-debugging-pipe``."""

    def __init__(self, binary: str, window: tuple[int, int] = (1400, 1000)) -> None:
        self._profile = tempfile.mkdtemp(prefix="fsdpsim-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        args = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={self._profile}", "--remote-debugging-pipe"]
        args += [f"--window-size={window[0]},{window[1]}", "about:blank"]

        def wire_fds() -> None:  # runs in the child: DevTools reads fd 3, writes fd 4
            read_end, write_end = os.dup(to_child_r), os.dup(from_child_w)
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)

        self.proc = subprocess.Popen(
            args,
            preexec_fn=wire_fds,
            pass_fds=(3, 4),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict:
        """Send one command and return its result (events that arrive meanwhile are kept)."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def close(self) -> None:
        """Stop the browser and remove its profile."""
        with contextlib.suppress(RuntimeError, OSError):
            self.send("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_child)
        os.close(self._from_child)
        shutil.rmtree(self._profile, ignore_errors=True)

    def load(self, html: Path, *, screenshot: bool = True, timeout_s: float = 30.0) -> PageReport:
        """Open ``html`` in a new tab, wait (up to ``timeout_s``) for plotly to render, and report.

        ``render_ms`` is the page's ``performance.now()`` when every plot had drawn (ms since the
        navigation started), or -1 if that did not happen in time.
        """
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.send(f"{domain}.enable", session=session)
        self.events.clear()
        self.send("Page.navigate", {"url": html.resolve().as_uri()}, session=session)
        done = self.send(
            "Runtime.evaluate",
            {
                "expression": WAIT_FOR_PLOT_JS.replace("TIMEOUT_MS", str(int(timeout_s * 1000))),
                "awaitPromise": True,
                "returnByValue": True,
            },
            session=session,
        )
        report = PageReport(render_ms=float(done["result"]["value"]))
        facts = self.send(
            "Runtime.evaluate", {"expression": PAGE_FACTS_JS, "returnByValue": True}, session=session
        )
        report.facts = json.loads(facts["result"]["value"])
        if screenshot:
            shot = self.send("Page.captureScreenshot", {"format": "png"}, session=session)
            report.screenshot_png = base64.b64decode(shot["data"])
        time.sleep(0.2)  # let late console messages arrive
        self.send("Runtime.evaluate", {"expression": "1"}, session=session)
        report.errors = console_errors(self.events)
        self.send("Target.closeTarget", {"targetId": target})
        return report


def console_errors(events: list[dict[str, Any]]) -> list[str]:
    """Console errors, uncaught exceptions and error log entries among DevTools events."""
    errors = []
    for ev in events:
        method, params = ev.get("method"), ev.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            errors.append(
                " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            )
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            errors.append(details.get("exception", {}).get("description") or details.get("text", "exception"))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            errors.append(params["entry"].get("text", ""))
    return errors


def decode_png(data: bytes) -> np.ndarray:
    """Pixels (height × width × channels, uint8) of an 8-bit non-interlaced RGB/RGBA PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    channels = {2: 3, 6: 4}.get(color)
    if depth != 8 or channels is None or interlace:
        raise ValueError(f"unsupported PNG (depth {depth}, colour type {color}, interlace {interlace})")
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + width * channels)
    return unfilter(raw, width, channels).reshape(height, width, channels)


def unfilter(raw: np.ndarray, width: int, bpp: int) -> np.ndarray:
    """Undo PNG's per-row filters (None, Sub, Up, Average, Paeth)."""
    out = np.zeros((raw.shape[0], width * bpp), dtype=np.uint8)
    prior = np.zeros(width * bpp, dtype=np.int32)
    for y, row in enumerate(raw):
        kind, line = int(row[0]), row[1:].astype(np.int32)
        if kind == 0:
            cur = line
        elif kind == 1:
            cur = np.cumsum(line.reshape(width, bpp), axis=0).reshape(-1) & 0xFF
        elif kind == 2:
            cur = (line + prior) & 0xFF
        else:
            cur = _unfilter_sequential(kind, line, prior, bpp)
        out[y] = cur
        prior = cur.astype(np.int32)
    return out


def _unfilter_sequential(kind: int, line: np.ndarray, prior: np.ndarray, bpp: int) -> np.ndarray:
    """Average (3) and Paeth (4) filters, which depend on the pixel just decoded."""
    cur = [0] * len(line)
    src, up = line.tolist(), prior.tolist()
    for i in range(len(src)):
        left = cur[i - bpp] if i >= bpp else 0
        if kind == 3:
            cur[i] = (src[i] + (left + up[i]) // 2) & 0xFF
            continue
        upleft = up[i - bpp] if i >= bpp else 0
        p = left + up[i] - upleft
        pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - upleft)
        pred = left if pa <= pb and pa <= pc else (up[i] if pb <= pc else upleft)
        cur[i] = (src[i] + pred) & 0xFF
    return np.array(cur, dtype=np.int32)


def synthetic_table(world_size: int, layers: int, *, simulate_all: bool = True, seed: int = 0) -> EventTable:
    """An FSDP-like step built by a loop: per layer an all-gather, a copy-out and forward compute; in
    backward an all-gather, a copy-out, backward compute and a reduce-scatter; then the optimizer.

    Ranks run at slightly different speeds (rank 1 is 20 % slower), so collectives wait for the
    slowest rank; with ``simulate_all=False`` only rank 0 is recorded and stands for all.
    """
    rng = np.random.default_rng(seed)
    ranks = list(range(world_size)) if simulate_all else [0]
    speed = 1.0 + 0.05 * rng.random(len(ranks))
    if len(ranks) > 1:
        speed[1] *= 1.2
    b = _Builder(ranks, speed)
    for layer in range(layers):
        b.layer(f"layers.{layer}", "forward", OpKind.FORWARD, 1.0e-3, with_rs=False)
    for layer in reversed(range(layers)):
        b.layer(f"layers.{layer}", "backward", OpKind.BACKWARD, 2.0e-3, with_rs=True)
    b.optimizer(0.5e-3 * layers / 8)
    # the engine records the ledger in time order, which the memory curve relies on; the loop above
    # writes a layer's records before the next layer's all-gather, which may start earlier
    memory = tuple(sorted(b.memory, key=lambda m: m.time_s))  # stable: same-time entries keep their order
    return EventTable(world_size=world_size, simulated_ranks=tuple(ranks), ops=tuple(b.ops), memory=memory)


class _Builder:
    """Vectorised over ranks: every op is issued on all ranks at once."""

    AG_S, COPY_S, RS_S = 1.3e-3, 0.1e-3, 1.6e-3
    PARAM_BYTES, ACT_BYTES = 400 << 20, 300 << 20

    def __init__(self, ranks: list[int], speed: np.ndarray) -> None:
        self.ranks, self.speed = ranks, speed
        self.compute = np.zeros(len(ranks))
        self.streams = {Stream.ALL_GATHER: np.zeros(len(ranks)), Stream.REDUCE_SCATTER: np.zeros(len(ranks))}
        self.ops: list[OpRecord] = []
        self.memory: list[MemoryRecord] = []
        self.last_compute_start = np.zeros(len(ranks))
        for r in ranks:
            self.memory.append(
                MemoryRecord(
                    rank=r,
                    time_s=0.0,
                    category=MemoryCategory.PARAMS,
                    delta_bytes=self.PARAM_BYTES // 8,
                    label="shards",
                )
            )
            self.memory.append(
                MemoryRecord(
                    rank=r,
                    time_s=0.0,
                    category=MemoryCategory.OPTIMIZER,
                    delta_bytes=self.PARAM_BYTES // 4,
                    label="adam",
                )
            )

    def emit(self, stream, kind, name, unit, ready, start, end, nbytes=0) -> None:
        group = len(self.ranks) if kind.is_collective else 1
        for i, r in enumerate(self.ranks):
            op = OpRecord(
                rank=r,
                op_id=len(self.ops),
                stream=stream,
                kind=kind,
                name=name,
                unit=unit,
                microbatch=0,
                ready_s=float(ready[i]),
                start_s=float(start[i]),
                end_s=float(end[i]),
                bytes=nbytes,
                group_size=group,
            )
            self.ops.append(op)

    def collective(
        self, stream: Stream, kind: OpKind, unit: str, ready: np.ndarray, dur: float
    ) -> np.ndarray:
        ready = np.maximum(ready, self.streams[stream])
        start = np.full_like(ready, ready.max())  # rendezvous: starts when the slowest rank arrives
        end = start + dur
        self.emit(stream, kind, f"{kind} {unit}", unit, ready, start, end, self.PARAM_BYTES)
        self.streams[stream] = end
        return end

    def compute_op(self, kind: OpKind, name: str, unit: str, after: np.ndarray, dur: float) -> np.ndarray:
        start = np.maximum(self.compute, after)
        end = start + dur * self.speed
        self.emit(Stream.COMPUTE, kind, name, unit, start, start, end)
        self.last_compute_start, self.compute = start, end
        return end

    def layer(self, unit: str, phase: str, kind: OpKind, dur: float, *, with_rs: bool) -> None:
        ag_end = self.collective(
            Stream.ALL_GATHER, OpKind.ALL_GATHER, unit, self.last_compute_start, self.AG_S
        )
        self._mem(ag_end - self.AG_S, MemoryCategory.COMM_BUFFERS, self.PARAM_BYTES, f"{unit} unsharded")
        self.compute_op(OpKind.COPY, f"copy-out {unit}", unit, ag_end, self.COPY_S)
        end = self.compute_op(kind, f"{phase} {unit}", unit, self.compute, dur)
        self._mem(end, MemoryCategory.COMM_BUFFERS, -self.PARAM_BYTES, f"{unit} resharded")
        self._mem(end, MemoryCategory.ACTIVATIONS, -self.ACT_BYTES if with_rs else self.ACT_BYTES, unit)
        if with_rs:
            rs_end = self.collective(Stream.REDUCE_SCATTER, OpKind.REDUCE_SCATTER, unit, end, self.RS_S)
            self._mem(rs_end, MemoryCategory.GRADS, self.PARAM_BYTES // 8, f"{unit} grad shard")

    def optimizer(self, dur: float) -> None:
        self.compute_op(
            OpKind.OPTIMIZER, "optimizer.step", "optimizer", self.streams[Stream.REDUCE_SCATTER], dur
        )

    def _mem(self, times: np.ndarray, category: MemoryCategory, delta: int, label: str) -> None:
        for i, r in enumerate(self.ranks):
            self.memory.append(
                MemoryRecord(
                    rank=r, time_s=float(times[i]), category=category, delta_bytes=delta, label=label
                )
            )
