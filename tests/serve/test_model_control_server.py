"""Model control end to end: `omni-server --model-control-mode explicit|poll` as a real process,
Triton's repository API over HTTP, speech streamed with the official `openai` client.

The voice is the level stand-in (tests/fixtures/level_voice.py): each 10 ms chunk is PCM at one
constant value, its `level` parameter, so every stream says which version made it and a stream
that crossed a swap would show two values.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from openai import OpenAI

from tests.fixtures import FIXTURES
from tests.helpers.proc import SHM, WORKER_MODULE, alive, argv, descendants, run_segments
from tests.helpers.repo import make_repo, toml
from tests.helpers.server import ROOT, ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]  # real servers and stage processes

CHUNK_BYTES = 480  # one 10 ms chunk of 24 kHz s16le
CHUNKS = 20


def _voice(level: int, extra: str = "") -> str:
    return (
        toml(f"""
        backend = "LevelVoice"
        terminal = true
        [scheduler]
        kind = "stream"
        [parameters]
        level = {level}
        chunks = {CHUNKS}
        pause_s = 0.03
        """)
        + extra
    )


def _repo(root: Path) -> Path:
    return make_repo(
        root,
        stages={"voice": _voice(100), "other": _voice(5)},
        repository=toml("""
            [models.speaker]
            entry = "voice"
            tasks = ["speech"]
            voices = ["v"]
            [models.quiet]
            entry = "other"
            tasks = ["speech"]
            voices = ["v"]
            """),
        models={"voice": FIXTURES / "level_voice.py", "other": FIXTURES / "level_voice.py"},
    )


def _post(server: ServerProcess, path: str, body: dict | None = None, key: str | None = None):
    data = json.dumps(body or {}).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(server.url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _index(server: ServerProcess) -> dict[str, dict]:
    status, entries = _post(server, "/v2/repository/index")
    assert status == 200, entries
    return {e["name"]: e for e in entries}


def _workers(server: ServerProcess) -> dict[int, tuple[Path, str]]:
    """pid -> (run directory, run id) of every stage process of the server now."""
    found = {}
    for pid in descendants(server.proc.pid):
        args = argv(pid)
        if WORKER_MODULE in args[:-2]:
            at = args.index(WORKER_MODULE)
            found[pid] = (Path(args[at + 1]), args[at + 2])
    return found


def _speak(client: OpenAI, model: str = "speaker") -> int:
    """One streamed request; its level (the one sample value of all its audio)."""
    with client.audio.speech.with_streaming_response.create(
        model=model, voice="v", input="hello", response_format="pcm"
    ) as response:
        audio = b"".join(response.iter_bytes())
    assert len(audio) == CHUNKS * CHUNK_BYTES, f"a stream came back cut: {len(audio)} bytes"
    levels = set(np.frombuffer(audio, dtype="<i2").tolist())
    assert len(levels) == 1, f"one stream, one version; got levels {sorted(levels)}"
    return levels.pop()


class Load:
    """`n` clients streaming speech in a loop; each result is (started, finished, level) or
    the exception it raised."""

    def __init__(self, url: str, n: int = 4, model: str = "speaker") -> None:
        self.results: list[tuple[float, float, int] | BaseException] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(url, model), daemon=True) for _ in range(n)
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _run(self, url: str, model: str) -> None:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                level = _speak(client, model)
            except BaseException as exc:  # noqa: BLE001 (every failure is counted by the test)
                self.results.append(exc)
            else:
                self.results.append((started, time.monotonic(), level))

    def failures(self) -> list[BaseException]:
        return [r for r in self.results if isinstance(r, BaseException)]

    def wait_for(self, n: int) -> None:
        deadline = time.monotonic() + 120
        while len(self.results) < n and time.monotonic() < deadline:
            time.sleep(0.05)


def _until_all_reached_the_pipeline(server: ServerProcess, results: list, n: int) -> None:
    """Until each of `n` streams is in the speaker's pipeline or done (each takes ~0.6 s):
    not a fixed sleep, which a loaded machine outruns before the requests are sent."""
    deadline = time.monotonic() + 60
    while True:
        done = len(results)  # read before the gauge: a stream ending in between is not lost
        text = server.metrics()
        found = re.search(r'omni_requests_in_flight\{model="speaker"\} ([0-9.]+)', text)
        if done + (float(found.group(1)) if found else 0) >= n:
            return
        assert time.monotonic() < deadline, f"{done} done, gauge {found}: {server.log_tail()}"
        time.sleep(0.02)


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 60
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), f"old processes still running: {pids}"


def test_reload_under_streamed_load_drops_nothing(tmp_path):
    root = _repo(tmp_path / "repo")
    with ServerProcess.start(
        root, tmp_path / "server.log", "--model-control-mode", "explicit", "--load-model", "*"
    ) as server:
        old = _workers(server)
        index = _index(server)
        assert index["speaker"]["state"] == "READY"
        first_version = index["speaker"]["version"]
        quiet_version = index["quiet"]["version"]
        with Load(server.url, 4) as load:
            load.wait_for(8)
            (root / "voice" / "stage.toml").write_text(_voice(200))
            status, body = _post(server, "/v2/repository/models/speaker/load")
            swapped = time.monotonic()
            assert (status, body) == (200, None)
            load.wait_for(len(load.results) + 8)
        assert load.failures() == [], load.failures()[:3]
        done = [r for r in load.results if isinstance(r, tuple)]
        assert {level for *_, level in done} == {100, 200}  # streams ran on both versions
        assert all(level == 200 for started, _, level in done if started > swapped)
        index = _index(server)
        assert index["speaker"]["version"] != first_version
        assert index["quiet"]["version"] == quiet_version  # its group did not change
        # the old voice process stopped once its streams ended; the other model's never did
        now = _workers(server)
        voice_old = [p for p in old if p not in now]
        assert len(voice_old) == 1
        _wait_gone(voice_old)
        assert len(now) == 2 and len(set(now) & set(old)) == 1  # one new, one kept
        old_dir, old_run = old[voice_old[0]]
        assert not old_dir.exists()
        assert not [s for s in run_segments(old_run) if (SHM / s).exists()]


def test_failed_reloads_keep_the_old_version_serving(tmp_path):
    root = _repo(tmp_path / "repo")
    with ServerProcess.start(
        root, tmp_path / "server.log", "--model-control-mode", "explicit", "--load-model", "*"
    ) as server:
        version = _index(server)["speaker"]["version"]
        with Load(server.url, 2) as load:
            load.wait_for(2)
            (root / "voice" / "stage.toml").write_text(
                _voice(300).replace("terminal = true", "terminal = 3")
            )
            status, body = _post(server, "/v2/repository/models/speaker/load")
            assert status == 400, body
            assert "stage.toml" in body["error"]["message"]
            assert "terminal" in body["error"]["message"]
            entry = _index(server)["speaker"]
            assert (entry["state"], entry["version"]) == ("READY", version)
            assert "terminal" in entry["reason"]

            (root / "voice" / "stage.toml").write_text(_voice(300, "fail_initialize = true\n"))
            status, body = _post(server, "/v2/repository/models/speaker/load")
            assert status == 500, body
            assert "fail_initialize" in body["error"]["message"]
            entry = _index(server)["speaker"]
            assert (entry["state"], entry["version"]) == ("READY", version)
            assert "failed to start" in entry["reason"]
            load.wait_for(len(load.results) + 4)
        assert load.failures() == [], load.failures()[:3]
        assert {r[2] for r in load.results} == {100}  # the old version answered every request
        status, ready = _post(server, "/v2/repository/index", {"ready": True})
        assert status == 200 and {e["name"] for e in ready} == {"speaker", "quiet"}


def test_unload_lets_running_streams_finish_then_leaves_nothing(tmp_path):
    root = _repo(tmp_path / "repo")
    with ServerProcess.start(
        root, tmp_path / "server.log", "--model-control-mode", "explicit", "--load-model", "*"
    ) as server:
        workers = _workers(server)
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        results: list[int | BaseException] = []

        def speak() -> None:
            try:
                results.append(_speak(client))
            except BaseException as exc:  # noqa: BLE001 (the test counts it)
                results.append(exc)

        streams = [threading.Thread(target=speak) for _ in range(3)]
        for thread in streams:
            thread.start()
        _until_all_reached_the_pipeline(server, results, 3)
        status, _ = _post(server, "/v2/repository/models/speaker/unload")
        assert status == 200
        for thread in streams:
            thread.join(60)
        assert results == [100, 100, 100]
        models = [m.id for m in client.models.list()]
        assert models == ["quiet"]
        entry = _index(server)["speaker"]
        assert (entry["state"], entry["reason"]) == ("UNAVAILABLE", "unloaded")
        status, body = _post(
            server, "/v1/audio/speech", {"model": "speaker", "input": "x", "voice": "v"}
        )
        assert status == 404 and body["error"]["code"] == "model_not_found"
        gone = [p for p in workers if p not in _workers(server)]
        assert len(gone) == 1
        _wait_gone(gone)
        run_dir, run_id = workers[gone[0]]
        assert not run_dir.exists()
        assert not [s for s in run_segments(run_id) if (SHM / s).exists()]
        assert _speak(client, "quiet") == 5  # the other model serves on

        # loaded again from the files, through omni-client
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "omni_client",
                "models",
                "--url",
                server.url,
                "--load",
                "speaker",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr
        assert _speak(client) == 100


def _models_of(run_dir: Path) -> set[str]:
    """The models a generation serves: its run directory holds its pickled plan."""
    with (run_dir / "plan.pkl").open("rb") as f:
        return set(pickle.load(f).models)


def _left_of(workers: dict[int, tuple[Path, str]], pids: list[int]) -> list[str]:
    """What of these workers' generations still exists: live processes, run directories,
    shared-memory segments."""
    left = []
    for pid in pids:
        run_dir, run_id = workers[pid]
        left += [f"process {pid}"] if alive(pid) else []
        left += [str(run_dir)] if run_dir.exists() else []
        left += [s for s in run_segments(run_id) if (SHM / s).exists()]
    return left


def test_control_answers_after_clean_up_and_a_loading_model_is_503(tmp_path):
    """Issue 42.4, the probe's input: a reload of one model and an unload of another at once,
    under streamed load. Each answers only once what it replaced is gone: checked at the
    answer, no wait, no process, run directory or segment of the old generations is left.
    Then a model whose load is under way answers 503 `model_loading` with Retry-After (not
    404) and the index says LOADING, until it serves."""
    root = _repo(tmp_path / "repo")
    with ServerProcess.start(
        root, tmp_path / "server.log", "--model-control-mode", "explicit", "--load-model", "*"
    ) as server:
        old = _workers(server)
        serves = {pid: _models_of(run_dir) for pid, (run_dir, _) in old.items()}
        replaced = {
            "load": [p for p, models in serves.items() if "speaker" in models],
            "unload": [p for p, models in serves.items() if "quiet" in models],
        }
        assert all(len(pids) == 1 for pids in replaced.values()), serves
        answers: dict[str, tuple] = {}

        def call(name: str, path: str) -> None:
            status, body = _post(server, path)
            answers[name] = (status, body, _left_of(old, replaced[name]))  # at the answer

        with Load(server.url, 3) as load:
            load.wait_for(3)  # streams run on the old voice while it is replaced
            (root / "voice" / "stage.toml").write_text(_voice(200))
            calls = [
                threading.Thread(target=call, args=("load", "/v2/repository/models/speaker/load")),
                threading.Thread(
                    target=call, args=("unload", "/v2/repository/models/quiet/unload")
                ),
            ]
            for thread in calls:
                thread.start()
            for thread in calls:
                thread.join(120)
            load.wait_for(len(load.results) + 2)
        assert load.failures() == [], load.failures()[:3]
        assert answers["load"] == (200, None, []), answers
        assert answers["unload"] == (200, None, []), answers
        index = _index(server)
        assert (index["speaker"]["state"], index["quiet"]["state"]) == ("READY", "UNAVAILABLE")

        # a slow load (its initialize takes 3 s): the model is coming, not missing
        slow = {"parameters": {"config": {"stages.other.parameters.initialize_s": 3}}}
        loader = threading.Thread(
            target=lambda: answers.update(
                reload=_post(server, "/v2/repository/models/quiet/load", slow)
            )
        )
        loader.start()
        deadline = time.monotonic() + 60
        while _index(server)["quiet"]["state"] != "LOADING":
            assert time.monotonic() < deadline and loader.is_alive(), _index(server)
            time.sleep(0.05)
        speech = {"model": "quiet", "input": "x", "voice": "v", "response_format": "pcm"}
        request = urllib.request.Request(
            server.url + "/v1/audio/speech",
            data=json.dumps(speech).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 503
        assert int(refused.value.headers["Retry-After"]) > 0
        assert json.loads(refused.value.read())["error"]["code"] == "model_loading"
        loader.join(120)
        assert answers["reload"] == (200, None)
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert _speak(client, "quiet") == 5


def test_explicit_mode_starts_with_the_named_models_and_guards_the_api(tmp_path):
    root = _repo(tmp_path / "repo")
    key = "k-" + "x" * 20
    with ServerProcess.start(
        root,
        tmp_path / "server.log",
        "--model-control-mode",
        "explicit",
        "--load-model",
        "quiet",
        "--api-key",
        key,
    ) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        assert [m.id for m in client.models.list()] == ["quiet"]
        assert len(_workers(server)) == 1  # the speaker's voice process never started
        status, body = _post(server, "/v2/repository/index")
        assert status == 401, body  # the key guards the control API too
        status, entries = _post(server, "/v2/repository/index", key=key)
        index = {e["name"]: e for e in entries}
        assert index["speaker"] == {
            "name": "speaker",
            "state": "UNAVAILABLE",
            "reason": "not loaded",
        }
        status, body = _post(server, "/v2/repository/models/nope/load", key=key)
        assert status == 404 and "speaker" in body["error"]["message"]
        status, body = _post(
            server,
            "/v2/repository/models/speaker/load",
            {"parameters": {"config": {"stages.voice.parameters.level": 42}}},
            key=key,
        )
        assert status == 200, body
        assert _speak(client) == 42  # the load's config overrode the file
        # issue 42.2: one call may not fork more processes than this machine has cores
        workers = _workers(server)
        too_many = len(os.sched_getaffinity(0)) + 1
        status, body = _post(
            server,
            "/v2/repository/models/speaker/load",
            {"parameters": {"config": {"processes.voice.num_replicas": too_many}}},
            key=key,
        )
        assert status == 400, body
        assert body["error"]["code"] == "invalid_repository"
        assert "field 'processes.voice.num_replicas'" in body["error"]["message"]
        assert "CPU core" in body["error"]["message"]
        assert _workers(server) == workers  # nothing was started or stopped
        assert _speak(client) == 42  # the loaded version serves on
        listed = subprocess.run(
            [
                sys.executable,
                "-m",
                "omni_client",
                "models",
                "--url",
                server.url,
                "--api-key",
                key,
                "--index",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert listed.returncode == 0, listed.stderr
        lines = sorted(line.split("\t")[:2] for line in listed.stdout.splitlines())
        assert lines == [["quiet", "READY"], ["speaker", "READY"]]


def test_none_mode_refuses_control_and_the_api_can_be_disabled(tmp_path):
    root = _repo(tmp_path / "repo")
    with ServerProcess.start(root, tmp_path / "server.log") as server:
        index = _index(server)
        assert {e["state"] for e in index.values()} == {"READY"}
        status, body = _post(server, "/v2/repository/models/speaker/load")
        assert status == 400 and body["error"]["code"] == "not_allowed"
    with ServerProcess.start(root, tmp_path / "off.log", "--disable-repository-api") as server:
        status, body = _post(server, "/v2/repository/index")
        assert status == 404


def test_poll_mode_reloads_an_edit(tmp_path):
    root = _repo(tmp_path / "repo")
    period = 2.0
    with ServerProcess.start(
        root,
        tmp_path / "server.log",
        "--model-control-mode",
        "poll",
        "--repository-poll-secs",
        str(period),
    ) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert _speak(client) == 100
        version = _index(server)["speaker"]["version"]
        (root / "voice" / "stage.toml").write_text(_voice(250))
        edited = time.monotonic()
        # a scan sees the edit (one runs every period); the deadline is far past two periods,
        # as a loaded machine may delay the server's scans: poll mode is checked, not its clock
        while "generation 3 (speaker): starting" not in server.log():
            assert time.monotonic() - edited < 10 * period, "no scan saw the edit"
            time.sleep(0.1)
        deadline = time.monotonic() + 120
        while _index(server)["speaker"]["version"] == version:
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.1)
        assert _speak(client) == 250
        status, body = _post(server, "/v2/repository/models/speaker/unload")
        assert status == 400 and body["error"]["code"] == "not_allowed"  # poll: no explicit calls
