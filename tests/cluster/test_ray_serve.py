"""The embedded repository served on a local two-node Ray cluster through Ray Serve's proxy
(conftest.py): the official `openai` client, a realtime spoken turn, a node lost under load,
and a shutdown that leaves nothing behind. The tests run in file order on one cluster; the
last one shuts it down."""

from __future__ import annotations

import asyncio
import io
import threading
import time
import wave
from dataclasses import dataclass

import httpx2
import pytest
from openai import OpenAI

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from omni_bench.wer import word_error_rate  # noqa: E402
from omni_client.errors import OmniError  # noqa: E402
from omni_client.talk import read_wav, talk  # noqa: E402
from tests.cluster.conftest import API_KEY, NODE_CPUS, ServedCluster  # noqa: E402
from tests.helpers.proc import alive, command_of, run_segments, worker_run_ids  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

QUESTION = "What is the capital of France?"
LONG_TEXT = " ".join(
    f"This is sentence number {n} of a long answer that keeps the voice busy for a while."
    for n in range(12)
)
REPLICA, NODE = "x-omni-replica", "x-omni-node"


def _client(served: ServedCluster) -> OpenAI:
    return OpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _speech_wav(served: ServedCluster, text: str) -> bytes:
    with _client(served).audio.speech.with_streaming_response.create(  # seeded: no dice roll
        model="tts-1", voice="alloy", input=text, response_format="wav", extra_body={"seed": 7}
    ) as response:
        return b"".join(response.iter_bytes())


def test_openai_client_through_the_proxy_reaches_both_replicas(served: ServedCluster) -> None:
    client = _client(served)
    nodes: set[str] = set()
    replicas: set[str] = set()
    # speech, streamed: the bytes arrive in more than one chunk, as the voice makes them
    with client.audio.speech.with_streaming_response.create(  # seeded: the voice's noise is fixed
        model="tts-1", voice="alloy", input=QUESTION, response_format="wav", extra_body={"seed": 7}
    ) as response:
        assert response.status_code == 200
        chunks = list(response.iter_bytes())
        replicas.add(response.headers[REPLICA])
        nodes.add(response.headers[NODE])
    audio = b"".join(chunks)
    with wave.open(io.BytesIO(audio)) as w:
        assert w.getframerate() == 22_050 and w.getnframes() > 11_025  # the voice's own rate
    # transcription of that audio
    raw = client.audio.transcriptions.with_raw_response.create(
        model="whisper-1", file=("question.wav", audio, "audio/wav")
    )
    replicas.add(raw.headers[REPLICA])
    nodes.add(raw.headers[NODE])
    assert word_error_rate([QUESTION], [raw.parse().text]) <= 0.2
    # chat
    chat = client.chat.completions.with_raw_response.create(
        model="smol-chat",
        messages=[{"role": "user", "content": "Say hello in one short sentence."}],
        max_tokens=16,
    )
    replicas.add(chat.headers[REPLICA])
    nodes.add(chat.headers[NODE])
    assert chat.parse().choices[0].message.content.strip()
    # more requests until both replicas (on both nodes) have answered
    for _ in range(40):
        if len(nodes) == 2:
            break
        models = client.models.with_raw_response.list()
        replicas.add(models.headers[REPLICA])
        nodes.add(models.headers[NODE])
    assert len(replicas) == 2 and len(nodes) == 2, (replicas, nodes)


