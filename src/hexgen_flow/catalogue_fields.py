"""Reading the fields of one catalogue entry (a GPU, a model) from YAML, with errors that
name the entry and the field: a user's GPU entry in a cluster file fails on one line."""

from __future__ import annotations

import math
from typing import Any, cast

from hexgen_flow.errors import ConfigError

__all__ = ["EntryFields"]


class EntryFields:
    """The fields of one catalogue entry, read with errors that name the entry and field."""

    def __init__(self, doc: object, where: str, known: tuple[str, ...]) -> None:
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: expected a mapping of fields, got {doc!r}")
        self.doc = cast(dict[str, Any], doc)
        name = self.doc.get("name")
        self.where = f"{where} ({name})" if isinstance(name, str) else where
        # A misspelt field (dense_bf16_tflops) would otherwise be ignored without a word.
        unknown = sorted(str(k) for k in self.doc if k not in known)
        if unknown:
            raise ConfigError(
                f"{self.where}: unknown field {unknown[0]!r} (fields: {', '.join(known)})"
            )

    def _fail(self, key: str, expected: str) -> ConfigError:
        return ConfigError(f"{self.where}: {key} must be {expected}, got {self.doc.get(key)!r}")

    def _required(self, key: str) -> object:
        if key not in self.doc:
            raise ConfigError(f"{self.where}: field {key} is required")
        return self.doc[key]

    def text(self, key: str) -> str:
        value = self._required(key)
        if not isinstance(value, str) or not value.strip():
            raise self._fail(key, "a non-empty string")
        return value.strip()

    def optional_text(self, key: str) -> str | None:
        return None if self.doc.get(key) is None else self.text(key)

    def number(self, key: str) -> float:
        value = self._required(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._fail(key, "a number > 0")
        if not (math.isfinite(value) and value > 0):
            raise self._fail(key, "a number > 0")
        return value

    def optional_number(self, key: str) -> float | None:
        return None if self.doc.get(key) is None else self.number(key)

    def count(self, key: str) -> int:
        value = self._required(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self._fail(key, "an integer >= 1")
        return value

    def flag(self, key: str) -> bool:
        value = self._required(key)
        if not isinstance(value, bool):
            raise self._fail(key, "true or false")
        return value

    def choice(self, key: str, options: tuple[str, ...]) -> str:
        value = self._required(key)
        if value not in options:
            raise self._fail(key, f"one of {', '.join(options)}")
        return str(value)

    def names(self, key: str) -> tuple[str, ...]:
        value = self.doc.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self._fail(key, "a list of names")
        return tuple(v.strip() for v in value)

    def counts_by_name(self, key: str) -> tuple[tuple[str, int], ...]:
        value = self.doc.get(key, {})
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1
            for k, v in value.items()
        ):
            raise self._fail(key, "a mapping of GPU name to an integer >= 1")
        return tuple((str(k), int(v)) for k, v in value.items())
