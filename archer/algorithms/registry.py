"""Name -> entry registries for the algorithm choices a config names (estimators, losses, modes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from archer.errors import ArcherError

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., object])


class Registry(dict[str, T], Generic[T]):
    """A dict of named entries that reports unknown names with the config key and the known names."""

    def __init__(self, kind: str, config_key: str) -> None:
        super().__init__()
        self.kind = kind
        self.config_key = config_key

    def add(self, name: str, entry: T) -> None:
        """Register `entry` under `name`; a name registered twice is an error."""
        if name in self:
            raise ArcherError(
                f"{self.kind} '{name}' is registered twice",
                f"register the new {self.kind} under a name not in: {', '.join(sorted(self))}",
            )
        self[name] = entry

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator: register a function under one or more names (aliases)."""

        def add(fn: F) -> F:
            for name in names:
                self.add(name, fn)  # type: ignore[arg-type]
            return fn

        return add

    def lookup(self, name: str) -> T:
        """The entry registered under `name`; an ArcherError naming the known choices otherwise."""
        if name not in self:
            raise ArcherError(
                f"unknown {self.kind} '{name}'",
                f"set {self.config_key} to one of: {', '.join(sorted(self))}",
            )
        return self[name]
