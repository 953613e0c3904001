"""What Ray must know about one pipeline replica: its resources and its capacity, from the plan.

A replica runs every process of the plan (one OS process per plan instance), so it asks Ray
for one CPU per instance and for as many GPUs as the highest `cuda:N` any instance uses, plus
one. Ray then sets the replica's CUDA_VISIBLE_DEVICES to the GPUs it granted; the stage
processes inherit it, so `cuda:0` in a stage means the first GPU Ray gave this replica, and
two replicas on one node never share a GPU they did not both ask for.

The replica's capacity is the model's admission limit (`ServeOptions.max_in_flight`): the
autoscaler aims at that many ongoing requests per replica, and Serve sends a replica at most
what its own admission would take in (`max_in_flight + max_queued`) before holding requests
in its router.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_server.compiler.plan import Plan
from omni_server.serve.options import ServeOptions


@dataclass(frozen=True)
class Scaling:
    """A fixed number of replicas, or Serve's autoscaling between `min_replicas` and
    `max_replicas` (then `num_replicas` is None)."""

    num_replicas: int | None = 1
    min_replicas: int = 1
    max_replicas: int = 1

    @classmethod
    def parse_autoscale(cls, text: str) -> Scaling:
        """`MIN:MAX` (1 <= MIN <= MAX) -> autoscaling; ValueError naming what was wrong."""
        low, sep, high = text.partition(":")
        if not sep or not low.strip().isdigit() or not high.strip().isdigit():
            raise ValueError(f"--autoscale wants MIN:MAX (two whole numbers); got {text!r}")
        lo, hi = int(low), int(high)
        if lo < 1 or hi < lo:
            raise ValueError(f"--autoscale wants 1 <= MIN <= MAX; got {text!r}")
        return cls(num_replicas=None, min_replicas=lo, max_replicas=hi)


def gpus_used(plan: Plan) -> int:
    """GPUs one replica needs: the highest device id of any instance, plus one (0: CPU only)."""
    ids = [d for inst in plan.instances for d in inst.devices.values() if d is not None]
    return max(ids) + 1 if ids else 0


def actor_options(plan: Plan) -> dict[str, Any]:
    """`ray_actor_options` of the deployment: one CPU per stage process, the plan's GPUs."""
    return {"num_cpus": float(len(plan.instances)), "num_gpus": float(gpus_used(plan))}


def deployment_options(plan: Plan, options: ServeOptions, scaling: Scaling) -> dict[str, Any]:
    """Keyword arguments of `Deployment.options()` for a repository's pipeline replica."""
    capacity = options.max_in_flight
    out: dict[str, Any] = {
        "ray_actor_options": actor_options(plan),
        # past this Serve holds the request in its router instead of the replica's queue
        "max_ongoing_requests": capacity + options.max_queued,
        # the router's own queue is bounded too: beyond it Serve answers 503
        "max_queued_requests": max(options.max_queued, 1),
    }
    if scaling.num_replicas is not None:
        out["num_replicas"] = scaling.num_replicas
    else:
        out["autoscaling_config"] = {
            "min_replicas": scaling.min_replicas,
            "max_replicas": scaling.max_replicas,
            "initial_replicas": scaling.min_replicas,
            "target_ongoing_requests": capacity,
        }
    return out
