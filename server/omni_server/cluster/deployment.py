"""The Serve deployment: one replica = one whole pipeline of a repository, and the application
builder `serve run` and Serve config files name.

    serve run omni_server.cluster.deployment:build_app repo=/srv/repository

A replica compiles the repository (with the same overrides as the command line), starts the
plan's stage processes on the node Ray placed it on (`PrivateServer`: the single-host server's
runtime and aiohttp app on a private Unix socket) and forwards everything Serve's proxy sends it
(`Forwarder`). Serve's health check asks the pipeline's own health; a replica whose pipeline
has no live replica of some process is replaced. Serve's graceful stop (`__del__`) drains the
replica's requests and reaps its processes as SIGTERM does for `omni-server`. A replica that
`omni-server ray` deployed also waits on the command's `StopSignal` (stop.py): when the command
stops, the replica drains first (503 to new requests, the grace period to those in flight), and
Serve deletes it afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.actor import ActorHandle
from ray.serve import Application

from omni_server.cluster.forward import Forwarder
from omni_server.cluster.private_server import PrivateServer
from omni_server.cluster.resources import Scaling, deployment_options
from omni_server.cluster.stop import report_drained, wait_for_stop
from omni_server.compiler.compiler import compile_repository
from omni_server.serve.options import ServeOptions

log = logging.getLogger(__name__)

DEPLOYMENT_NAME = "omni-pipeline"
API_KEY_ENV = "OMNI_SERVER_API_KEY"


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress()  # the app is this replica's Forwarder, built once its server listens
class PipelineReplica:
    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        repo: str,
        overrides: Sequence[str] = (),
        options: ServeOptions | None = None,
        stop_signal: ActorHandle | None = None,
    ) -> None:
        plan = compile_repository(repo, list(overrides))
        self.server = PrivateServer(plan, options or ServeOptions())
        await self.server.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.forwarder = Forwarder(self.replica_id, ray.get_runtime_context().get_node_id())
        self.forwarder.open(str(self.server.socket_path))
        self._drain_on_stop: asyncio.Task[None] | None = None
        if stop_signal is not None:  # on this replica's loop, which serves its requests
            self._drain_on_stop = asyncio.ensure_future(self._drain_when_stopped(stop_signal))

    async def _drain_when_stopped(self, stop_signal: ActorHandle) -> None:
        """Wait for the command's stop; then drain and tell it so (stop.py)."""
        if not await wait_for_stop(stop_signal, self.replica_id):
            # the command that deployed this replica is gone: it keeps serving, and Serve's own
            # stop (__del__) still reaps it
            log.warning("omni-server ray's stop signal is gone; serving on")
            return
        cancelled = await self.server.drain()
        if cancelled:
            log.warning(
                "%d request(s) still running after the grace period were cancelled", cancelled
            )
        await report_drained(stop_signal, self.replica_id)

    def __serve_build_asgi_app__(self) -> Forwarder:
        return self.forwarder

    async def check_health(self) -> None:
        """Serve's health check: raising marks the replica unhealthy (Serve replaces it)."""
        why = self.server.unhealthy()
        if why is not None:
            raise RuntimeError(f"the pipeline is unhealthy: {why}")

    async def __del__(self) -> None:
        # Serve calls this on a graceful stop (scale-down, redeploy, serve.delete); a replica
        # killed with its node never gets here, and its processes die with it (PDEATHSIG)
        drain = getattr(self, "_drain_on_stop", None)
        if drain is not None:
            drain.cancel()  # Serve's stop without the command's: stop() drains by itself
        if hasattr(self, "forwarder"):
            await self.forwarder.close()
        if hasattr(self, "server"):
            await self.server.stop()


def pipeline_app(
    repo: str | Path,
    overrides: Sequence[str] = (),
    options: ServeOptions | None = None,
    scaling: Scaling | None = None,
    *,
    stop_signal: ActorHandle | None = None,
    **extra: Any,
) -> Application:
    """The Serve application of a repository: options from its plan (resources, capacity)
    and `scaling`; `extra` goes to `Deployment.options()` as is (e.g. `max_replicas_per_node`,
    `health_check_period_s`). Compiling here raises `RepositoryError` before Ray sees anything.
    `stop_signal`: the `StopSignal` of `omni-server ray` (stop.py), which its replicas wait on."""
    options = options or ServeOptions()
    plan = compile_repository(repo, list(overrides))
    settings = deployment_options(plan, options, scaling or Scaling()) | extra
    return PipelineReplica.options(**settings).bind(  # type: ignore[attr-defined]
        str(Path(repo).resolve()), tuple(overrides), options, stop_signal
    )


def build_app(args: Mapping[str, Any]) -> Application:
    """The application builder for `serve run` / a Serve config file's `import_path`.

    `args` (the config's `args:` or `serve run ... key=value`): `repo` (required), `overrides`
    (a list of strings as on the command line, or one string split on spaces), `num_replicas`
    or `autoscale` ("MIN:MAX"), and any ServeOptions field (`api_key`, `max_in_flight`, ...);
    without `api_key`, OMNI_SERVER_API_KEY of the process building the app is the key.
    The config file's own `deployments:` entries still override what this sets."""
    values = dict(args)
    if "repo" not in values:
        raise ValueError("omni-server's Serve app needs args.repo: the repository folder")
    repo = str(values.pop("repo"))
    overrides = values.pop("overrides", ())
    if isinstance(overrides, str):
        overrides = overrides.split()
    scaling = Scaling(num_replicas=int(values.pop("num_replicas", 1)))
    if "autoscale" in values:
        scaling = Scaling.parse_autoscale(str(values.pop("autoscale")))
    known = {f.name: f.type for f in fields(ServeOptions)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(
            f"unknown args for omni-server's Serve app: {', '.join(unknown)}; "
            f"known: repo, overrides, num_replicas, autoscale, {', '.join(sorted(known))}"
        )
    if "api_key" not in values and os.environ.get(API_KEY_ENV):
        values["api_key"] = os.environ[API_KEY_ENV]  # as omni-server: the variable, not argv
    options = ServeOptions(**_typed_options(values))
    return pipeline_app(repo, overrides, options, scaling)


def _typed_options(values: Mapping[str, Any]) -> dict[str, Any]:
    """`serve run key=value` gives strings: read each as its ServeOptions field's type."""
    out: dict[str, Any] = {}
    defaults = ServeOptions()
    for name, value in values.items():
        default = getattr(defaults, name)
        if isinstance(value, str) and isinstance(default, bool):
            out[name] = value.strip().lower() in ("1", "true", "yes")
        elif isinstance(value, str) and isinstance(default, int):
            out[name] = int(value)
        elif isinstance(value, str) and isinstance(default, float):
            out[name] = float(value)
        elif name in ("allowed_origins",) and isinstance(value, str):
            out[name] = tuple(v.strip() for v in value.split(",") if v.strip())
        elif name == "allowed_hosts" and value is not None:
            items = value.split(",") if isinstance(value, str) else value
            out[name] = frozenset(str(v).strip().lower() for v in items if str(v).strip())
        else:
            out[name] = value
    return out
