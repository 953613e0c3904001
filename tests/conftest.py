"""Suite-wide rules: the slow tier, and guards that nothing the tests start may outlive them.

Tiers: `pytest -m "not slow"` is the fast tier for development; CI runs everything. Slow tests
carry `@pytest.mark.slow` where they are written (ring stress, Whisper, the browser, the bench
end to end, the voice through runtime processes, one interpreter per module), and every test
that needs one of the expensive things in SLOW_FIXTURES is slow by the rule below.

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

SLOW_FIXTURES = frozenset(
    {
        # a real server on the embedded repository: its stage processes import onnxruntime and
        # load the voice (and Whisper), and every request synthesizes real speech
        "server",
        "server_url",
        # the real SmolLM2 (its GGUF read, weights dequantized) and transformers' reference model
        "gguf",
        "smol_model",
        "hf_model",
        "hf_tokenizer",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # fixturenames is the closure: a fixture built on one of these is slow too
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


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
