"""Generated gRPC stubs of the hexgen_flow.v1 protos (scripts/gen_protos.py)."""
