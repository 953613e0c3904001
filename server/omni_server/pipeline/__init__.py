"""The pipeline room: what runs in the server process for one compiled plan: `Runtime` (the
stage processes and their supervision), the coordinator, replica binding.

The serving layer needs only `Runtime` (or `ModelControl`, which runs one runtime per group of
models and swaps them on a reload), `RequestHandle` and `PipelineError`.
"""

from omni_server.errors import PipelineError

from .coordinator import RequestHandle
from .model_control import ControlError, ControlMode, ModelControl, ModelState
from .runtime import Runtime

__all__ = [
    "ControlError",
    "ControlMode",
    "ModelControl",
    "ModelState",
    "PipelineError",
    "RequestHandle",
    "Runtime",
]
