"""The real program's own allocations through the simulator's caching-allocator model: a check of
``sim.outputs.allocator`` apart from the simulated step's allocation sequence.

    python -m validation.allocator_replay --memory-row N --site DIR
    python -m validation.allocator_replay SCENARIO [--set k=v ...]

Runs one rank's FSDP1 step in fake mode as ``fsdpsim validate --memory-only`` does (with
``--site``, the PR's own transformers and PEFT, ``validation.legacy_transformers``), logs every
storage it allocates and frees in order (``validation.step_memory.AllocationLog``: the unsharded
flat parameters on the unshard stream, what ``_reduce_grad`` makes on the post-backward stream,
the rest on the compute stream), and replays that log through ``CachingAllocator``, the cuBLAS
workspace first as the simulator does. Prints one JSON object: the replay's peak allocated and
reserved after one step and after two (the second step reuses the first one's cached segments,
as every step after the first does), beside the simulator's own prediction for the scenario.
If the replay of the real sequence lands on the published reserved peak, the allocator model is
right and a difference is the simulated sequence's; if not, it is the allocator model's.
"""

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

from sim.core.events import Stream
from sim.errors import UserError
from sim.outputs.allocator import CachingAllocator
from validation.fsdp1_init import simulated_reserved_bytes

STREAMS = {s.value: s for s in Stream}


def replay(
    events: list[tuple[str, int, int, str]],
    step_start: int,
    *,
    capacity_bytes: int,
    workspace_bytes: int,
    steps: int,
) -> dict[str, int]:
    """Peak allocated and reserved bytes of the log replayed with its step ``steps`` times. What a
    step leaves live that it allocated (an output the loop keeps) is released when the next
    repetition starts: the log does not say when the next step would drop it (a log of
    ``training.keep_outputs`` holds two steps, the second the steady state, for that reason)."""
    allocator = CachingAllocator(capacity_bytes)
    label_of: dict[int, str] = {}
    live = peak_live = 0
    sizes: dict[str, int] = {}
    counter = 0

    def apply(kind: str, key: int, nbytes: int, stream: str) -> None:
        nonlocal live, peak_live, counter
        if kind == "alloc":
            if nbytes == 0:
                return
            counter += 1
            label = f"{key}:{counter}"
            label_of[key] = label
            sizes[label] = nbytes
            allocator.malloc(label, nbytes, STREAMS[stream])
            live += nbytes
            peak_live = max(peak_live, live)
        elif key in label_of:
            label = label_of.pop(key)
            allocator.free(label)
            live -= sizes.pop(label)

    if workspace_bytes:
        apply("alloc", -1, workspace_bytes, "compute")
    for event in events[:step_start]:
        apply(*event)
    for _ in range(steps):
        before = set(label_of.values())
        for event in events[step_start:]:
            apply(*event)
        for key, label in list(label_of.items()):  # the step's leftovers, released before the next
            if label not in before:
                apply("free", key, 0, "")
    return {"peak_allocated_bytes": peak_live, "peak_reserved_bytes": allocator.peak_reserved}


@contextlib.contextmanager
def _reduction_stream(log: Any) -> Iterator[None]:
    """What FSDP1's ``_reduce_grad`` allocates comes from its post-backward stream's pool."""
    import torch.distributed.fsdp._runtime_utils as runtime

    original = runtime._reduce_grad

    def reduce_grad(*args: Any, **kwargs: Any) -> Any:
        log.stream = "reduce_scatter"
        try:
            return original(*args, **kwargs)
        finally:
            log.stream = "compute"

    runtime._reduce_grad = reduce_grad
    try:
        yield
    finally:
        runtime._reduce_grad = original


def logged_step(scenario: Any, legacy: bool) -> tuple[Any, dict[str, Any]]:
    """The allocation log of one tracked FSDP1 step of ``scenario`` (its ``step_start`` where the
    step begins) and the fake-mode measurement it was taken in."""
    from validation.step_memory import AllocationLog

    if scenario.parallel.fsdp_version != 1:
        raise UserError(f"{scenario.source}: validation.allocator_replay logs FSDP1 steps only")
    log = AllocationLog()
    with _reduction_stream(log):
        if legacy:
            from validation.legacy_transformers import measure

            measured = measure(scenario, log=log)
        else:
            from validation.fake_memory import measure_fake_memory

            measured = measure_fake_memory(scenario, log=log)
    return log, measured


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m validation.allocator_replay")
    parser.add_argument("scenario", nargs="?")
    parser.add_argument("--memory-row", type=int, help="a row of validation.published_memory.MEMORY_RUNS")
    parser.add_argument("--site", help="a directory holding the old transformers and peft (legacy run)")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args(argv)
    try:
        from sim.hardware.registry import load_profile
        from sim.outputs.report import build_report
        from sim.simulate import simulate
        from validation.legacy_transformers import load_scenario_or_row, use_site

        scenario = load_scenario_or_row(args.scenario, args.memory_row, args.overrides)
        simulated = simulate(scenario)
        report = build_report(simulated)
        after_init, with_init = simulated_reserved_bytes(simulated, fsdp1_init=True)
        if args.site:
            use_site(args.site)
        log, _ = logged_step(scenario, legacy=bool(args.site))
        device = load_profile(scenario.cluster.profile).device
        workspace = device.cublas_workspace_bytes or 0
        out: dict[str, Any] = {
            "scenario": scenario.source,
            "events": len(log.events),
            "simulated": {
                "peak_allocated_bytes": report.peak_memory_bytes,
                "peak_reserved_bytes": report.peak_reserved_bytes,
            },
            # the simulated step after FSDP1's initialisation and empty_cache() (validation.fsdp1_init)
            "simulated_after_fsdp1_init": {
                "reserved_after_init_bytes": after_init,
                "peak_reserved_bytes": with_init,
            },
        }
        for steps in (1, 2):
            out[f"replay_{steps}_step"] = replay(
                log.events,
                log.step_start,
                capacity_bytes=device.memory_bytes,
                workspace_bytes=workspace,
                steps=steps,
            )
        print(json.dumps(out, indent=1))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
