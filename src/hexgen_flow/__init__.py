"""HexGen-Flow: deadline-aware scheduling of agentic LLM workflows on heterogeneous GPUs."""

__version__ = "0.1.0"
__all__ = ["__version__"]
