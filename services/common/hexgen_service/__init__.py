"""Plumbing shared by the HexGen-Flow services: the cluster clock, gRPC server bootstrap
(health, reflection, graceful shutdown, tracing), protobuf conversion at the edge, and
typed errors. The scheduling itself lives in the core package, `hexgen_flow`."""

__all__: list[str] = []
