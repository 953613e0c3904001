"""The pipeline room: what runs in the server process for one compiled plan: `Runtime` (the
stage processes and their supervision), the coordinator, replica binding.

The serving layer needs only `Runtime`, `RequestHandle` and `PipelineError`.
"""

from omni_server.errors import PipelineError

from .coordinator import RequestHandle
from .runtime import Runtime

__all__ = ["PipelineError", "RequestHandle", "Runtime"]
