"""Name -> factory registries for the policy families.

A factory is a policy class; its keyword-only constructor arguments (each with a default)
are the policy's parameters. Unknown names and unknown parameters fail with the valid ones
listed. Registration happens in one place, `hexgen_flow.policies.registration`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from hexgen_flow.errors import ConfigError, UnknownNameError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, type[T]] = {}

    def register(self, name: str, factory: type[T]) -> None:
        if name in self._factories:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def factory(self, name: str) -> type[T]:
        try:
            return self._factories[name]
        except KeyError:
            raise UnknownNameError(self.kind, name, self.names()) from None

    def parameters(self, name: str) -> dict[str, Any]:
        """The policy's parameters and their defaults."""
        sig = inspect.signature(self.factory(name).__init__)
        return {
            p.name: p.default
            for p in sig.parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }

    def create(self, name: str, *args: Any, params: Mapping[str, Any] | None = None) -> T:
        params = dict(params or {})
        known = self.parameters(name)
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ConfigError(
                f"{self.kind} {name!r} has no parameter {', '.join(unknown)}; "
                f"its parameters: {', '.join(sorted(known)) or 'none'}"
            )
        return self.factory(name)(*args, **params)
