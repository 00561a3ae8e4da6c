"""The collective counter of the real runs (``validation.counting``): c10d collectives at the
dispatcher, and the functional all-reduce a DTensor redistribution issues inside its own dispatch
(clip_grad_norm_ over FSDP2's gradients), which no dispatch mode sees. Two gloo ranks."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_main(rank, store, out):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial, Replicate
        from validation.counting import CollectiveCounter
        import torch.distributed._functional_collectives as funcol

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        partial = DTensor.from_local(torch.ones(5), mesh, [Partial()])
        with CollectiveCounter() as counter:
            dist.all_reduce(torch.ones(3))  # c10d, at the dispatcher
            replicated = partial.redistribute(mesh, [Replicate()])  # inside DTensor's dispatch: funcol
            total = replicated.to_local().sum().item()
        restored = funcol.all_reduce.__name__ == "all_reduce"
        # Both ranks done before teardown: without it one rank's gloo threads are sometimes torn
        # down under the other's last collective and the process aborts (3 of 20 runs here).
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"counts": counter.counts, "restored": restored, "total": total}, f)

    if __name__ == "__main__":
        mp.spawn(rank_main, args=(sys.argv[1], sys.argv[2]), nprocs=2)
    """
)


def test_a_dtensor_redistribution_is_counted_beside_c10d_collectives(tmp_path: Path) -> None:
    script, out = tmp_path / "count.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["total"] == 10.0  # the partial sums, all-reduced over the two ranks
    assert result["counts"] == {"all_reduce": {"count": 2, "bytes": 3 * 4 + 5 * 4}}
    assert result["restored"]  # the module's own function is back after the counter exits
