"""Running out of file descriptors is logged at most once a second, not once per failure."""

from __future__ import annotations

import errno
import logging
import socket
import subprocess
import sys
import time

import pytest

from omni_server.serve.log_throttle import ExhaustionFilter
from tests.helpers.server import ROOT, ServerProcess, free_port
from tests.serve.inline import stand_in_repo

pytestmark = pytest.mark.timeout(120)


def record(message: str, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("t", logging.ERROR, __file__, 1, message, None, exc_info)


def test_the_filter_passes_one_exhaustion_record_per_interval():
    throttle = ExhaustionFilter(interval_s=3600)
    emfile = OSError(errno.EMFILE, "Too many open files")
    assert throttle.filter(record("socket.accept() out of system resource", emfile))
    assert not any(throttle.filter(record("accept failed", emfile)) for _ in range(1000))
    assert not throttle.filter(record("[Errno 24] Too many open files: '/x'"))
    assert throttle.filter(record("an ordinary error"))  # other records are untouched
    assert throttle.filter(record("refused", OSError(errno.ECONNREFUSED, "refused")))
    throttle.interval_s = 0
    later = record("socket.accept() out of system resource", emfile)
    assert throttle.filter(later)
    assert "(1001 more like this suppressed)" in later.msg


LIMITED = """\
import resource, runpy, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (160, 160))
sys.argv = ["omni-server", *sys.argv[1:]]
runpy.run_module("omni_server", run_name="__main__")
"""


def test_a_server_out_of_descriptors_logs_little_and_recovers(tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-c", LIMITED, "--repo", str(stand_in_repo(tmp_path / "repo"))]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*command, "--port", str(port), "--idle-timeout", "2"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
    with ServerProcess(proc, f"http://127.0.0.1:{port}", log_path) as server:
        server.wait_ready()
        silent = []
        for _ in range(200):  # more than the descriptors left: accept() fails from here on
            silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(1.5)
        # the idle timeout closes the silent connections; the server serves again
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if server.get_json("/health/live")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        assert server.get_json("/health/live")[0] == 200
        for sock in silent:
            sock.close()
        text = server.log()
    failures = text.count("out of system resource")
    assert 1 <= failures <= 10, failures  # about one a second, not thousands
    # (the "N more like this suppressed" count rides the next line let through, so whether it
    # shows depends on how long the episode lasted: the filter's own test above checks it)
    assert len(text) < 100_000
