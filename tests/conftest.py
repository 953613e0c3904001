"""Suite-wide guards: nothing the tests start may outlive them.

After the whole session: no child process of the test runner is left, and no shared-memory
segment of ours (`/dev/shm/omni-*`) remains. A leak fails the run loudly instead of hiding in CI.
A new segment that a live process still maps belongs to a server running beside the suite (a
developer's, another suite's), not to us: once our own processes are gone, none of ours is mapped.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.proc import alive, descendants, describe, mapped_segments, segments


@pytest.fixture(scope="session", autouse=True)
def no_leaks_after_suite():
    before = segments()
    yield
    deadline = time.monotonic() + 10.0  # processes told to stop may take a moment to exit
    while time.monotonic() < deadline:
        left = [p for p in descendants(os.getpid()) if alive(p)]
        if not left:
            break
        time.sleep(0.1)
    leaked_segments = sorted(segments() - before - mapped_segments())
    problems = [f"process {p}: {describe(p)}" for p in left]
    problems += [f"/dev/shm/{name}" for name in leaked_segments]
    assert not problems, "leaked after the test suite:\n  " + "\n  ".join(problems)
