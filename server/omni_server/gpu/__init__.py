"""The GPU room: the machine's GPUs (`devices`), the MPS control daemon (`mps`) and CUDA IPC
weight sharing across replicas (`weights`). Imports neither the pipeline nor the stage room.

Public: `discover(environ)`, the machine's GPUs as the runtime sees them (from nvidia-smi, no
CUDA context in the caller), for tools that must check a GPU is there before they start.
"""

from omni_server.gpu.devices import discover

__all__ = ["discover"]
