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

from sim.errors import UserError
from validation.allocator_trace import replay
from validation.fsdp1_init import simulated_reserved_bytes


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
