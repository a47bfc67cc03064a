"""Errors a user can cause: the CLI prints their message on one line and exits with code 2."""

from __future__ import annotations

__all__ = ["ConfigError", "HexgenFlowError", "TraceError", "UnknownNameError", "WorkloadError"]


class HexgenFlowError(Exception):
    """Base of every error caused by bad input rather than by a bug."""


class WorkloadError(HexgenFlowError):
    """A workload (query, workflow, call) that violates the domain model."""


class TraceError(HexgenFlowError):
    """A trace file that cannot be read; the message names the file and the line."""


class ConfigError(HexgenFlowError):
    """A cluster, policy or run setting that is not valid."""


class UnknownNameError(ConfigError):
    """A name (policy, GPU type, model) that is not registered; lists the known ones."""

    def __init__(self, kind: str, name: str, known: list[str] | tuple[str, ...]) -> None:
        self.kind = kind
        self.name = name
        self.known = tuple(known)
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(sorted(self.known))}")
