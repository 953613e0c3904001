"""The wire room: what crosses between the server process and the stage processes (messages,
their codec, the channels over rings and ZMQ, the CUDA lane, `Links`, heartbeats, and the
plan's routes). Both sides import it; it imports neither side.

Public: `Endpoint`, one process's side of the data plane (its rings, its socket, the CUDA
lane), for tools that time a crossing between two processes as the runtime makes it.
"""

from omni_server.wire.channels import Endpoint

__all__ = ["Endpoint"]
