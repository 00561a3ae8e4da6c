"""Model descriptions one after another: the first pays the fork server's imports of torch and
transformers' model machinery (``sim/childproc.py``), each next one only its own measurement.

Describes tiny-llama (tests/data/hf) at four sequence lengths into an empty cache and prints each
extraction's wall time, then the same four in fresh interpreters (``python -m hfmodel describe``,
as every extraction ran before the server) for the ratio. Then its LoRA at the same four: a
fine-tuned description's request names PEFT among the server's imports (``sim.scenario.hf_model``),
so that only the first pays PEFT's import too.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "data" / "hf" / "tiny-llama.json"
SEQ_LENS = (32, 64, 128, 256)


LORA = {"method": "lora", "rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}


def _served(cache: str, finetune: dict[str, object] | None = None) -> list[float]:
    from sim.scenario.hf_model import describe_config

    os.environ["FSDPSIM_CACHE_DIR"] = cache
    times = []
    for seq_len in SEQ_LENS:
        start = time.perf_counter()
        describe_config(
            CONFIG,
            name="tiny-llama",
            micro_batch=2,
            seq_len=seq_len,
            dtype="bf16",
            where="bench",
            finetune=finetune,
        )
        times.append(time.perf_counter() - start)
    return times


def _fresh(folder: Path) -> list[float]:
    times = []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for seq_len in SEQ_LENS:
        out = folder / f"fresh-{seq_len}.json"
        cmd = [sys.executable, "-m", "hfmodel", "describe", str(CONFIG), "--name", "tiny-llama"]
        cmd += ["--micro-batch", "2", "--seq-len", str(seq_len), "--dtype", "bf16", "--out", str(out)]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=600)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="fsdpsim-bench-describe-") as tmp:
        served = _served(str(Path(tmp) / "cache"))
        fresh = _fresh(Path(tmp))
        lora = _served(str(Path(tmp) / "cache"), LORA)
    for seq_len, a, b in zip(SEQ_LENS, served, fresh, strict=True):
        print(f"tiny-llama 2 x {seq_len}: forked from the server {a:5.2f} s, a fresh interpreter {b:5.2f} s")
    later = sum(served[1:]) / len(served[1:])
    print(
        f"after the first: {later:.2f} s per description against {sum(fresh) / len(fresh):.2f} s "
        f"(ratio {later / (sum(fresh) / len(fresh)):.2f}); the first, the server's imports included: {served[0]:.2f} s"
    )
    for seq_len, a in zip(SEQ_LENS, lora, strict=True):
        print(f"tiny-llama LoRA 2 x {seq_len}: forked from the same server {a:5.2f} s")
    print(
        f"LoRA after the first: {sum(lora[1:]) / len(lora[1:]):.2f} s per description; "
        f"the first, PEFT's import included: {lora[0]:.2f} s"
    )


if __name__ == "__main__":
    main()
