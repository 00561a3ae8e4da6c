"""Running sweep points: one worker function, chunked over a ``concurrent.futures`` executor.

A *point* is a tuple of ``(section.key, value)`` pairs laid over a base scenario (the TOML tables
as plain dicts). Workers receive the base and a chunk of compact points, build and simulate each
scenario themselves, and return a small dict of figures per point (never a ``Scenario`` or the
whole report), so pickling stays a few hundred bytes a point.

Executors: the local cores (``ProcessPoolExecutor``; ``jobs=1`` runs in this process), Ray
(``ray`` extra; ``RAY_ADDRESS`` or a local Ray) and Dask (``dask`` extra;
``distributed.Client(address).get_executor()``). Ray and Dask are imported only when chosen.
"""

import concurrent.futures as cf
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sim.errors import UserError
from sim.outputs.report import build_report
from sim.scenario.loader import scenario_from_dict
from sim.simulate import simulate

Point = tuple[tuple[str, Any], ...]
"""One sweep point: ``(("training.micro_batch", 2), ("parallel.strategy", "FULL_SHARD"), ...)``."""

Base = dict[str, dict[str, Any]]
"""A scenario's tables as loaded from TOML (without ``[sweep]``), ``--set`` values applied."""

RESULT_KEYS = (
    "step_time_s",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "mfu",
    "peak_memory_bytes",
    "memory_headroom_bytes",
    "peak_reserved_bytes",
    "fits",
    "device_memory_bytes",
    "strategy",
    "wrap",
    "breakdown_s",
)
"""Report keys a worker sends back for a valid point (``sim.outputs.report``'s names and units)."""

GC_GEN0_THRESHOLD = 50_000  # workers allocate many short-lived, acyclic objects (SimPy events)
MAX_CHUNK = 64  # points per task: large enough to amortise a round trip, small enough to balance
TASKS_PER_WORKER = 8  # tasks per worker for load balancing when points differ in cost
EXTRAS = {"ray": "sweep-ray", "dask": "sweep-dask"}


def apply_point(base: Base, point: Point) -> Base:
    """A copy of ``base`` with each ``section.key`` of ``point`` set (``base`` is not changed)."""
    data = {name: dict(table) for name, table in base.items()}
    for key, value in point:
        section, name = key.split(".", 1)
        data.setdefault(section, {})[name] = value
    return data


def run_point(base: Base, where: str, point: Point) -> dict[str, Any]:
    """Simulate one point: the report's ``RESULT_KEYS``, or ``{"error": message}`` if it is invalid.

    A ``UserError`` (a value of the wrong type, a world size the shard group does not divide) is
    the point's own mistake; any other exception is a simulator bug, reported as ``internal error``
    so that one bad point does not lose the rest of a long sweep.
    """
    try:
        report = build_report(simulate(scenario_from_dict(apply_point(base, point), where))).to_json()
    except UserError as e:
        return {"error": str(e).removeprefix(f"{where}: ")}
    except Exception as e:  # noqa: BLE001 - reported in the row, counted by the caller
        return {"error": f"internal error: {type(e).__name__}: {e}"}
    return {key: report[key] for key in RESULT_KEYS}


def run_chunk(base: Base, where: str, points: Sequence[Point]) -> list[dict[str, Any]]:
    """Simulate a chunk of points in order (the task each worker runs)."""
    return [run_point(base, where, point) for point in points]


def init_worker() -> None:
    """Start a local worker process (the simulator is imported with this module): keep the
    collector off its heap.

    ``gc.freeze`` moves the imported modules out of the collector's generations and a larger
    generation-0 threshold lets it run less often; a step allocates many short-lived objects and
    few cycles. Results do not change (the collector frees nothing a step still uses).
    """
    import gc

    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


def local_cores() -> int:
    """Cores this process may run on (its CPU affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def chunk_size(n_points: int, workers: int) -> int:
    """Points per task: about ``TASKS_PER_WORKER`` tasks per worker, at most ``MAX_CHUNK``."""
    per_task = -(-n_points // max(1, workers * TASKS_PER_WORKER))
    return max(1, min(MAX_CHUNK, per_task))


@dataclass(frozen=True, kw_only=True)
class ExecutorSpec:
    """Where points run: ``kind`` is ``local``, ``ray`` or ``dask``; ``address`` is Dask's scheduler."""

    kind: str
    address: str | None = None

    @property
    def label(self) -> str:
        return f"dask {self.address}" if self.kind == "dask" else self.kind


