"""Errors of the local mesh launcher; the CLI prints them on one line and exits with code 2."""

from __future__ import annotations

from hexgen_flow.errors import HexgenFlowError

__all__ = ["ClusterError"]


class ClusterError(HexgenFlowError):
    """A local cluster (`LocalCluster`, `hexgen-flow up`) that cannot start or run."""
