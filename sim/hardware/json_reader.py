"""Typed access to a JSON object that names the file and the field in every error."""

from typing import Any

from sim.errors import UserError

MISSING: Any = ...


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


class JsonReader:
    """One JSON object (``data``) found at ``path`` inside the file ``where``."""

    def __init__(self, data: Any, where: str, path: str = ""):
        if not isinstance(data, dict):
            raise UserError(f"{where}: {path or 'profile'} must be a JSON object")
        self.data, self.where, self.path = data, where, path

    def name(self, key: str) -> str:
        """The dotted name of ``key`` in the file, for messages."""
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = MISSING) -> Any:
        if key not in self.data:
            if default is MISSING:
                raise UserError(f"{self.where}: missing field {self.name(key)}")
            return default
        value = self.data[key]
        ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _as_tuple(kind))
        if not ok:
            names = "/".join(t.__name__ for t in _as_tuple(kind))
            raise UserError(f"{self.where}: field {self.name(key)} must be {names}, got {value!r}")
        return value

    def number(self, key: str, minimum: float = 0.0, default: Any = MISSING) -> float:
        """A number >= ``minimum``."""
        value = self.get(key, (int, float), default)
        if value < minimum:
            raise UserError(
                f"{self.where}: field {self.name(key)} must be a number >= {minimum:g}, got {value!r}"
            )
        return float(value)

    def positive(self, key: str, default: Any = MISSING) -> float:
        value = self.get(key, (int, float), default)
        if value is not None and value <= 0:
            raise UserError(f"{self.where}: field {self.name(key)} must be > 0, got {value!r}")
        return value

    def choice(self, key: str, allowed: tuple[str, ...], default: Any = MISSING) -> str:
        value = self.get(key, str, default)
        if value not in allowed:
            raise UserError(
                f"{self.where}: field {self.name(key)} is {value!r}; allowed: {', '.join(allowed)}"
            )
        return value

    def sub(self, key: str) -> "JsonReader":
        return JsonReader(self.get(key, dict), self.where, self.name(key))
