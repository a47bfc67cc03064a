"""The OpenAI-compatible gateway: OpenAI chat and completion requests become coordinator
workflows, so that agent frameworks that speak the OpenAI API run on the mesh unchanged
(see services/gateway/README.md and docs/mesh.md, "The OpenAI-compatible gateway")."""

from hexgen_gateway.config import GatewayConfig

__all__ = ["GatewayConfig"]