def parse_executor(text: str) -> ExecutorSpec:
    """Read ``--executor``: ``local``, ``ray`` or ``dask://HOST:PORT``."""
    if text in ("local", "ray"):
        return ExecutorSpec(kind=text)
    if text.startswith("dask://") and ":" in text.removeprefix("dask://").strip(":"):
        return ExecutorSpec(kind="dask", address="tcp://" + text.removeprefix("dask://"))
    raise UserError(f"--executor {text!r}: expected local, ray or dask://HOST:PORT")


def _import_extra(module: str, kind: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"--executor {kind} needs the {module!r} package: pip install -e '.[{EXTRAS[kind]}]'"
        ) from None


class RayExecutor(cf.Executor):
    """``concurrent.futures`` face of Ray: each ``submit`` is one remote task, its future Ray's."""

    def __init__(self, ray: Any, *, owns_runtime: bool) -> None:
        self._ray = ray
        self._owns_runtime = owns_runtime
        self._remote: dict[Callable[..., Any], Any] = {}

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        remote = self._remote.setdefault(fn, self._ray.remote(fn))
        future: cf.Future[Any] = remote.remote(*args, **kwargs).future()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if self._owns_runtime:
            self._ray.shutdown()


def _ray_executor(jobs: int | None) -> tuple[cf.Executor, int]:
    ray = _import_extra("ray", "ray")
    owns = not ray.is_initialized()
    if owns:
        address = os.environ.get("RAY_ADDRESS") or None
        try:
            ray.init(address=address, num_cpus=None if address else jobs, log_to_driver=False)
        except ConnectionError as e:
            raise UserError(f"--executor ray: cannot connect to RAY_ADDRESS={address!r} ({e})") from None
    cpus = int(ray.cluster_resources().get("CPU", 1))
    return RayExecutor(ray, owns_runtime=owns), jobs or cpus


class _DaskExecutor(cf.Executor):
    """Dask's ``ClientExecutor`` that also closes its client on shutdown."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._executor = client.get_executor()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        future: cf.Future[Any] = self._executor.submit(fn, *args, **kwargs)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._executor.shutdown(wait=wait)
        self._client.close()


def _dask_executor(address: str, jobs: int | None) -> tuple[cf.Executor, int]:
    distributed = _import_extra("distributed", "dask")
    try:
        client = distributed.Client(address, timeout="10s")
    except (OSError, TimeoutError) as e:
        raise UserError(f"--executor dask://{address.removeprefix('tcp://')}: cannot connect ({e})") from None
    threads = sum(client.nthreads().values()) or 1
    return _DaskExecutor(client), jobs or threads


@contextmanager
def open_executor(spec: ExecutorSpec, jobs: int | None) -> Iterator[tuple[cf.Executor | None, int]]:
    """The executor for ``spec`` and its parallelism; ``None`` means run here, one point at a time."""
    executor: cf.Executor | None
    if spec.kind == "ray":
        executor, workers = _ray_executor(jobs)
    elif spec.kind == "dask":
        executor, workers = _dask_executor(spec.address or "", jobs)
    else:
        workers = jobs or local_cores()
        executor = cf.ProcessPoolExecutor(workers, initializer=init_worker) if workers > 1 else None
    try:
        yield executor, workers
    finally:
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)


class _NoBar:
    """Stands in for a tqdm bar when there is nothing to show."""

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int) -> None:
        return None


def _progress(total: int, enabled: bool, label: str) -> Any:
    """A tqdm bar on stderr when it is a terminal (tqdm decides), else one that shows nothing."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # a dependency of the package; a progress bar is not worth failing for
        return _NoBar()
    return tqdm(total=total, unit="pt", desc=label, file=sys.stderr, disable=None)


def run_points(
    base: Base,
    where: str,
    points: Sequence[Point],
    *,
    executor: ExecutorSpec = ExecutorSpec(kind="local"),
    jobs: int | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Simulate every point; results in the order of ``points`` whatever order chunks finish in."""
    with open_executor(executor, jobs) as (pool, workers):
        size = chunk_size(len(points), workers)
        chunks = [points[i : i + size] for i in range(0, len(points), size)]
        results: list[list[dict[str, Any]] | None] = [None] * len(chunks)
        with _progress(len(points), progress, f"sweep ({executor.label}, {workers} workers)") as bar:
            if pool is None:
                for i, chunk in enumerate(chunks):
                    results[i] = run_chunk(base, where, chunk)
                    bar.update(len(chunk))
            else:
                futures = {pool.submit(run_chunk, base, where, chunk): i for i, chunk in enumerate(chunks)}
                for future in cf.as_completed(futures):
                    results[futures[future]] = future.result()
                    bar.update(len(chunks[futures[future]]))
    return [result for chunk_results in results for result in chunk_results or ()]
