"""How messages travel between the coordinator and the stage hosts: one `Links` interface, two
ways to carry it.

- `ChannelLinks` (here): over a process's `channels.Endpoint` (SHM rings for data, ZMQ for
  control). The coordinator's side and every stage process use it.
- `InlineLinks` (`omni_server/pipeline/inline.py`): every host and the coordinator share one
  event loop in one process; a message is the object itself, handed over on the next loop turn.

The coordinator and the hosts only ever see `Links`, never the transport behind it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .channels import COORDINATOR, Endpoint
from .messages import CoordinatorMessage, HostMessage


class Links(Protocol):
    """Every call returns at once (never blocks the loop) and keeps order per destination."""

    def to_instance(self, index: int, message: HostMessage) -> None:
        """Data (payloads, chunks, end markers) to instance `index`, in order with its data."""

    def control(self, index: int, message: HostMessage) -> None:
        """Control (abort, shutdown) to instance `index`; never queues behind data."""

    def to_coordinator(self, message: CoordinatorMessage) -> None:
        """Data (chunks, results, failures) to the coordinator."""


class ChannelLinks:
    def __init__(
        self,
        endpoint: Endpoint,
        alive: Callable[[int], bool] = lambda _: True,
        name: Callable[[int], str] = str,
    ) -> None:
        """`alive(index)`: whether instance `index` may still hear control (a dead process's
        control socket would only queue the message). `name(index)`: the endpoint name of
        instance `index` now (a restarted instance has a new one: processes.endpoint_name)."""
        self._endpoint = endpoint
        self._alive = alive
        self._name = name

    def to_instance(self, index: int, message: HostMessage) -> None:
        self._endpoint.send_data(self._name(index), message)

    def control(self, index: int, message: HostMessage) -> None:
        if self._alive(index):
            self._endpoint.send_control(self._name(index), message)

    def to_coordinator(self, message: CoordinatorMessage) -> None:
        self._endpoint.send_data(COORDINATOR, message)
