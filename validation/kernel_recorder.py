"""Which attention and loss kernels a fake-mode step ran, and how its attention was masked.

Split from ``validation.fake_memory``, which records every measured step with ``KernelRecorder``
and reports ``attention_kernel`` in the simulator's terms (``backend.attention_kernel``): the
memory of a step depends on the kernel that ran, so the measurement says which one it was.
"""

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that tell which attention / loss kernel a CPU step ran
KERNEL_OPS = {
    "attention": ("scaled_dot_product", "aten._softmax.", "aten._safe_softmax."),
    "loss": ("nll_loss", "cross_entropy", "log_softmax"),
}
# attention's mask arguments across the SDPA overloads (flash/math take attn_mask, efficient/cudnn attn_bias)
MASK_ARGS = ("attn_mask", "attn_bias")


class KernelRecorder(TorchDispatchMode):
    """Records the aten overloads of the attention and loss kernels a step dispatches.

    ``kernels["attention_mask"]`` says how the forward SDPA kernels were masked: "is_causal" (no
    mask tensor, the causal flag), "mask" (an explicit mask tensor) or "none".
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels: dict[str, list[str]] = {kind: [] for kind in KERNEL_OPS}
        self.kernels["attention_mask"] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        for kind, words in KERNEL_OPS.items():
            if any(w in name for w in words) and name not in self.kernels[kind]:
                self.kernels[kind].append(name)
        if "scaled_dot_product" in name and "backward" not in name:
            masking = _attention_masking(func, args, kwargs or {})
            if masking not in self.kernels["attention_mask"]:
                self.kernels["attention_mask"].append(masking)
        return func(*args, **(kwargs or {}))


def _attention_masking(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """ "mask", "is_causal" or "none" for one call of an SDPA overload (arguments bound by its schema)."""
    bound = dict(kwargs)
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
    if any(bound.get(a) is not None for a in MASK_ARGS):
        return "mask"
    return "is_causal" if bound.get("is_causal") else "none"


def attention_kernel(kernels: dict[str, list[str]]) -> str:
    """The simulator's ``backend.attention_kernel`` for the recorded ops: "flash" (a fused
    kernel), "math" (SDPA's math path, which softmaxes with ``_safe_softmax``) or "eager" (the
    model's own attention: ``_softmax``, Gemma 2's soft-capping)."""
    names = kernels.get("attention", [])
    if any("flash" in n or "efficient" in n or "cudnn" in n for n in names):
        return "flash"
    return "math" if any("_safe_softmax" in n for n in names) else "eager"
