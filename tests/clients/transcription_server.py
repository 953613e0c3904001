"""A fake `/v1/audio/transcriptions` for the client tests, on a real socket (aiohttp, own thread).

A stand-in, labelled as such: it transcribes nothing. It records each multipart form it gets
(fields, the file's name and bytes, the headers) and answers the fixed TRANSCRIPT in the asked
`response_format`, or streamed as OpenAI's SSE events. It lets the client be tested against the
protocol while the real endpoint is being built; `test_transcribe.py` also runs one round trip
against the real server whenever it serves a transcription model.

Cues in the form: model "no-such-model" answers a 404 in OpenAI's error JSON; prompt "cut" ends
a stream after its first delta without the done event (the server's way to report a failure).
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

TRANSCRIPT = "Hello there. This is a test."
SEGMENTS = [
    {"id": 0, "start": 0.0, "end": 1.2, "text": " Hello there."},
    {"id": 1, "start": 1.4, "end": 3.0, "text": " This is a test."},
]
SRT = (
    "1\n00:00:00,000 --> 00:00:01,200\nHello there.\n\n"
    "2\n00:00:01,400 --> 00:00:03,000\nThis is a test.\n"
)
VTT = (
    "WEBVTT\n\n00:00:00.000 --> 00:00:01.200\nHello there.\n\n"
    "00:00:01.400 --> 00:00:03.000\nThis is a test.\n"
)


@dataclass
class Upload:
    fields: dict[str, list[str]]
    filename: str | None
    file: bytes
    headers: dict[str, str]


@dataclass
class FakeTranscriptionServer:
    uploads: list[Upload] = field(default_factory=list)
    url: str = ""
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _runner: web.AppRunner | None = None

    def __enter__(self) -> FakeTranscriptionServer:
        started = threading.Event()
        self._loop = asyncio.new_event_loop()

        def serve() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the fake transcription server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._thread is not None
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/audio/transcriptions", self._transcribe)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]  # the port the kernel chose
        self.url = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _transcribe(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        fields: dict[str, list[str]] = {}
        upload = None
        for name, value in form.items():
            if isinstance(value, web.FileField):
                upload = value
            else:
                fields.setdefault(name, []).append(str(value))
        assert upload is not None, "no file part"
        self.uploads.append(
            Upload(fields, upload.filename, upload.file.read(), dict(request.headers))
        )
        if fields["model"] == ["no-such-model"]:
            error = {"message": "model 'no-such-model' not found", "type": "invalid_request_error",
                     "param": "model", "code": "model_not_found"}  # fmt: skip
            return web.json_response({"error": error}, status=404)
        if fields.get("stream") == ["true"]:
            return await self._stream(request, cut=fields.get("prompt") == ["cut"])
        return self._whole(fields["response_format"][0], fields.get("timestamp_granularities[]"))

    def _whole(self, response_format: str, granularities: list[str] | None) -> web.Response:
        if response_format == "json":
            return web.json_response({"text": TRANSCRIPT})
        if response_format == "verbose_json":
            body: dict[str, Any] = {"task": "transcribe", "language": "english", "duration": 3.0,
                                    "text": TRANSCRIPT}  # fmt: skip
            if "segment" in (granularities or ["segment"]):
                body["segments"] = SEGMENTS
            if "word" in (granularities or []):
                body["words"] = [{"word": "Hello", "start": 0.0, "end": 0.4}]
            return web.json_response(body)
        text = {"text": TRANSCRIPT + "\n", "srt": SRT, "vtt": VTT}[response_format]
        return web.Response(text=text, content_type="text/plain")

    async def _stream(self, request: web.Request, *, cut: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in TRANSCRIPT.split(" "):
            delta = {"type": "transcript.text.delta", "delta": word + " "}
            # one event split over two writes: a client must reassemble it
            data = f"data: {json.dumps(delta)}\n\n".encode()
            await response.write(data[:7])
            await response.write(data[7:])
            if cut:
                assert request.transport is not None
                request.transport.close()  # what the real server does when a stream fails
                return response
        done = {"type": "transcript.text.done", "text": TRANSCRIPT}  # no usage, as the server
        await response.write(f"data: {json.dumps(done)}\n\n".encode())
        await response.write_eof()
        return response
