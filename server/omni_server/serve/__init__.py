"""The serving layer: OpenAI-compatible HTTP over the runtime. Protocol adapters only; no
model-specific code lives here."""

from omni_server.serve.app import create_app

__all__ = ["create_app"]
