"""`omni-server ray`: serve a repository on a Ray cluster through Ray Serve until SIGINT or
SIGTERM (docs/scaling.md).

Connects to the cluster at `address` (`auto`: the one this machine belongs to; `ray://...`
through Ray Client; default RAY_ADDRESS), or starts a local one (with at least the CPUs its
replicas ask for); starts Serve's HTTP proxy on host:port; deploys the repository's pipeline
replicas; logs `omni-server ready on ...` once every replica is up.

A stop signal stops it as SIGTERM stops `omni-server`: every replica drains (new requests get
its server's 503, those in flight get `--shutdown-grace` seconds; stop.py), then the application
is deleted (each replica's `__del__` stops its pipeline: processes, segments, run directory),
and a local Ray instance this command started is shut down with Serve. `ray.init` installs
Ray's own SIGTERM handler in this process (exit at once; with a local instance, kill all of its
processes first): ours is installed after it, or SIGTERM would skip all of that.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import replace

import ray
from ray import serve
from ray.serve import Application
from ray.serve.schema import ApplicationStatus

from omni_server.cluster.deployment import pipeline_app
from omni_server.cluster.resources import Scaling, actor_options
from omni_server.cluster.stop import StopSignal
from omni_server.compiler.compiler import compile_repository
from omni_server.serve.access import LOOPBACK_NAMES, loopback_hosts
from omni_server.serve.lifecycle import CANCEL_WAIT_S
from omni_server.serve.options import ServeOptions

log = logging.getLogger("omni_server")

APP_NAME = "omni-server"
# Beyond the replicas' own drain (the grace, then the cancelled requests' wait): their reports'
# way back to the command on a loaded machine. Past it the command stops them regardless.
DRAIN_SLACK_S = 10.0
# After the drain: Serve's graceful stop of each replica (its graceful_shutdown_timeout_s, 20 s
# by default, then each pipeline's stop), Serve's own shutdown and the local Ray instance's, on
# a machine loaded enough to take 10-20 s for some of them.
SERVE_STOP_S = 90.0
DEPLOY_POLL_S = 0.5  # how often the deployment's status is read while it starts


def door_options(options: ServeOptions, host: str) -> ServeOptions:
    """As `omni-server` does for its own socket: a proxy bound to loopback accepts only
    loopback names in Host (and `allowed_hosts`)."""
    hosts = loopback_hosts(host)
    if options.allowed_hosts is not None:
        hosts = (hosts or LOOPBACK_NAMES) | options.allowed_hosts
    return replace(options, allowed_hosts=hosts) if hosts is not None else options


def run(
    repo: str,
    overrides: Sequence[str],
    options: ServeOptions,
    scaling: Scaling,
    *,
    address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
) -> int:
    """0 after a clean stop; 1 when the application could not be deployed."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    stop = threading.Event()
    _stop_on_signals(stop)  # a signal while Ray starts is noted, and honoured once it has
    started_cluster = address is None and not os.environ.get("RAY_ADDRESS")
    if started_cluster:
        # A local cluster gets the CPUs its replicas ask for even on a small machine: Ray's
        # CPUs are accounting, and the stage processes are mostly waiting for requests.
        replicas = scaling.num_replicas or scaling.max_replicas
        wanted = math.ceil(actor_options(compile_repository(repo, list(overrides)))["num_cpus"])
        # no dashboard for a local trial run: a dozen processes and a fixed port (8265) less;
        # "local": a new instance, never one that `ray start` left running on this machine
        ray.init(
            address="local",
            num_cpus=max(os.cpu_count() or 1, wanted * replicas),
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    else:
        ray.init(address=address, logging_level=logging.WARNING)
    _stop_on_signals(stop)  # ray.init replaced our SIGTERM handler with its own
    try:
        stop_signal = StopSignal.remote()
        app = pipeline_app(
            repo, overrides, door_options(options, host), scaling, stop_signal=stop_signal
        )
        serve.start(http_options={"host": host, "port": port})
        try:
            if _deployed(app, stop):
                log.info(
                    "omni-server ready on http://%s:%d (Ray Serve, %s)",
                    host,
                    port,
                    _replicas(scaling),
                )
        except RuntimeError as exc:  # a replica that cannot start (Serve's deploy failure)
            log.error("the application failed to deploy: %s", exc)
            return 1
        stop.wait()
        log.info("omni-server stopping")
        _exit_if_stuck(options.shutdown_grace_s)
        _drain(stop_signal, options.shutdown_grace_s)
        serve.delete(APP_NAME)  # each replica's __del__ stops its pipeline
        if started_cluster:
            serve.shutdown()
    finally:
        ray.shutdown()
    log.info("omni-server stopped")
    return 0


def _stop_on_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def _deployed(app: Application, stop: threading.Event) -> bool:
    """Deploy `app`: True once every replica serves, False when a stop signal comes first (the
    replicas still starting are then stopped with the others, not awaited for minutes).
    RuntimeError when the deployment fails, as from serve.run."""
    # as serve.run, without its wait for the application to run: that wait is ours, on `stop`
    serve.run_many(
        [serve.RunTarget(target=app, name=APP_NAME, route_prefix="/")],
        wait_for_applications_running=False,
    )
    while not stop.wait(DEPLOY_POLL_S):
        application = serve.status().applications.get(APP_NAME)
        if application is None:
            continue
        if application.status == ApplicationStatus.RUNNING:
            return True
        if application.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"Deploying application {APP_NAME} failed: {application.message}")
    return False


def _exit_if_stuck(grace_s: float) -> None:
    """Exit 1 if the stop outlives its bound instead of hanging: Serve's calls block once Ray's
    own processes are gone, as when SIGTERM went to the whole process group (systemd's default
    KillMode=control-group; docs/scaling.md), and a replica may never report drained."""
    bound = grace_s + CANCEL_WAIT_S + 2 * DRAIN_SLACK_S + SERVE_STOP_S

    def give_up() -> None:
        log.error(
            "omni-server ray: the stop did not finish in %g s (were Ray's processes stopped "
            "too? see docs/scaling.md); exiting",
            bound,
        )
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(bound, give_up)
    timer.daemon = True  # a stop that finishes in time exits as usual
    timer.start()


def _drain(stop_signal: ray.actor.ActorHandle, grace_s: float) -> None:
    """Every replica drains (stop.py); returns once all have, or past the bound."""
    bound = grace_s + CANCEL_WAIT_S + DRAIN_SLACK_S
    try:
        late: list[str] = ray.get(stop_signal.stop.remote(bound), timeout=bound + DRAIN_SLACK_S)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
        log.warning("the replicas' drain did not finish: %s", exc)
        return
    if late:
        log.warning("%d replica(s) did not drain within %g s: %s", len(late), bound, late)


def _replicas(scaling: Scaling) -> str:
    if scaling.num_replicas is not None:
        return f"{scaling.num_replicas} replica{'s' if scaling.num_replicas != 1 else ''}"
    return f"autoscaling {scaling.min_replicas}..{scaling.max_replicas} replicas"
