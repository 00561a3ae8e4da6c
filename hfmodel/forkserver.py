"""``python -m hfmodel.forkserver``: imports torch and transformers once, then forks one child per
request, each running ``python -m MODULE ARGS`` as a fresh interpreter would (``sim.childproc``
is the client and says why).

Protocol, one JSON object per line: a request on stdin ``{"module", "argv", "env", "cwd",
"stdout", "stderr", "preload"}`` (``stdout``, ``stderr``: files the child's output goes to;
``preload``: modules the server imports before forking, once, for this child and every later one:
the caller names what its children import, so that only the first pays for it); the server answers
``{"pid": P}`` when the child has started and ``{"pid": P, "returncode": R}`` when it has ended
(R negative: killed by that signal, as ``subprocess`` reports it). It serves one request at a
time and ends when stdin closes.
"""

import contextlib
import json
import os
import runpy
import sys
import traceback
from typing import Any

# what every measuring child imports (the model machinery of transformers, which a model's class
# pulls in lazily); the callers add their own modules (``preload``); PEFT is left to the fine-tuned
# models' requests (``sim.scenario.hf_model``), since importing it (bitsandbytes with it) would
# add 3-4 s to every process's first description
PRELOAD = ("torch", "torch.distributed.fsdp", "transformers", "transformers.modeling_utils")


def _preload(names: list[str] | tuple[str, ...]) -> None:
    for name in names:
        if name not in sys.modules:
            with contextlib.suppress(Exception):  # the child imports it again and reports what fails
                __import__(name)


def _run_child(request: dict[str, Any]) -> int:
    """In the forked child: the request's environment, directory, arguments and stdio, then its module."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for entry in reversed(request["env"].get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    module = request["module"]
    sys.argv = [module, *request["argv"]]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if isinstance(e.code, int):
            code = e.code
        elif e.code is not None:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve() -> None:
    _preload(PRELOAD)
    replies = sys.stdout
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        _preload(request.get("preload", ()))
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run_child(request)
            finally:
                os._exit(code)
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"pid": pid, "returncode": returncode}), file=replies, flush=True)


if __name__ == "__main__":
    serve()
