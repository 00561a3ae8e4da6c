"""One parameter of a model: its fully qualified name (as in Hugging Face) and shape."""

from dataclasses import dataclass
from math import prod


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its fully qualified name (as in HF) and shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]
