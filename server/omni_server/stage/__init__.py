"""The stage room: what runs inside a stage process (`python -m omni_server.stage.worker`): the
worker's main, the stage host and its stage nodes, stream inboxes, timeouts, the compute
thread, backends, memory budgets, tensor parallelism and the schedulers. It never imports the
pipeline room (the server process's side).

Public: `load_backend(stage_spec)`, a stage's backend loaded from its file as a stage host
loads it (not yet initialized), for tools that run a stage's code without the runtime.
"""

from omni_server.stage.backends import load_backend

__all__ = ["load_backend"]
