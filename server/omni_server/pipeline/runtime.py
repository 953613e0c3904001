"""Runtime: the processes and the coordinator of one compiled plan.

Two placements, one code path for stages:
- `inline=True`: every instance's stage host runs on the caller's event loop in this process
  (`inline.InlinePipeline`; backends still run on their own compute threads). For tests and
  tools; no TP.
- default: one OS process per plan instance (`processes.StageProcesses`), with the coordinator
  here on the caller's event loop.

Supervision (process placement): a dead stage process fails the requests that may have reached
it, its replica takes no new requests, and it is restarted (`supervision.SupervisionPolicy`:
backoff, crash-loop limit). `health()` says "ok", "degraded" (an instance is down but every
process has a live replica: requests are still served) or "unavailable". Counters of restarts
and timeouts, and `supervision_observers`, are the metrics hooks.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.envelope import Payload
from omni_server.errors import PipelineError
from omni_server.gpu.devices import Machine, check_placement, discover, uses_gpus
from omni_server.wire.messages import StageTimedOut

from .coordinator import Coordinator, RequestHandle, StageObserver
from .inline import InlinePipeline
from .processes import StageProcesses
from .supervision import CrashHistory, InstanceState, SupervisionPolicy

log = logging.getLogger(__name__)

Health = Literal["ok", "degraded", "unavailable"]
# (event, instance or stage, detail): "death" (instance, why), "restart" (instance, seconds it
# was down), "failed" (instance, why), "timeout" (stage, instance)
SupervisionObserver = Callable[[str, str, str], None]


class Runtime:
    """Owns the processes and the coordinator for one plan."""

    def __init__(
        self,
        plan: Plan,
        *,
        run_dir: Path | None = None,
        inline: bool = False,
        ring_capacity: int = 8 << 20,
        start_timeout: float = 300.0,
        supervision: SupervisionPolicy | None = None,
        machine: Machine | None = None,
    ) -> None:
        """`machine`: the GPUs and MPS tools to place stages on; None: discovered at start()
        when the plan has GPU stages (tests pass their own)."""
        self.plan = plan
        self.stage_observers: list[StageObserver] = []
        self.supervision_observers: list[SupervisionObserver] = []
        self.policy = supervision or SupervisionPolicy()
        # metrics: restarts per instance name, timeouts per stage, deaths per instance name
        self.restarts: collections.Counter[str] = collections.Counter()
        self.timeouts: collections.Counter[str] = collections.Counter()
        self.deaths: collections.Counter[str] = collections.Counter()
        n = len(plan.instances)
        self._states = [InstanceState.UP] * n
        self._crashes = [CrashHistory(self.policy.crash_loop_window_s) for _ in range(n)]
        self._restarts: dict[int, asyncio.Task[None]] = {}
        self._run_dir = run_dir
        self._machine = machine
        self._ring_capacity = ring_capacity
        self._start_timeout = start_timeout
        self._inline_pipeline: InlinePipeline | None = None
        self._group: StageProcesses | None = None
        self._state = "new"  # new -> starting -> running -> stopped
        self._unhealthy: str | None = None
        self.coordinator = Coordinator(plan, self.stage_observers)
        self.coordinator.on_stage_timeout = self._stage_timed_out
        if inline:
            self._inline_pipeline = InlinePipeline(plan, self.coordinator)

    @property
    def ready(self) -> bool:
        return self._state == "running"

    @property
    def healthy(self) -> bool:
        """Requests can be served (health() is "ok" or "degraded")."""
        return self.health()[0] != "unavailable"

    def health(self) -> tuple[Health, str]:
        """("ok" | "degraded" | "unavailable", detail for an operator)."""
        if self._state != "running":
            return "unavailable", f"the pipeline is {self._state}"
        if self._unhealthy is not None:
            return "unavailable", self._unhealthy
        down = [
            f"{inst.name} {state}"
            for inst, state in zip(self.plan.instances, self._states, strict=True)
            if state is not InstanceState.UP
        ]
        if not down:
            return "ok", "every stage process is up"
        binder = self.coordinator.binder
        dead = [p for p in self.plan.processes if not any(binder.up(p))]
        if dead:
            return "unavailable", f"no live replica of {', '.join(dead)} ({'; '.join(down)})"
        return "degraded", "; ".join(down)

    def unavailable_for(self, model: ModelSpec) -> str | None:
        """Why requests of `model` cannot be served now, or None: a process down that the model
        does not use (the thinker, for a speech model) does not stop it."""
        if self._state != "running":
            return f"the pipeline is {self._state}"
        if self._unhealthy is not None:
            return self._unhealthy
        binder = self.coordinator.binder
        processes = self.coordinator.routes.model_processes[model.id]
        dead = [p for p in processes if not any(binder.up(p))]
        if dead:
            return f"no live replica of {', '.join(dead)} (restarting or failed; see /health)"
        return None

    @property
    def restarts_pending(self) -> frozenset[str]:
        """Instances whose restart is scheduled or under way (a failed instance has none)."""
        return frozenset(self.plan.instances[i].name for i in self._restarts)

    def instance_states(self) -> dict[str, InstanceState]:
        """Instance name -> up / restarting / failed."""
        return {i.name: s for i, s in zip(self.plan.instances, self._states, strict=True)}

    @property
    def inline_pipeline(self) -> InlinePipeline | None:
        """The in-process stage hosts when `inline=True` (a seam for tests and tools: which
        backend runs where), else None."""
        return self._inline_pipeline

    @property
    def stage_processes(self) -> StageProcesses | None:
        """The stage processes once started (not inline): run id and directory, pids."""
        return self._group

    @property
    def run_dir(self) -> Path | None:
        return self._group.run_dir if self._group is not None else None

    def processes(self) -> dict[str, int]:
        """Instance name -> pid of every live stage process (empty when inline)."""
        return self._group.pids() if self._group is not None else {}

    async def start(self) -> None:
        if self._state != "new":
            raise RuntimeError(f"runtime already {self._state}")
        self._state = "starting"
        try:
            machine = self._machine
            if machine is None and uses_gpus(self.plan):
                machine = await asyncio.to_thread(discover, os.environ)
            if machine is not None:
                check_placement(self.plan, machine)  # one line naming the stage and device
            if self._inline_pipeline is not None:
                await self._inline_pipeline.start()
            else:
                self._group = StageProcesses(
                    self.plan,
                    on_message=self.coordinator.on_message,
                    on_death=self._instance_died,
                    on_broken=self._broken,
                    run_dir=self._run_dir,
                    ring_capacity=self._ring_capacity,
                    heartbeat_interval_s=self.policy.heartbeat_interval_s,
                    heartbeat_timeout_s=self.policy.heartbeat_timeout_s,
                    start_timeout_s=self._start_timeout,
                    machine=machine,
                )
                await asyncio.wait_for(self._group.start(), self._start_timeout)
                self.coordinator.open(self._group.links)
        except PipelineError as exc:
            await self._stop_everything()
            raise PipelineError(str(exc), code="unavailable") from exc
        except TimeoutError as exc:
            await self._stop_everything()
            raise PipelineError(
                f"stages not ready after {self._start_timeout:g} s", code="unavailable"
            ) from exc
        except BaseException:
            await self._stop_everything()
            raise
        self._state = "running"

    async def stop(self) -> None:
        """Stop everything; idempotent. Requests still in flight fail as unavailable."""
        if self._state == "stopped":
            return
        self._state = "stopped"
        await self._stop_everything()

    async def _stop_everything(self) -> None:
        self._state = "stopped"
        for task in self._restarts.values():
            task.cancel()
        await asyncio.gather(*self._restarts.values(), return_exceptions=True)
        self._restarts.clear()
        self.coordinator.close("the pipeline is stopped")
        if self._inline_pipeline is not None:
            await self._inline_pipeline.stop()
        if self._group is not None:
            await self._group.stop()

    def submit(
        self, model: ModelSpec, inputs: Payload, request_id: str | None = None
    ) -> RequestHandle:
        """Start a request of `model` (on the loop that started the runtime); see RequestHandle.

        `inputs` is handed to the entry stage as `request.inputs` (read-only from then on)."""
        return self.coordinator.submit(model, inputs, request_id)

    # ---- supervision -------------------------------------------------------------------------

    def _instance_died(self, index: int, exitcode: int | None, why: str | None = None) -> None:
        instance = self.plan.instances[index]
        message = f"process {instance.name} exited with code {exitcode}"  # processes.py logged it
        if why:
            message += f" (killed: {why})"
        self.deaths[instance.name] += 1
        self._set_down(index)
        self.coordinator.instance_died(index, message)  # its requests fail as process_died
        if instance.tp_size > 1:
            self._stop_tp_group(index)
        self._notify("death", instance.name, why or f"exit code {exitcode}")
        if self._state != "running":
            return  # still starting: start() reports it
        recent = self._crashes[index].record()
        reason = None
        if not self.policy.restart:
            reason = "restarts are off"
        elif instance.tp_size > 1:
            reason = "a tensor-parallel group is not restarted"
        elif recent >= self.policy.crash_loop_deaths:
            window = self.policy.crash_loop_window_s
            reason = f"crash loop: {recent} deaths within {window:g} s"
        if reason is not None:
            self._fail_instance(index, reason)
            return
        delay = self.policy.backoff(recent)
        log.warning(
            "restarting %s in %.2g s (death %d in the window)", instance.name, delay, recent
        )
        self._restarts[index] = asyncio.get_running_loop().create_task(self._restart(index, delay))

    def _stop_tp_group(self, index: int) -> None:
        """A TP rank died: its group can never be in step again (the others may wait in a
        collective for it), so its other ranks are killed; the leader's death fails its requests
        (stage/tp.py)."""
        instance = self.plan.instances[index]
        assert self._group is not None  # TP never runs inline
        for i, other in enumerate(self.plan.instances):
            same = (other.process, other.replica) == (instance.process, instance.replica)
            if same and i != index:
                self._group.kill(i, f"its tensor-parallel rank {instance.name} died")

    def _set_down(self, index: int) -> None:
        """Instance `index` (every rank of its TP group) takes no new requests."""
        instance = self.plan.instances[index]
        for i, other in enumerate(self.plan.instances):
            same = (other.process, other.replica) == (instance.process, instance.replica)
            if same and self._states[i] is InstanceState.UP:
                self._states[i] = InstanceState.RESTARTING
        self.coordinator.binder.set_up(instance.process, instance.replica, False)

    def _fail_instance(self, index: int, reason: str) -> None:
        instance = self.plan.instances[index]
        for i, other in enumerate(self.plan.instances):  # every rank of a TP group
            if (other.process, other.replica) == (instance.process, instance.replica):
                self._states[i] = InstanceState.FAILED
        log.error("stage process %s failed for good: %s", instance.name, reason)
        self._notify("failed", instance.name, reason)

    async def _restart(self, index: int, delay: float) -> None:
        instance = self.plan.instances[index]
        died_at = time.monotonic()
        assert self._group is not None  # restarts are of stage processes, never inline
        try:
            await asyncio.sleep(delay)  # the backoff: a timer, not a synchronization
            await self._group.restart(index)
        except PipelineError as exc:
            # its exit (if any) went through _instance_died, which scheduled the next try
            log.error("restarting %s failed: %s", instance.name, exc)
            return
        finally:
            if self._restarts.get(index) is asyncio.current_task():
                del self._restarts[index]
        self._states[index] = InstanceState.UP
        self.coordinator.binder.set_up(instance.process, instance.replica, True)
        self.restarts[instance.name] += 1
        down_s = time.monotonic() - died_at
        log.warning("stage process %s restarted (down %.2f s)", instance.name, down_s)
        self._notify("restart", instance.name, f"{down_s:.3f}")

    def _stage_timed_out(self, message: StageTimedOut) -> None:
        failed = self.coordinator.timed_out(message.keys, message.stage, message.timeout_s)
        self.timeouts[message.stage] += failed
        for _ in range(failed):
            self._notify("timeout", message.stage, message.instance)
        if message.overran and self._group is not None:
            index = next(i for i, x in enumerate(self.plan.instances) if x.name == message.instance)
            self._group.kill(index, f"stage {message.stage} overran its timeout_s")

    def _notify(self, event: str, subject: str, detail: str) -> None:
        for observer in self.supervision_observers:
            try:
                observer(event, subject, detail)
            except Exception:  # a metrics bug must not break supervision
                log.exception("supervision observer %r failed", observer)

    def _broken(self, message: str) -> None:
        log.error("pipeline unhealthy: %s", message)
        self._unhealthy = message
        self.coordinator.close(f"pipeline unhealthy: {message}")
