"""TTS engine (`kind = "ar"`): Higgs Audio v2 on the engine, one continuous batch over every
request, one frame of K codes a request a step (engine/families/higgs_audio_v2/frames.py: the
delay pattern, per codebook sampling, the audio stream's end).

In: the audio encoder's payload (prompt ids, the voice's frames, sampling, encoding). Chunks to
the vocoder: {"frames": [[K codes]]} a step (delay pattern and stream BOS / EOS included, as
the reference's generate() returns them); the first also carries "encoding", the last
"finish_reason" and "usage". The stage streams only (no `next`): the vocoder ends the request.

Playback-aware order: every frame plays 1/25 s, which the engine is told per request (it then
orders a full batch by the listeners' deadlines: new requests' first frames first, streams far
ahead yield; engine/deadline_order.py) and the stage by `playback_seconds` (each request's lead
in /metrics, as a stream stage's).

Sampling: the request's `temperature` (0: greedy) and `seed`, else the stage's parameters;
top-k / top-p and repetition-aware sampling from the parameters. An abort frees the request's
KV blocks at once (logged with the cache's free blocks).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from omni_server.audio.higgs_codec import HiggsCheckpointError, open_checkpoint
from omni_server.backend import (
    InvalidRequest,
    Request,
    StageBackend,
    StageConfigError,
    StageContext,
    StepOutput,
)
from omni_server.engine import (
    CheckpointError,
    ContextLengthExceeded,
    Engine,
    EngineConfig,
    GenerationRequest,
    MemoryBudgetError,
    SamplingParams,
)

log = logging.getLogger("omni_server.examples.higgs.tts_engine")

FRAMES_PER_SECOND = 25


class TTSEngine(StageBackend):
    def initialize(self, context: StageContext) -> None:
        params = context.parameters
        if context.device == "cpu":
            torch.set_num_threads(int(params.get("intra_op_threads", 1)))
        try:
            checkpoint = open_checkpoint(context.repository_parameters)
            config = EngineConfig.from_table(
                {
                    **context.engine,
                    "device": context.device,
                    "gpu_memory_fraction": context.gpu_memory_fraction,
                }
            )
            self.engine = Engine.from_checkpoint(checkpoint.folder, config)
        except (HiggsCheckpointError, CheckpointError, MemoryBudgetError) as err:
            raise StageConfigError(str(err)) from err
        except (TypeError, ValueError) as err:
            raise StageConfigError(f"[engine]: {err}") from err
        if getattr(self.engine.model, "audio", None) is None:  # the family's frame spec
            raise StageConfigError(f"checkpoint {checkpoint.folder}: not an audio model")
        self._warm_graphs(int(params.get("warm_graphs_tokens", 1024)))
        self.defaults = {key: params.get(key, value) for key, value in DEFAULTS.items()}
        self.max_frames = int(float(self.defaults["max_audio_seconds"]) * FRAMES_PER_SECOND)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}  # engine id -> request
        self._first: set[str] = set()  # engine ids whose first chunk is still to go
        self._encoding: dict[str, Any] = {}
        self._text: dict[str, str | None] = {}  # engine id -> the text spoken (None: no timing)

    def _warm_graphs(self, tokens: int) -> None:
        """Capture the decode graphs of every batch bucket at the contexts up to `tokens` now,
        not on first use while serving: each capture of the 3B backbone pauses every stream
        (a first wave of 16 or 64 requests would otherwise meet a bucket never seen). The
        engine's own warmup captures every context bucket up to its max_seq_len, far more than
        a TTS request (prompt + up to max_audio_seconds of frames) reaches here."""
        graphs = self.engine.runner.graphs
        if graphs is None or tokens <= 0:  # 0: captured on first use, as before
            return
        self.engine.warmup(capture_all_graphs=False)
        lengths = self.engine.capture_graphs(tokens)
        log.info("tts_engine: %d decode graphs captured (contexts %s)",
                 len(graphs.batch_buckets) * len(lengths), lengths)  # fmt: skip

    def add(self, request: Request) -> None:
        inputs = request.inputs
        engine_id = f"t{next(self._ids)}"
        prompt = list(inputs["prompt_ids"])
        # frames up to max_audio_seconds, within the context: a prompt that leaves no room for
        # one frame is the engine's context_length_exceeded
        room = self.engine.max_seq_len - len(prompt)
        generation = GenerationRequest(
            engine_id,
            prompt,
            self.sampling(inputs.get("sampling") or {}, max(1, min(self.max_frames, room))),
            audio_codes=inputs.get("audio_codes"),
            playback_seconds=1 / FRAMES_PER_SECOND,
        )
        try:
            self.engine.add(generation)
        except ContextLengthExceeded as err:
            raise InvalidRequest(str(err), code="context_length_exceeded", param="input") from err
        except ValueError as err:  # the voice's frames refused (count, width, codes)
            raise InvalidRequest(str(err), param="voice") from err
        self._requests[engine_id] = request
        self._first.add(engine_id)
        self._encoding[engine_id] = inputs["encoding"]
        self._text[engine_id] = inputs["text"]

    def sampling(self, asked: dict[str, Any], max_frames: int) -> SamplingParams:
        temperature = asked.get("temperature")
        window = int(self.defaults["ras_window"])  # 0: repetition-aware sampling off
        try:
            return SamplingParams(
                temperature=float(self.defaults["temperature"] if temperature is None
                                  else temperature),
                top_k=int(self.defaults["top_k"]),
                top_p=float(self.defaults["top_p"]),
                seed=asked.get("seed"),
                max_tokens=max_frames,
                ras_window=window,
                ras_max_repeat=int(self.defaults["ras_max_repeat"]) if window else 0,
                ignore_eos=bool(self.defaults["ignore_eos"]),
            )  # fmt: skip
        except (TypeError, ValueError) as err:
            raise InvalidRequest(f"sampling: {err}", param="temperature") from err

    def playback_seconds(self, chunk: dict[str, Any]) -> float:
        """How long a chunk's frames play (the delay pattern's edge frames count as whole)."""
        return len(chunk["frames"]) / FRAMES_PER_SECOND

    def step(self) -> list[StepOutput]:
        outputs = []
        for event in self.engine.step():
            request = self._requests.get(event.request_id)
            if request is None:
                continue  # an abort's final event
            chunk: dict[str, Any] = {"frames": event.audio_frames}
            if event.request_id in self._first:
                self._first.discard(event.request_id)
                chunk["encoding"] = self._encoding.pop(event.request_id)
                chunk["text"] = self._text.pop(event.request_id)
            output = StepOutput(request)
            if event.finished:
                del self._requests[event.request_id]
                chunk["finish_reason"] = str(event.finish_reason)
                chunk["usage"] = {
                    "prompt_tokens": event.prompt_tokens,
                    "completion_tokens": event.completion_tokens,
                }
                output.finished = True
                output.result = {"finish_reason": chunk["finish_reason"], **chunk["usage"]}
            output.chunk = chunk
            outputs.append(output)
        return outputs

    def abort(self, request: Request) -> None:
        for engine_id, held in list(self._requests.items()):
            if held is request:
                del self._requests[engine_id]
                self._first.discard(engine_id)
                self._encoding.pop(engine_id, None)
                self._text.pop(engine_id, None)
                self.engine.abort(engine_id)
                allocator = self.engine.cache.allocator
                log.info("tts_engine: aborted %s; KV blocks free %d/%d",
                         request.id, allocator.num_free, allocator.num_blocks)  # fmt: skip


DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 0.95,
    "ras_window": 7,
    "ras_max_repeat": 2,
    "max_audio_seconds": 120.0,
    "ignore_eos": False,
}
