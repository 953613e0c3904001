"""Model control: the repository's models loaded, reloaded and unloaded while the server runs.

`ModelControl` stands where a `Runtime` stands for the serving layer (`plan`, `ready`,
`health()`, `unavailable_for`, `submit`, the observers), and runs one `Generation` per group of
served models (`compiler.partition.groups`: models joined by a stage or a process they share).

    mode none      every model at start, never changed (the control calls are refused)
    mode explicit  the models named at start (`--load-model`, `*` for all), then only on request
    mode poll      every model; the repository is compiled again every `poll_s` and what
                   changed is reloaded (a development mode, as Triton's)

A load or reload compiles the repository as its files are now (the compiler stays the one
validation path), cuts the plan into groups, and for a group that differs from the generation
running it (its subplan or the files of its stage folders) starts a new generation beside the
old; when every new process is ready the group's models move to it in one step, and the old
generation drains (`Generation.drain`). A group that did not change keeps its generation. A
failure (a compile error, an `initialize` that raises, a process that dies while starting)
changes nothing that serves: the old generation keeps its models and the index shows why.

A call answers only once it is done, clean-up included: a load or reload once the new version
serves and every generation it replaced has drained and stopped (its processes exited, its run
directory and shared-memory segments gone); an unload once the same holds for what it unloaded.
A model being loaded is in the served plan's `loading` (`generation.ServedPlan`): requests
naming it are told to retry (503), not that it does not exist.

Invariant: `_serving` maps each served model to the one generation new requests of it go to;
it is replaced whole (never edited in place while a start is awaited), so a request admitted
in any loop turn sees one consistent set. Control calls run one at a time (`_lock`). A
generation is drained by one task at most (`_drains`): a second call that finds it draining
waits for that task rather than stopping it again (a second `Runtime.stop()` returns at once,
before the first has reaped the processes).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.partition import fingerprint, groups, subplan
from omni_server.compiler.plan import NO_GPU, ModelSpec, Plan
from omni_server.envelope import Payload
from omni_server.errors import PipelineError

from .coordinator import RequestHandle, StageObserver
from .generation import Generation, cleaned_up, config_overrides, served_plan
from .runtime import Health, Runtime

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 300.0  # the longest a drained generation waits for its requests


class ControlMode(StrEnum):
    NONE = "none"
    EXPLICIT = "explicit"
    POLL = "poll"


class ModelState(StrEnum):  # Triton's repository index states
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"


@dataclass(frozen=True)
class ModelStatus:
    state: ModelState
    reason: str = ""
    version: int | None = None  # the generation serving it


class ControlError(Exception):
    """A control call refused or failed; `status` is its HTTP status (400: the repository is
    invalid or the call is not allowed; 404: no such model; 500: the new version failed to
    start)."""

    def __init__(self, message: str, status: int, code: str) -> None:
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


class ModelControl:
    def __init__(
        self,
        repository: str | Path,
        *,
        plan: Plan | None = None,
        overrides: Sequence[str] = (),
        mode: ControlMode = ControlMode.NONE,
        load: Sequence[str] = (),
        poll_s: float = 15.0,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        runtime: Callable[[Plan], Runtime] = Runtime,
    ) -> None:
        """`plan`: the repository compiled with `overrides` (compiled at start when None);
        `load`: the models explicit mode starts with (`*`: all; none by default, as Triton);
        `runtime(plan)` makes each generation's runtime (tests pass their options)."""
        self.repository = Path(repository)
        self.mode = mode
        self.poll_s = poll_s
        self.stage_observers: list[StageObserver] = []
        self.supervision_observers: list[Callable[[str, str, str], None]] = []
        self._overrides = tuple(overrides)
        self._load_overrides: dict[str, tuple[str, ...]] = {}  # model -> its last load's
        self._initial = tuple(load)
        self._drain_timeout_s = drain_timeout_s
        self._make_runtime = runtime
        self._numbers = iter(range(1, 1 << 62))
        self._serving: dict[str, Generation] = {}
        self._status: dict[str, ModelStatus] = {}
        self._live: list[Generation] = []  # serving or draining
        self._drains: dict[Generation, asyncio.Task[int]] = {}  # one per draining generation
        self._lock = asyncio.Lock()
        self._poller: asyncio.Task[None] | None = None
        self._calls: set[asyncio.Future[None]] = set()  # load / unload calls under way
        self._state = "new"
        self._repo_plan: Plan | None = None
        self._first_plan = plan
        # every compile is for the machine the first plan was compiled for (device = "auto")
        self._machine = plan.machine if plan is not None else NO_GPU
        self.plan = served_plan(Path(repository), {})

    # ---- what the serving layer reads (as of a Runtime) ---------------------------------------

    @property
    def ready(self) -> bool:
        return self._state == "running"

    @property
    def healthy(self) -> bool:
        return self.health()[0] != "unavailable"

    def health(self) -> tuple[Health, str]:
        if self._state != "running":
            return "unavailable", f"the pipeline is {self._state}"
        generations = self._serving_generations()
        if not generations:
            return "ok", "no model is loaded"
        worst: Health = "ok"
        details = []
        for gen in generations:
            status, detail = gen.runtime.health()
            if status != "ok":
                details.append(detail)
                worst = status if worst != "unavailable" else worst
        return worst, "; ".join(details) or "every stage process is up"

    def unavailable_for(self, model: ModelSpec) -> str | None:
        gen = self._serving.get(model.id)
        if gen is None:
            return f"the model '{model.id}' is not loaded (see /v2/repository/index)"
        return gen.runtime.unavailable_for(gen.plan.models[model.id])

    def submit(
        self, model: ModelSpec, inputs: Payload, request_id: str | None = None
    ) -> RequestHandle:
        """Submit to the generation serving `model` now; the request stays on it to its end."""
        gen = self._serving.get(model.id)
        if gen is None:
            raise PipelineError(f"the model '{model.id}' is not loaded", code="unavailable")
        return gen.runtime.submit(gen.plan.models[model.id], inputs, request_id)

    def processes(self) -> dict[str, int]:
        """Instance name -> pid of every live stage process; a draining generation's names end
        in `~g<version>`."""
        serving = set(self._serving_generations())
        found: dict[str, int] = {}
        for gen in self._live:
            suffix = "" if gen in serving else f"~g{gen.number}"
            found.update({name + suffix: pid for name, pid in gen.runtime.processes().items()})
        return found

    def generations(self) -> dict[str, int]:
        """Served model -> the version (generation number) its new requests go to."""
        return {model: gen.number for model, gen in self._serving.items()}

    # ---- the control calls ---------------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Triton's repository index: every model of the repository with its state."""
        entries = []
        for name, status in self._status.items():
            if ready_only and status.state is not ModelState.READY:
                continue
            entry: dict[str, Any] = {"name": name, "state": status.state.value}
            if status.version is not None:
                entry["version"] = str(status.version)
            entry["reason"] = status.reason
            entries.append(entry)
        return entries

    async def start(self) -> None:
        """Load the initial models (all, or `load` in explicit mode); raises PipelineError when
        one fails to start (nothing is left running) and RepositoryError for a bad repository."""
        if self._state != "new":
            raise RuntimeError(f"model control already {self._state}")
        self._state = "starting"
        plan = self._first_plan
        if plan is None:
            plan = await asyncio.to_thread(
                compile_repository, self.repository, self._overrides, self._machine
            )
        self._remember(plan)
        wanted = set(plan.models)
        if self.mode is ControlMode.EXPLICIT and "*" not in self._initial:
            wanted = {check_model(plan, name) for name in self._initial}
        try:
            failures = await self._reconcile(plan, wanted)
            if failures:
                raise PipelineError("; ".join(sorted(set(failures.values()))), code="unavailable")
        except BaseException:
            await self.stop()
            raise
        self._state = "running"
        if self.mode is ControlMode.POLL:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def load(self, name: str, config: Mapping[str, Any] | None = None) -> None:
        """Load or reload `name` (and its group) from the files as they are now; `config`
        (dotted repository paths -> values) overrides fields for this load, and stays applied
        while other models load, until this model's next load. Raises ControlError."""
        self._allowed("load")
        await self._shielded(self._load(name, config))

    async def _load(self, name: str, config: Mapping[str, Any] | None) -> None:
        async with self._lock:
            known = self._repo_plan.model(name) if self._repo_plan is not None else None
            key = known.id if known is not None else name
            # a load without a config reads this model's fields from the files again
            overrides = {m: o for m, o in self._load_overrides.items() if m != key}
            if config is not None:
                overrides[key] = config_overrides(config)
            plan = await self._compile(overrides.values(), key)
            model = check_model(plan, name, control=True)
            self._load_overrides = overrides
            wanted = set(self._serving) | {model}
            failures = await self._reconcile(plan, wanted)
            if model in failures:
                raise ControlError(failures[model], 500, "load_failed")

    async def unload(self, name: str, *, unload_dependents: bool = False) -> None:
        """Stop serving `name` (with `unload_dependents`, every loaded model sharing a stage
        with it): new requests get 404, running ones finish, then processes no served model
        uses stop. Returns once they have."""
        self._allowed("unload")
        await self._shielded(self._unload(name, unload_dependents))

    async def _unload(self, name: str, unload_dependents: bool) -> None:
        async with self._lock:
            plan = self._repo_plan
            model = check_model(plan, name, control=True) if plan is not None else name
            if model not in self._serving:
                if model not in self._status:
                    raise ControlError(f"no model '{name}' in the repository", 404, "not_found")
                return  # not loaded: nothing to do (as Triton)
            gone = {model}
            if unload_dependents:
                stages = set(self._serving[model].plan.models[model].stages)
                gone |= {
                    m for m, gen in self._serving.items() if stages & set(gen.plan.models[m].stages)
                }
            for m in gone:
                self._status[m] = ModelStatus(ModelState.UNLOADING, "draining")
            serving = {m: g for m, g in self._serving.items() if m not in gone}
            await cleaned_up(self._install(serving))
            for m in gone:
                self._status[m] = ModelStatus(ModelState.UNAVAILABLE, "unloaded")

    async def stop(self) -> None:
        """Stop every generation (requests still running fail as unavailable); idempotent. A
        load under way is cancelled (its new generation stops itself)."""
        self._state = "stopped"
        calls = [*self._calls, *([self._poller] if self._poller is not None else [])]
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        self._serving = {}
        self.plan = served_plan(self.repository, {})
        await asyncio.gather(*(gen.runtime.stop() for gen in self._live), return_exceptions=True)
        await asyncio.gather(*self._drains.values(), return_exceptions=True)
        self._live.clear()

    # ---- inside ----------------------------------------------------------------------------

    async def _shielded(self, call: Coroutine[Any, Any, None]) -> None:
        """Run a control call to its end even when its caller is cancelled (an HTTP client
        that leaves, a client timeout): a reload half done is not undone for that. `stop()`
        cancels it."""
        task = asyncio.ensure_future(call)
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        await asyncio.shield(task)

    def _allowed(self, call: str) -> None:
        if self.mode is not ControlMode.EXPLICIT:
            raise ControlError(
                f"explicit model {call} is not allowed in model control mode '{self.mode}' "
                "(start the server with --model-control-mode explicit)",
                400,
                "not_allowed",
            )
        if self._state != "running":
            raise ControlError(f"the server is {self._state}", 503, "not_ready")

    async def _compile(self, extra: Iterable[tuple[str, ...]], name: str) -> Plan:
        overrides = [*self._overrides, *(o for group in extra for o in group)]
        try:
            plan = await asyncio.to_thread(
                compile_repository, self.repository, overrides, self._machine
            )
        except RepositoryError as exc:
            self._failed(name, str(exc))
            raise ControlError(str(exc), 400, "invalid_repository") from exc
        self._remember(plan)
        return plan

    def _remember(self, plan: Plan) -> None:
        """The latest good compile: its models are the index's (a model no longer in the
        repository leaves the index once it is unloaded)."""
        self._repo_plan = plan
        for model in plan.models:
            self._status.setdefault(model, ModelStatus(ModelState.UNAVAILABLE, "not loaded"))

    def _failed(self, name: str, reason: str) -> None:
        status = self._status.get(name)
        if status is not None:
            self._status[name] = ModelStatus(status.state, reason, status.version)

    async def _reconcile(self, plan: Plan, wanted: set[str]) -> dict[str, str]:
        """Serve exactly `wanted` from `plan`; returns model -> why its new version failed
        (those keep the generation they had, if any)."""
        serving: dict[str, Generation] = {}
        failures: dict[str, str] = {}
        for models, stages in groups(plan, wanted):
            fp = await asyncio.to_thread(fingerprint, plan, stages)
            gen = self._reusable(plan, models, stages, fp)
            if gen is None:
                gen = await self._start_generation(plan, models, stages, fp, failures)
            if gen is not None:
                serving.update(dict.fromkeys(models, gen))
            else:
                serving.update({m: self._serving[m] for m in models if m in self._serving})
        for model, reason in failures.items():
            self._failed(model, reason)
        drained = self._install(serving)
        for model, gen in serving.items():
            reason = self._status[model].reason if model in failures else ""
            self._status[model] = ModelStatus(ModelState.READY, reason, gen.number)
        # the call answers once the replaced generations are gone (their streams finished
        # there, up to the drain's bound), not while their processes and segments remain
        await cleaned_up(drained)
        return failures

    def _reusable(
        self, plan: Plan, models: frozenset[str], stages: frozenset[str], fp: str
    ) -> Generation | None:
        """A live serving generation that runs exactly this group's part of `plan`."""
        for gen in self._serving_generations():
            if gen.stages != stages or not models <= gen.models or gen.fingerprint != fp:
                continue
            if all(m in plan.models for m in gen.models) and gen.same_as(
                subplan(plan, gen.models, stages), fp
            ):
                return gen
        return None

    async def _start_generation(
        self,
        plan: Plan,
        models: frozenset[str],
        stages: frozenset[str],
        fp: str,
        failures: dict[str, str],
    ) -> Generation | None:
        sub = subplan(plan, models, stages)
        gen = Generation(next(self._numbers), models, stages, sub, fp, self._make_runtime(sub))
        for m in models:
            old = self._status[m]
            if m not in self._serving:
                self._status[m] = ModelStatus(ModelState.LOADING, "", old.version)
        self._publish()  # requests naming a loading model: 503, come back
        log.info("generation %d (%s): starting", gen.number, ", ".join(sorted(models)))
        try:
            await gen.start()
        except PipelineError as exc:
            log.error("generation %d failed to start: %s", gen.number, exc)
            for m in models:
                failures[m] = f"version {gen.number} failed to start: {exc}"
                if m not in self._serving:
                    self._status[m] = ModelStatus(ModelState.UNAVAILABLE, failures[m])
            self._publish()
            return None
        self._live.append(gen)
        gen.runtime.stage_observers.append(self._stage_observed)
        gen.runtime.supervision_observers.append(self._supervision_observed)
        log.info("generation %d ready after %.2f s", gen.number, gen.age_s)
        return gen

    def _install(self, serving: dict[str, Generation]) -> list[asyncio.Task[int]]:
        """Route new requests by `serving` (one step); drain the generations left out."""
        used = set(serving.values())
        order = list(self._repo_plan.models) if self._repo_plan is not None else []
        serving = dict(sorted(serving.items(), key=lambda mg: _position(order, mg[0])))
        self._serving = serving
        self._publish()
        tasks = []
        for gen in [g for g in self._live if g not in used]:
            task = self._drains.get(gen)
            if task is None and gen.runtime.ready:
                task = asyncio.get_running_loop().create_task(
                    gen.drain(self._drain_timeout_s, on_stopped=functools.partial(self._gone, gen))
                )
                self._drains[gen] = task
                task.add_done_callback(functools.partial(self._drained, gen))
            if task is not None:
                tasks.append(task)
        return tasks

    def _drained(self, gen: Generation, task: asyncio.Task[int]) -> None:
        del self._drains[gen]
        if not task.cancelled() and task.exception() is not None:
            log.error("generation %d failed to stop", gen.number, exc_info=task.exception())

    def _publish(self) -> None:
        """The served plan for the serving layer: the models served now and, beside them,
        those whose load is under way (`ServedPlan.loading`)."""
        known = self._repo_plan.models if self._repo_plan is not None else {}
        loading = {
            m: known[m]
            for m, status in self._status.items()
            if status.state is ModelState.LOADING and m in known and m not in self._serving
        }
        self.plan = served_plan(self.repository, self._serving, loading)

    def _gone(self, gen: Generation) -> None:
        if gen in self._live:
            self._live.remove(gen)

    def _serving_generations(self) -> list[Generation]:
        return list(dict.fromkeys(self._serving.values()))

    async def _poll(self) -> None:
        """Poll mode: compile again every `poll_s`; reload what changed, load what appeared,
        unload what went. A broken repository changes nothing (the index says why)."""
        while True:
            await asyncio.sleep(self.poll_s)  # the period: a timer, not a synchronization
            async with self._lock:
                try:
                    plan = await asyncio.to_thread(
                        compile_repository, self.repository, self._overrides, self._machine
                    )
                except RepositoryError as exc:
                    log.error("repository poll: %s", exc)
                    for model in self._serving:
                        self._failed(model, f"poll: {exc}")
                    continue
                self._remember(plan)
                for model in set(self._serving) - set(plan.models):
                    self._status[model] = ModelStatus(ModelState.UNAVAILABLE, "removed")
                failures = await self._reconcile(plan, set(plan.models))
                if failures:
                    log.error("repository poll: %s", "; ".join(sorted(set(failures.values()))))

    def _stage_observed(self, stage: str, queue_s: float, compute_s: float, lead_s: float) -> None:
        for observer in self.stage_observers:
            observer(stage, queue_s, compute_s, lead_s)

    def _supervision_observed(self, event: str, subject: str, detail: str) -> None:
        for observer in self.supervision_observers:
            observer(event, subject, detail)


def check_model(plan: Plan | None, name: str, *, control: bool = False) -> str:
    """The id of the repository's model `name` (id or alias); ControlError 404 (`control`) or
    RepositoryError when there is none."""
    spec = plan.model(name) if plan is not None else None
    if spec is not None:
        return spec.id
    known = ", ".join(plan.models) if plan is not None else "none"
    message = f"no model '{name}' in the repository; models: {known}"
    if control:
        raise ControlError(message, 404, "model_not_found")
    raise RepositoryError(message, field="--load-model")


def _position(order: list[str], model: str) -> int:
    return order.index(model) if model in order else len(order)
