"""Fixtures of the transport tests: unique ring names, and no /dev/shm or fd leak per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from omni_transport import unlink_leftovers


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    """A name prefix owned by one test; the test fails if a segment with it survives."""
    prefix = f"omni-test-{os.getpid()}-{uuid.uuid4().hex[:8]}-"
    yield prefix
    left = sorted(p.name for p in Path("/dev/shm").glob(prefix + "*"))
    unlink_leftovers(prefix)  # tidy up even when the test failed
    for name in left:  # a leftover with a live user (ours) is not a leftover: remove it
        Path("/dev/shm", name).unlink(missing_ok=True)
    assert not left, f"segments left in /dev/shm: {left}"


@pytest.fixture
def ring_name(shm_prefix: str) -> Callable[[], str]:
    counter = iter(range(1_000_000))
    return lambda: f"{shm_prefix}{next(counter)}"


@pytest.fixture
def no_fd_leak() -> Iterator[None]:
    before = open_fds()
    yield
    # the listing itself opens one fd, the same in both snapshots
    assert open_fds() - before == set(), "file descriptors leaked"
