"""One local two-node Ray cluster for the module, serving the embedded repository through Ray
Serve with two pipeline replicas, one per node (`ray.cluster_utils.Cluster`: every node is a
raylet of its own on this machine; Serve's proxy runs on the head node).

Everything Ray and the replicas write goes under one private temporary directory (Ray's
`temp_dir`, and TMPDIR, where the replicas' run directories go), and the proxy takes a free
port, so suites of other engineers on this machine never collide with this one. The voice runs
one replica per pipeline (`--processes.voice.num_replicas 1`) to keep the cluster at six stage
processes on two cores.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from omni_server.cluster.deployment import DEPLOYMENT_NAME, pipeline_app  # noqa: E402
from omni_server.cluster.resources import Scaling  # noqa: E402
from omni_server.serve.options import ServeOptions  # noqa: E402
from tests.helpers.proc import alive, descendants  # noqa: E402

REPOSITORY = Path(__file__).resolve().parents[2] / "repository"
OVERRIDES = ("--processes.voice.num_replicas", "1")
API_KEY = "cluster-test-key"
APP = "omni"
NODE_CPUS = 3  # one replica's plan: voice, thinker, asr
ENVIRONMENT = {
    "TMPDIR": "",  # set to the run's private directory
    # Serve's proxy sends every request to a replica on its own node while that one has room;
    # with the one proxy of this cluster, the worker's replica would then see no traffic
    "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServedCluster:
    cluster: Any
    url: str
    root: Path  # the private temp dir (Ray's and the replicas' TMPDIR)
    worker: Any  # the worker node (the head node holds the proxy and the other replica)
    stopped: bool = False
    run_ids: set[str] = field(default_factory=set)
    # this pytest's child processes from before the cluster (another fixture's server, such as
    # the session's embedded one): not the cluster's, so not what its shutdown must stop
    preexisting: frozenset[int] = frozenset()

    def processes(self) -> list[int]:
        """This pytest's descendants that are the cluster's (Ray's and its replicas' stages)."""
        others = {q for p in self.preexisting if alive(p) for q in [p, *descendants(p)]}
        return [p for p in descendants(os.getpid()) if p not in others]

    def running_replicas(self) -> int:
        status = serve.status().applications[APP].deployments[DEPLOYMENT_NAME]
        return int(status.replica_states.get("RUNNING", 0))

    def wait_for_replicas(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.running_replicas() != n:
            assert time.monotonic() < deadline, f"not {n} running replicas: {serve.status()}"
            time.sleep(0.5)

    def shutdown(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        try:
            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()
        finally:
            self.cluster.shutdown()


@pytest.fixture(scope="module")
def served() -> Iterator[ServedCluster]:
    root = Path(tempfile.mkdtemp(prefix="rb24-", dir="/tmp"))  # short: Ray's socket paths
    saved = {name: os.environ.get(name) for name in ENVIRONMENT}
    os.environ.update(ENVIRONMENT, TMPDIR=str(root))  # the raylets, their workers, the stages
    tempfile.tempdir = None  # re-read TMPDIR
    before = frozenset(descendants(os.getpid()))
    cluster = Cluster()
    handle = ServedCluster(cluster, "", root, None, preexisting=before)
    try:
        # no dashboard: a dozen processes less on two cores, and no fixed port (8265) to share
        cluster.add_node(num_cpus=NODE_CPUS, temp_dir=str(root / "ray"), include_dashboard=False)
        handle.worker = cluster.add_node(num_cpus=NODE_CPUS)
        ray.init(address=cluster.address, logging_level="WARNING")
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        app = pipeline_app(
            REPOSITORY,
            OVERRIDES,
            ServeOptions(api_key=API_KEY, allowed_hosts=frozenset({"127.0.0.1", "localhost"})),
            Scaling(num_replicas=2),
            max_replicas_per_node=1,
            health_check_period_s=2,
        )
        serve.run(app, name=APP, route_prefix="/")
        handle.url = f"http://127.0.0.1:{port}"
        yield handle
    finally:
        try:
            handle.shutdown()  # the last test has done it already, and checked what is left
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            tempfile.tempdir = None
            shutil.rmtree(root, ignore_errors=True)
