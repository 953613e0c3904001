"""The repository room: stage folders on disk -> a typed, validated graph and process plan.

Public (tools and tests may import these from here; the modules inside may change):
`compile_repository` (a repository folder and dotted overrides -> a `Plan`), `Plan`,
`ModelSpec` (one served model of a plan), `RepositoryError` (what a bad repository raises),
and `MachineFacts` / `DeviceRequest` (what the machine has, what a stage asks of it: the
inputs of `device = "auto"`).
"""

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.plan import DeviceRequest, MachineFacts, ModelSpec, Plan

__all__ = [
    "DeviceRequest",
    "MachineFacts",
    "ModelSpec",
    "Plan",
    "RepositoryError",
    "compile_repository",
]
