"""`serve(plan)`: run the pipeline and its HTTP server until SIGINT or SIGTERM.

Order matters. The HTTP port is bound first, so a taken port fails in a second, before any stage
process is spawned, and `/health/live` answers (`/health/ready` says 503) while stages load.
Shutdown runs the other way round: stop accepting connections, give in-flight requests the
grace period (`ServeOptions.shutdown_grace_s`, 5 s) to finish and cancel the rest (their
handles abort in every stage; they are counted as `server_shutdown`), close the connections,
then stop the runtime, which reaps its processes and segments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import replace

from aiohttp import web

from omni_server.compiler.plan import Plan
from omni_server.gpu.devices import Machine
from omni_server.pipeline import ControlMode, ModelControl, Runtime
from omni_server.serve import create_app, log_throttle
from omni_server.serve.access import LOOPBACK_NAMES, loopback_hosts
from omni_server.serve.options import ServeOptions
from omni_server.serve.state import STATE
from omni_server.serve.timeouts import make_runner

log = logging.getLogger("omni_server")


def serve(
    plan: Plan,
    host: str = "127.0.0.1",
    port: int = 8000,
    options: ServeOptions | None = None,
    *,
    model_control: str = "none",
    load_models: Sequence[str] = (),
    poll_s: float = 15.0,
    overrides: Sequence[str] = (),
    machine: Machine | None = None,
) -> int:
    """Serve `plan` on http://host:port until a stop signal; 0 after a clean stop, 1 if the
    port cannot be bound or the pipeline fails to start. Bound to a loopback address, only
    loopback names (and `options.allowed_hosts`) are accepted in `Host`; bound elsewhere, any
    name is, unless `options.allowed_hosts` lists them.

    `model_control` "explicit" or "poll" serves through `ModelControl` (models loaded,
    reloaded and unloaded while serving; `load_models` and `poll_s` as its `load` and
    `poll_s`); the repository is compiled again with `overrides` on every load. `machine`:
    the GPUs `plan` was compiled for (None: the runtime discovers them if the plan has GPU
    stages)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    log_throttle.install()
    options = options or ServeOptions()
    hosts = loopback_hosts(host)
    if options.allowed_hosts is not None:  # names added by the operator (--allowed-hosts)
        hosts = (hosts or LOOPBACK_NAMES) | options.allowed_hosts
    if hosts is not None:
        options = replace(options, allowed_hosts=hosts)
    start_timeout, supervision = options.start_timeout_s, options.supervision()

    def runtime(of: Plan) -> Runtime:
        return Runtime(of, supervision=supervision, start_timeout=start_timeout, machine=machine)

    if model_control == ControlMode.NONE:
        return asyncio.run(_serve(lambda: runtime(plan), host, port, options))

    def control() -> ModelControl:
        return ModelControl(
            plan.repository,
            plan=plan,
            overrides=overrides,
            mode=ControlMode(model_control),
            load=load_models,
            poll_s=poll_s,
            runtime=runtime,
        )

    return asyncio.run(_serve(control, host, port, options))


async def _serve(
    make_runtime: Callable[[], Runtime | ModelControl], host: str, port: int, options: ServeOptions
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    runtime = make_runtime()
    app = create_app(runtime, options=options)
    runner = make_runner(app, options)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
            return 1
        bound = _bound_port(runner, port)
        if not await _start_runtime(runtime, stop):
            return 1 if not stop.is_set() else 0
        models = ", ".join(runtime.plan.models) or "none"
        log.info("omni-server ready on http://%s:%d (models: %s)", host, bound, models)
        await stop.wait()
        log.info("omni-server stopping")
        for running in list(runner.sites):
            await running.stop()  # no new connections; open ones get 503 while draining
        await app[STATE].lifecycle.drain(options.shutdown_grace_s)
    finally:
        await runner.cleanup()
        await runtime.stop()
    log.info("omni-server stopped")
    return 0


async def _start_runtime(runtime: Runtime | ModelControl, stop: asyncio.Event) -> bool:
    """Start the runtime unless a stop signal comes first; False when it did not start."""
    starting = asyncio.ensure_future(runtime.start())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return False
    if starting.exception() is not None:
        log.error("the pipeline failed to start: %s", starting.exception())
        return False
    return True


def _bound_port(runner: web.AppRunner, requested: int) -> int:
    """The port actually bound (differs from the request for port 0)."""
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return requested