def test_the_door_and_the_error_json_are_the_servers(served: ServedCluster) -> None:
    no_key = httpx2.post(
        f"{served.url}/v1/audio/speech",
        json={"model": "tts-1", "voice": "alloy", "input": "hi"},
        timeout=60,
    )
    assert no_key.status_code == 401
    assert set(no_key.json()["error"]) == {"message", "type", "param", "code"}
    bad = httpx2.post(
        f"{served.url}/v1/audio/speech",
        json={"model": "tts-1", "voice": "alloy", "input": ""},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "input"
    assert bad.headers[REPLICA]  # answered by a replica's own server, not by the proxy


def test_a_realtime_spoken_turn_over_the_proxys_websocket(served: ServedCluster) -> None:
    pcm = read_wav(_speech_wav(served, QUESTION))
    turn = asyncio.run(
        talk(
            pcm,
            base_url=served.url,
            api_key=API_KEY,
            instructions="Answer in one short sentence.",
            timeout=120,
        )
    )
    assert turn.status == "completed", turn
    assert word_error_rate([QUESTION], [turn.heard]) <= 0.2, turn.heard
    assert turn.answer.strip()
    assert len(turn.audio) > 24_000  # over half a second of 24 kHz PCM16
    with pytest.raises(OmniError):  # no key: the replica's server refuses the session
        asyncio.run(talk(pcm, base_url=served.url, timeout=60))


@dataclass
class Outcome:
    node: str = ""
    status: int = 0
    audio_bytes: int = 0
    completed: bool = False  # the whole body, its chunked end included
    error: str = ""


def _stream_speech(served: ServedCluster, out: Outcome, started: threading.Event) -> None:
    try:
        with httpx2.stream(
            "POST",
            f"{served.url}/v1/audio/speech",
            json={"model": "tts-1", "voice": "alloy", "input": LONG_TEXT, "response_format": "pcm"},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=120,
        ) as response:
            out.status, out.node = response.status_code, response.headers.get(NODE, "")
            for chunk in response.iter_bytes():
                out.audio_bytes += len(chunk)
                started.set()
            out.completed = response.status_code == 200
    except httpx2.HTTPError as exc:  # a cut stream: the failure the client must see
        out.error = type(exc).__name__
    finally:
        started.set()


def _speech_ok(served: ServedCluster) -> str | None:
    """The node that served one short speech request, or None if it failed."""
    try:
        r = httpx2.post(
            f"{served.url}/v1/audio/speech",
            json={
                "model": "tts-1",
                "voice": "alloy",
                "input": "Still here.",
                "response_format": "pcm",
            },
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60,
        )
    except httpx2.HTTPError:
        return None
    return r.headers.get(NODE) if r.status_code == 200 and r.content else None


def test_a_node_lost_under_load(served: ServedCluster) -> None:
    lost = served.worker.node_id
    served.run_ids |= worker_run_ids(served.processes())
    outcomes = [Outcome() for _ in range(6)]
    started = [threading.Event() for _ in outcomes]
    threads = [
        threading.Thread(target=_stream_speech, args=(served, o, s), daemon=True)
        for o, s in zip(outcomes, started, strict=True)
    ]
    for t in threads:
        t.start()
    for s in started:
        assert s.wait(120)
    served.cluster.remove_node(served.worker, allow_graceful=False)
    for t in threads:
        t.join(180)
        assert not t.is_alive(), "a request outlived its node by minutes"
    on_lost = [o for o in outcomes if o.node == lost]
    kept = [o for o in outcomes if o.node and o.node != lost]
    assert on_lost and kept, outcomes
    # the requests on the surviving node went on to their end
    assert all(o.completed and o.audio_bytes > 0 for o in kept), kept
    # those bound to the lost replica that were still streaming were cut, not faked complete
    assert any(not o.completed for o in on_lost), on_lost
    assert all(o.completed or o.error or o.status >= 500 for o in on_lost), on_lost
    # service goes on on the other replica, while Serve brings the lost one back on a new node
    deadline = time.monotonic() + 60
    while _speech_ok(served) is None:
        assert time.monotonic() < deadline, "no speech served after the node was lost"
    served.worker = served.cluster.add_node(num_cpus=NODE_CPUS)
    served.wait_for_replicas(2, timeout=300)
    nodes = {_speech_ok(served) for _ in range(30)}
    assert served.worker.node_id in nodes, nodes


def test_shutdown_leaves_nothing_behind(served: ServedCluster) -> None:
    """The last test: it stops the cluster the others used."""
    ours = served.processes()
    served.run_ids |= worker_run_ids(ours)
    assert served.run_ids, "no stage process was found under the cluster's raylets"
    serve.shutdown()
    assert ray.util.list_named_actors(all_namespaces=True) == []  # controller, proxy, replicas
    served.shutdown()
    # Ray's own processes (raylets, GCS, workers) may take a while to go on a loaded 2-core
    # machine: the wait is long, the check exact
    deadline = time.monotonic() + 120
    while any(alive(p) for p in ours) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [(p, command_of(p)) for p in ours if alive(p)] == []
    assert [s for r in sorted(served.run_ids) for s in run_segments(r)] == []
    assert sorted(p.name for p in served.root.glob("omni-run-*")) == []
