"""The repository room: stage folders on disk -> a typed, validated graph and process plan.

Public (tools and tests may import these from here; the modules inside may change):
`compile_repository` (a repository folder and dotted overrides -> a `Plan`), `Plan`,
`ModelSpec` (one served model of a plan) and `RepositoryError` (what a bad repository raises).
"""

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.plan import ModelSpec, Plan

__all__ = ["ModelSpec", "Plan", "RepositoryError", "compile_repository"]
