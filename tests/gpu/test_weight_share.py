"""Weight sharing between replicas (gpu/weights.py) on the CPU: real stage processes, one
shared-memory segment per group, followers mapping it read-only.

The groups and the start waves from compiled plans; the protocol in one process (leader and
follower sides, a tampered manifest refused); then real runtimes: two replicas alias one copy
(the follower never loads, its tensors sit in the leader's segment, mapped read-only), the
follower starts after its leader is ready, greedy engine outputs are equal, and a SIGKILLed
leader takes its follower down, fails the request in flight there, and both come back.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.plan import Plan
from omni_server.contracts import ChatInput, Message, Sampling
from omni_server.gpu.weights import (
    WeightShareError,
    WeightSharing,
    followers_of,
    leaders_of,
    sharing_groups,
    start_waves,
)
from omni_server.pipeline import PipelineError, Runtime
from omni_server.pipeline.supervision import SupervisionPolicy
from tests.fixtures import FIXTURES
from tests.helpers.proc import run_segments
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)

BACKENDS = FIXTURES / "shared_weights.py"


def _repo(
    root: Path,
    *,
    share: str = "on",
    replicas: int = 2,
    cls: str = "SharedTensors",
    parameters: str = "",
    extra_stage: str = "",
    processes: str = "",
) -> Plan:
    stage = f"""\
        backend = "model.py:{cls}"
        process = "lm"
        terminal = true
        {extra_stage}
        [engine]
        max_total_tokens = 256
        [parameters]
        {parameters}
        """
    repository = f"""\
        [server]
        weight_share = "{share}"
        [models.m]
        entry = "lm"
        tasks = ["chat"]
        [processes.lm]
        num_replicas = {replicas}
        {processes}
        """
    make_repo(root, {"lm": stage}, repository, {"lm": BACKENDS})
    return compile_repository(root)


def _weight_segments(run_id: str) -> list[str]:
    return [s for s in run_segments(run_id) if s.startswith(f"omni-{run_id}-w-")]


# ---- groups and order (pure) -----------------------------------------------------------------


def test_groups_follow_the_engine_stage_and_its_device(tmp_path):
    assert sharing_groups(_repo(tmp_path / "off", share="off", replicas=3)) == []
    plan = _repo(tmp_path / "cpu", replicas=3)
    (group,) = sharing_groups(plan)
    assert (group.stage, group.device, group.members) == ("lm", None, (0, 1, 2))
    assert group.name == "lm.lm.cpu"
    assert start_waves(plan) == [[0], [1, 2]]
    assert followers_of(plan, 0) == {1, 2} and leaders_of(plan, 2) == {0}

    # GPU: replicas repeating a GPU share it; a replica alone on its GPU loads its own
    gpu = _repo(
        tmp_path / "gpu",
        replicas=4,
        extra_stage=toml("""
            gpu = [0]
            gpu_memory_fraction = 0.2
        """),
        processes="replica_devices = [0, 1, 0, 0]",
    )
    (group,) = sharing_groups(gpu)
    assert (group.device, [gpu.instances[i].replica for i in group.members]) == (0, [0, 2, 3])
    assert group.name == "lm.lm.gpu0"
    assert start_waves(gpu) == [[0, 1], [2, 3]]
    assert leaders_of(gpu, 1) == set() and followers_of(gpu, 1) == set()

    # a stage without an [engine] table is never a sharing group
    make_repo(
        tmp_path / "plain",
        {
            "s": toml("""
                backend = "Echo"
                terminal = true
            """)
        },
        toml("""
            [server]
            weight_share = "on"
            [models.m]
            entry = "s"
            tasks = ["chat"]
            [processes.s]
            num_replicas = 2
        """),
    )
    plain = compile_repository(tmp_path / "plain")
    assert sharing_groups(plain) == [] and start_waves(plain) == [[0, 1]]


# ---- the protocol in one process -------------------------------------------------------------


def _tensors() -> dict[str, torch.Tensor]:
    emb = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "emb": emb,
        "head": emb,
        "ids": torch.arange(7),
        "h": torch.ones(3, dtype=torch.bfloat16),
    }


def test_a_follower_aliases_the_leader_and_refuses_a_tampered_manifest(tmp_path):
    plan = _repo(tmp_path / "repo")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    run_id = "0badc0de"
    leader = WeightSharing(plan, 0, run_dir, run_id)
    follower = WeightSharing(plan, 1, run_dir, run_id)
    try:
        led = leader.share("lm", "w", _tensors)
        assert led["emb"].data_ptr() == led["head"].data_ptr()  # tied: placed once
        assert all(leader.contains(t.data_ptr()) for t in led.values())
        (segment,) = _weight_segments(run_id)
        assert segment.startswith(f"omni-{run_id}-w-lm.lm.cpu-w-")

        def never() -> dict[str, torch.Tensor]:
            raise AssertionError("a follower never loads")

        followed = follower.share("lm", "w", never)
        assert {k: v.tolist() for k, v in followed.items()} == {
            k: v.tolist() for k, v in _tensors().items()
        }
        assert all(follower.contains(t.data_ptr()) for t in followed.values())
        assert followed["emb"].data_ptr() == followed["head"].data_ptr()
        # the leader's writes show through: the same memory, not a copy
        led["ids"][0] = 42
        assert int(followed["ids"][0]) == 42
        # a stage outside any group just loads
        assert set(follower.share("other", "w", _tensors)) == {"emb", "head", "ids", "h"}

        manifest_path = run_dir / "weights-lm.lm.cpu-w.json"
        good = json.loads(manifest_path.read_text())

        def refused(change, match: str) -> None:
            bad = json.loads(json.dumps(good))
            change(bad)
            manifest_path.write_text(json.dumps(bad))
            with pytest.raises(WeightShareError, match=match):
                WeightSharing(plan, 1, run_dir, run_id).share("lm", "w", never)

        def past_the_end(m):
            m["tensors"][0][1] = m["bytes"]

        def dtype(m):
            m["tensors"][0][3] = "object"

        def shape(m):
            m["tensors"][0][4] = [1000]

        def region(m):
            m["region"] = "omni-0badc0de-0-c"

        def device(m):
            m["device"] = 0

        refused(past_the_end, "not inside the region")
        refused(dtype, "not a tensor dtype")
        refused(shape, "is not 48 bytes")
        refused(region, "not this run's region")
        refused(device, "device 0")
        manifest_path.write_text(json.dumps(good))
        manifest_path.chmod(0o644)
        with pytest.raises(WeightShareError, match="mode 0600"):
            WeightSharing(plan, 1, run_dir, run_id).share("lm", "w", never)
        with pytest.raises(WeightShareError, match="key"):
            follower.share("lm", "../x", never)
    finally:
        follower.close()
        leader.close()
    assert _weight_segments(run_id) == []


# ---- real processes --------------------------------------------------------------------------


async def _both(runtime: Runtime, inputs: dict | None = None) -> dict[int, dict]:
    """One result from each of the two replicas (round robin)."""
    model = runtime.plan.models["m"]
    results = await asyncio.gather(
        *(runtime.submit(model, dict(inputs or {})).result() for _ in range(2))
    )
    by_replica = {r["replica"]: r for r in results}
    assert set(by_replica) == {0, 1}
    return by_replica


async def test_two_cpu_replicas_share_one_read_only_copy_started_and_stopped_in_order(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    plan = _repo(
        tmp_path / "repo",
        parameters=toml(f"""
            mib = 16
            load_s = 0.5
            marker_dir = "{markers}"
        """),
    )
    async with running(plan) as runtime:
        run_id = runtime.stage_processes.run_id
        by_replica = await _both(runtime)
        leader, follower = by_replica[0], by_replica[1]
        assert leader["loaded"] and not follower["loaded"]
        assert follower["sums"] == leader["sums"] and leader["tied"] and follower["tied"]
        assert all(follower["in_region"].values()) and all(leader["in_region"].values())
        # one segment holds the weights; the leader maps it read-write, the follower read-only
        (segment,) = _weight_segments(run_id)
        for name in leader["maps"]:
            assert tuple(leader["maps"][name]) == (f"/dev/shm/{segment}", "rw-s")
            assert tuple(follower["maps"][name]) == (f"/dev/shm/{segment}", "r--s")
        # order: the follower's initialize began after the leader's had finished
        leader_ready = float((markers / "r0-ready").read_text())
        assert float((markers / "r1-start").read_text()) > leader_ready
    # stop: the follower was done (and unmapped) before the leader was told to stop
    assert float((markers / "r1-finalize").read_text()) < float(
        (markers / "r0-finalize").read_text()
    )
    assert _weight_segments(run_id) == []


async def test_without_sharing_each_replica_loads_its_own(tmp_path):
    plan = _repo(tmp_path / "repo", share="off")
    async with running(plan) as runtime:
        by_replica = await _both(runtime)
        assert by_replica[0]["loaded"] and by_replica[1]["loaded"]
        assert not any(by_replica[1]["in_region"].values())
        assert by_replica[0]["sums"] == by_replica[1]["sums"]
        assert _weight_segments(runtime.stage_processes.run_id) == []


@pytest.mark.slow  # an engine in each of two replicas: costly for the fast tier
async def test_the_engine_on_shared_weights_gives_the_same_greedy_tokens(tmp_path):
    plan = _repo(tmp_path / "repo", cls="SharedEngine")
    async with running(plan) as runtime:
        prompt = {"prompt": [5, 17, 99, 3], "max_tokens": 12}
        by_replica = await _both(runtime, prompt)
        leader, follower = by_replica[0], by_replica[1]
        assert len(leader["tokens"]) == 12 and follower["tokens"] == leader["tokens"]
        assert follower["in_region"] and follower["map"][1] == "r--s"
        assert follower["map"][0] == leader["map"][0] != ""
        assert follower["embed_sum"] == leader["embed_sum"]


@pytest.mark.slow  # four process starts (two replicas, their restarts): costly for the fast tier
async def test_a_killed_leader_takes_its_follower_down_and_both_come_back(tmp_path):
    plan = _repo(tmp_path / "repo")
    policy = SupervisionPolicy(backoff_s=1.0)
    async with running(plan, supervision=policy) as runtime:
        events: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
        runtime.supervision_observers.append(lambda *e: events.put_nowait(e))
        model = plan.models["m"]
        run_id = runtime.stage_processes.run_id
        first = await _both(runtime)
        # a request in flight on the follower (round robin: the next one goes to r0, then r1)
        await runtime.submit(model, {}).result()
        held = runtime.submit(model, {"sleep": 30})
        await asyncio.sleep(0.2)
        old_leader = runtime.processes()["lm@r0"]
        os.kill(old_leader, signal.SIGKILL)
        with pytest.raises(PipelineError) as failed:
            await asyncio.wait_for(held.result(), 20)
        assert failed.value.code == "process_died" and "lm@r1" in failed.value.message

        deaths, restarts = {}, set()
        while len(deaths) < 2:
            kind, subject, detail = await asyncio.wait_for(events.get(), 60)
            assert kind == "death"
            deaths[subject] = detail
        assert deaths["lm@r0"] == "exit code -9"
        assert "weight-sharing leader lm@r0 died" in deaths["lm@r1"]
        # both replicas down until the leader is back (the backoff is 1 s): the model is
        # unavailable (503), not served from memory that is gone
        status, detail = runtime.health()
        assert status == "unavailable" and "no live replica of lm" in detail
        assert runtime.unavailable_for(model) is not None
        while len(restarts) < 2:
            kind, subject, detail = await asyncio.wait_for(events.get(), 60)
            if kind == "restart":
                restarts.add(subject)
        assert runtime.health()[0] == "ok"

        again = await _both(runtime)
        assert again[0]["loaded"] and not again[1]["loaded"]  # the new leader loaded again
        assert again[1]["sums"] == first[1]["sums"] and all(again[1]["in_region"].values())
        assert again[0]["pid"] != old_leader
        (segment,) = _weight_segments(run_id)  # the dead leader's region is gone
        assert segment.endswith(f"-{again[0]['pid']}")
        assert again[1]["maps"]["big"][0] == f"/dev/shm/{segment}"


def test_a_follower_writing_its_weights_faults_instead_of_changing_the_leaders(tmp_path):
    plan = _repo(tmp_path / "repo")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    run_id = "0badbeef"
    leader = WeightSharing(plan, 0, run_dir, run_id)
    try:
        led = leader.share("lm", "w", _tensors)
        # a follower in a process of its own (the write kills it: not this test's process)
        code = (
            "import sys, torch\n"
            "from pathlib import Path\n"
            "from omni_server.compiler.compiler import compile_repository\n"
            "from omni_server.gpu.weights import WeightSharing\n"
            f"plan = compile_repository(Path({str(tmp_path / 'repo')!r}))\n"
            f"follower = WeightSharing(plan, 1, Path({str(run_dir)!r}), {run_id!r})\n"
            "w = follower.share('lm', 'w', None)\n"
            "print(w['ids'].tolist(), flush=True)\n"
            "w['ids'][0] = 99\n"
            "print('wrote', flush=True)\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        assert run.stdout.splitlines()[0] == str(list(range(7)))  # it read the leader's values
        assert run.returncode == -signal.SIGSEGV and "wrote" not in run.stdout
        assert led["ids"].tolist() == list(range(7))
    finally:
        leader.close()


def test_the_engine_refuses_shared_weights_that_are_not_its_model():
    from omni_server.engine import Engine, EngineConfig
    from omni_server.engine.config import LlamaShape

    shape = LlamaShape(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
    )
    config = EngineConfig(max_total_tokens=64, device="cpu")

    def source(change):
        def shared(key, load):
            weights = dict(load())
            change(weights)
            return weights

        return shared

    def drop(w):
        del w["norm.weight"]

    def reshape(w):
        w["norm.weight"] = torch.ones(31)

    def retype(w):
        w["norm.weight"] = w["norm.weight"].double()

    for change, match in [(drop, "missing"), (reshape, r"\(31,\)"), (retype, "float64")]:
        with pytest.raises(ValueError, match=match):
            Engine.from_random(shape, config, weights=source(change))


THINKER = Path(__file__).resolve().parents[2] / "repository" / "thinker"


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_two_thinker_replicas_on_the_cpu_share_the_smollm2_weights(tmp_path):
    stage = (THINKER / "stage.toml").read_text().replace('stream_to = ["text_frontend"]\n', "")
    stage = stage.replace("max_total_tokens = 8192", "max_total_tokens = 1024")
    make_repo(
        tmp_path / "repo",
        {"thinker": stage},
        toml("""
            [server]
            weight_share = "on"
            [models.chat]
            entry = "thinker"
            tasks = ["chat"]
            [processes.thinker]
            num_replicas = 2
        """),
        {"thinker": THINKER / "model.py"},
    )
    plan = compile_repository(tmp_path / "repo")
    question = (Message("user", "What is the capital of France?"),)
    inputs = ChatInput(question, Sampling(max_tokens=12, temperature=0)).payload()
    async with running(plan) as runtime:
        run_id = runtime.stage_processes.run_id
        model = plan.models["chat"]
        answers = await asyncio.gather(
            *(runtime.submit(model, dict(inputs)).result() for _ in "ab")
        )
        pids = runtime.processes()
        (segment,) = _weight_segments(run_id)
        size = (Path("/dev/shm") / segment).stat().st_size
        maps = {name: _maps_of(pid, segment) for name, pid in pids.items()}
    assert answers[0]["text"] == answers[1]["text"] and answers[0]["text"]
    assert size > 500 << 20  # SmolLM2-135M in float32, once
    assert maps["thinker@r0"] == {"rw-s"} and maps["thinker@r1"] == {"r--s"}


def _maps_of(pid: int, segment: str) -> set[str]:
    """The permissions of `pid`'s mappings of /dev/shm/`segment`."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[1] for line in lines if line.endswith(f"/dev/shm/{segment}")}


def test_a_follower_waits_a_bounded_time_for_a_live_leader(tmp_path):
    plan = _repo(tmp_path / "repo")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    follower = WeightSharing(plan, 1, run_dir, "0badf00d", wait_s=0.2)
    with pytest.raises(WeightShareError, match=r"after 0.2 s \(no manifest\)"):
        follower.share("lm", "w", _tensors)
    leader = WeightSharing(plan, 0, run_dir, "0badf00d")
    try:
        leader.share("lm", "w", _tensors)
        path = run_dir / "weights-lm.lm.cpu-w.json"
        manifest = json.loads(path.read_text())
        manifest["leader"] = "999999999 1"  # a process that is not there
        path.write_text(json.dumps(manifest))
        with pytest.raises(WeightShareError, match=r"\(its leader is dead\)"):
            follower.share("lm", "w", _tensors)
    finally:
        leader.close()
