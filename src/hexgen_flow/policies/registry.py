"""Name -> factory registries for the policy families.

A factory is a policy class; its keyword-only constructor arguments (each with a default)
are the policy's parameters. Unknown names and unknown parameters fail with the valid ones
listed. Registration happens in one place, `hexgen_flow.policies.registration`.
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Mapping
from pathlib import Path
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
        factory = self.factory(name)
        if _compiled(factory):
            return _compiled_parameters(factory)
        sig = inspect.signature(factory.__init__)
        return {
            p.name: p.default
            for p in sig.parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }

    def doc(self, name: str) -> str:
        """The policy's docstring (`inspect.getdoc`'s, cleaned; "" if none)."""
        factory = self.factory(name)
        if _compiled(factory):
            for cls in factory.__mro__[:-1]:  # the first docstring, as `inspect.getdoc`
                doc = ast.get_docstring(_source_class(cls)[0])
                if doc:
                    return doc
            return ""
        return inspect.getdoc(factory) or ""

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


def _compiled(cls: type) -> bool:
    """Whether `cls` comes from a module mypyc compiled (scripts/compile_core.py): its
    methods have no signature that tells keyword-only arguments apart, and the class has no
    docstring, so `Registry` reads both from the source beside the extension module."""
    return not (getattr(sys.modules[cls.__module__], "__file__", None) or ".py").endswith(".py")


def _source_class(cls: type) -> tuple[ast.ClassDef, Path]:
    """The definition of `cls` in its module's source (the ``.py`` beside a compiled one)."""
    module = sys.modules[cls.__module__]
    source = Path(module.__file__ or "").with_name(cls.__module__.rsplit(".", 1)[-1] + ".py")
    for node in ast.parse(source.read_text(encoding="utf-8"), str(source)).body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node, source
    raise TypeError(f"no class {cls.__qualname__} in {source}")


def _compiled_parameters(factory: type) -> dict[str, Any]:
    """The keyword-only arguments of `factory.__init__` and their defaults, from the source
    (`_compiled`). The defaults are evaluated in the compiled module's namespace, so they
    are the objects the constructor uses."""
    for cls in factory.__mro__[:-1]:
        node, source = _source_class(cls)
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                args = item.args
                namespace = vars(sys.modules[cls.__module__])
                return {
                    arg.arg: eval(  # a default as written in the project's own source
                        compile(ast.Expression(default), str(source), "eval"), namespace
                    )
                    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                    if default is not None
                }
    return {}
