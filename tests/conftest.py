"""Suite-wide rules: the slow tier, and guards that nothing the tests start may outlive them.

Tiers: `pytest -m "not slow"` is the fast tier for development; CI runs everything. Tests marked
`gpu` (one CUDA GPU) and `gpu2` (two) skip where the GPUs are missing; docs/gpu.md runs them.
Slow tests carry `@pytest.mark.slow` where they are written (ring stress, Whisper, the
browser, the bench end to end, the voice through runtime processes, every module imported alone),
and every test that needs one of the expensive things in SLOW_FIXTURES is slow by the rule below.

One real server on the embedded repository (`embedded_server`) serves every test that needs
it (tests/serve, tests/clients, tests/bench): its start loads the voice, Whisper and SmolLM2 in
their stage processes, the costliest fixture of the suite. Tests that need another repository
or topology, or that stop or break their server, start their own.

After the whole session: no child process of the test runner is left, no shared-memory
segment of ours (`/dev/shm/omni-*`) remains, and no run directory (`$TMPDIR/omni-run-*`) that a
runtime of the session made is left with its owner gone. A leak fails the run loudly instead
of hiding in CI. A new segment that a live process still maps belongs to a server running
beside the suite (a developer's, another suite's), not to us: once our own processes are gone,
none of ours is mapped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.proc import (
    alive,
    descendants,
    describe,
    mapped_segments,
    orphaned,
    run_dirs,
    segments,
    served_repository,
)
from tests.helpers.server import EMBEDDED_REPO, ROOT, ServerProcess

SLOW_FIXTURES = frozenset(
    {
        # a real server on the embedded repository: its stage processes import onnxruntime and
        # load the voice (and Whisper), and every request synthesizes real speech
        "embedded_server",
        "server",
        "server_url",
        # the real SmolLM2 (its GGUF read, weights dequantized) and transformers' reference model
        "gguf",
        "smol_model",
        "hf_model",
        "hf_tokenizer",
    }
)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    gpus: int | None = None  # asked once, and only when a GPU test was collected
    for item in items:
        # fixturenames is the closure: a fixture built on one of these is slow too
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        # the GPU tiers: `gpu` needs one CUDA GPU, `gpu2` two; without them they skip, saying why
        needed = (
            2 if item.get_closest_marker("gpu2") else 1 if item.get_closest_marker("gpu") else 0
        )
        if needed:
            gpus = _gpu_count() if gpus is None else gpus
            if gpus < needed:
                reason = "needs a CUDA GPU" if needed == 1 else "needs two CUDA GPUs"
                item.add_marker(pytest.mark.skip(reason=f"{reason} ({gpus} found)"))


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """`python -m omni_server --repo repository`, shared by the whole session. Tests may use it
    but not stop it, break its processes or change what it serves; at the end it must exit 0 on
    SIGTERM leaving no process or segment (ServerProcess.stop checks)."""
    log = tmp_path_factory.mktemp("embedded-server") / "server.log"
    with ServerProcess.start(EMBEDDED_REPO, log) as running:
        yield running


def _ours(run_dir: Path, roots: tuple[Path, ...]) -> bool:
    """A run of this session: it served a repository of this checkout or of our temp dir (other
    suites on the machine make run directories in the same temp dir)."""
    repository = served_repository(run_dir)
    return repository is not None and any(repository.is_relative_to(r) for r in roots)


@pytest.fixture(scope="session", autouse=True)
def no_leaks_after_suite(tmp_path_factory):
    before, runs_before = segments(), run_dirs()
    roots = (ROOT, tmp_path_factory.getbasetemp())
    yield
    deadline = time.monotonic() + 10.0  # processes told to stop may take a moment to exit
    while time.monotonic() < deadline:
        left = [p for p in descendants(os.getpid()) if alive(p)]
        if not left:
            break
        time.sleep(0.1)
    leaked_segments = sorted(segments() - before - mapped_segments())
    new_runs = run_dirs() - runs_before
    leaked_runs = sorted(str(d) for d in new_runs if orphaned(d) and _ours(d, roots))
    problems = [f"process {p}: {describe(p)}" for p in left]
    problems += [f"/dev/shm/{name}" for name in leaked_segments]
    problems += [f"run directory {d}" for d in leaked_runs]
    assert not problems, "leaked after the test suite:\n  " + "\n  ".join(problems)
