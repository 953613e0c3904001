"""Loading a stage's backend class from its file and checking it fits the stage descriptor."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from typing import Any

from omni_server.backend import StageConfigError
from omni_server.compiler.plan import SchedulerKind, StageSpec

_loads = itertools.count()


def load_backend(spec: StageSpec) -> Any:
    """A new instance of the stage's backend class (not yet initialized).

    Every load executes the file afresh as its own module, so two hosts in one process (inline
    placement, replicas) never share module-level state, as separate processes would not.
    """
    ref = spec.backend
    module_name = f"omni_stage_{spec.name}_{next(_loads)}"
    loader_spec = importlib.util.spec_from_file_location(module_name, ref.file)
    if loader_spec is None or loader_spec.loader is None:
        raise StageConfigError(f"backend file {ref.file} cannot be imported")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # dataclasses and pickle look modules up here
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    cls = getattr(module, ref.class_name, None)
    if not isinstance(cls, type):
        raise StageConfigError(f"{ref.file} defines no class {ref.class_name!r}")
    backend = cls()
    _check_methods(spec, backend)
    return backend


# what each scheduler kind calls on the backend (docs/backends.md)
_NEEDED = {
    SchedulerKind.SINGLE: ("execute",),
    SchedulerKind.BATCH: ("execute",),
    SchedulerKind.STREAM: ("generate",),
    SchedulerKind.AR: ("add", "step", "abort"),
}


def _check_methods(spec: StageSpec, backend: Any) -> None:
    cls = type(backend).__name__
    for needed in _NEEDED[spec.scheduler.kind]:
        if not callable(getattr(backend, needed, None)):
            raise StageConfigError(
                f'scheduler kind "{spec.scheduler.kind}" needs a method {needed}() on {cls}'
            )
    for role, name in (("route", spec.route), ("merge", spec.merge)):
        if name and not callable(getattr(backend, name, None)):
            raise StageConfigError(f"{role} = {name!r} but {cls} has no method {name}()")
