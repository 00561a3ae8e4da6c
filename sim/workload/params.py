"""One parameter of a model: its fully qualified name (as in Hugging Face) and shape."""

from dataclasses import dataclass
from math import prod


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """One parameter: its fully qualified name (as in HF) and shape.

    Fine-tuning (``sim.workload.finetune``) marks a frozen one (no gradient, no optimizer state)
    and the dtype it is stored in (None: the master dtype every trainable parameter has); a
    QLoRA weight is its packed 4-bit storage, ``shape`` as bitsandbytes' ``Params4bit`` holds it
    (``quantized_numel`` the elements it packs)."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True
    dtype: str | None = None
    quantized_numel: int = 0

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]
