"""The wire contract beyond the protos: what a client of the mesh and its services must
both know, defined once here and imported by both sides.

- `hexgen_wire.metadata`: gRPC metadata keys and environment variables (the API key's
  header and variable, the TLS CA's variable, the retry-after and shard-owner trailers);
- `hexgen_wire.tls`: a client's TLS channel credentials from PEM files;
- `hexgen_wire.convert`: the core's workflow and query as the API's messages.

It imports the generated API (`hexgen_api`) and the core's plain data types
(`hexgen_flow.workload`, `hexgen_flow.errors`) only: never a service, Redis, numpy or
matplotlib (tests/test_layers.py), so the Python SDK (`hexgen_client`) stays light.
"""

__all__: list[str] = []
