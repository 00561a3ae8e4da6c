#!/usr/bin/env bash
# `make validate-gpu` on the GPU machine the `device` tool lends: no network and no virtual
# environment there; its python3 holds torch with CUDA, transformers and peft, but not simpy, whose
# wheel travels in .whl/ (`make device-wheels` here; the call carries ".whl"). Needs no make:
#   set -o pipefail; bash validation/validate_gpu_device.sh 2>&1 | tee $OUT/log
# VALIDATION.md (its `gpu` section) and the LoRA row's allocator trace come back in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${DEVICE_PYTHON:-python3}"
SITE="${DEVICE_SITE:-/tmp/fsdpsim-site}"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
timeout 540 "$PY" -m validation.gpu --out VALIDATION.md
rc=$?
if [ -n "${OUT:-}" ]; then cp VALIDATION.md "$OUT/"; fi
exit $rc
