"""The pipeline runtime: stage processes, stage hosts, the coordinator, transports.

The serving layer needs only `Runtime`, `RequestHandle` and `PipelineError`.
"""

from .coordinator import RequestHandle
from .errors import PipelineError
from .runtime import Runtime

__all__ = ["PipelineError", "RequestHandle", "Runtime"]
