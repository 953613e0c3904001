"""The talker (`kind = "ar"`, fed by the thinker's chunks): Qwen3-Omni's talker and code
predictor (models/qwen3_omni/talker.py) speaking what the thinker says, one frame a request a
step, the frames streamed to code2wav.

In: chunks holding a `TalkerOpening` (once, first) and `ThinkerTokens` (handoff.py). A request
starts once its opening and the thinker's first token are in: its prompt is built
(talker_input.opening_prompt, with the thinker's embedding table, the one thinker tensor this
stage loads) and prefilled. Then each step, for every request at once (talker_batch.py):
code 0 chosen, the frame completed by the code predictor and sent, and the talker fed the frame
plus the thinker text of that step. As transformers' generate does, step k hears the thinker's
token k + 1 (the first is in the prompt; the last, the end of turn, is never heard), then
tts_eos, then tts_pad: a request whose text is not in yet waits for it (late text is never
replaced by tts_pad), and a token is heard only once the next one (or the end) shows it is not
the last.

Out (to code2wav): {"frames": [[G codes]]} a step, the first chunk with "speech" (the request's
SpeechOptions: format, rate), the last with "finish_reason" ("stop": codec EOS; "length":
max_audio_seconds). An abort frees the request's KV blocks at once.

Voices: the checkpoint's speakers (config.json talker_config.speaker_id); another voice is an
InvalidRequest naming it and the speakers. Speed: 1.0 only (an InvalidRequest otherwise). A
thinker that ends before its first id sends the talker nothing (handoff.py): the request ends
here without a chunk, and code2wav sees its stream end alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_server.backend import (
    InvalidRequest,
    Request,
    RequestAborted,
    StageBackend,
    StageConfigError,
    StageContext,
    StepOutput,
)
from omni_server.engine import CheckpointError, EngineConfig, MemoryBudgetError
from omni_server.engine.families.qwen3_omni_talker.checkpoint import talker_engine
from omni_server.engine.families.qwen3_omni_talker.head import TalkerFeed, TalkerHead
from omni_server.engine.families.qwen3_omni_talker.model import Qwen3OmniTalker
from omni_server.engine.sampling import SamplingParams
from omni_server.engine.sequence import FinishReason, GenerationRequest, TokenEvent
from omni_server.models.qwen3_omni.config import Qwen3OmniConfig
from omni_server.models.qwen3_omni.folder import CheckpointFolderError, checkpoint_folder
from omni_server.models.qwen3_omni.handoff import TalkerOpening, ThinkerTokens
from omni_server.models.qwen3_omni.talker_batch import CodeSampling
from omni_server.models.qwen3_omni.talker_input import opening_prompt, speaker_id

log = logging.getLogger("omni_server.examples.qwen3_omni.talker")

FRAMES_PER_SECOND = 12.5


@dataclass(eq=False)
class Speech:
    """One request in the talker: what the thinker has sent, and its talker state once
    started. `received` holds every thinker id so far (the first is in the prompt)."""

    request: Request
    opening: TalkerOpening | None = None
    speaker: int = -1
    received: list[int] = field(default_factory=list)
    done: bool = False  # the thinker's last chunk came
    engine_id: str = ""
    feed: TalkerFeed | None = None  # once added to the engine
    fed: int = 0  # thinker ids heard by the feed so far (received[1:1 + fed])
    frames: int = 0  # frames sent
    ending: str | None = None  # "length": the finish chunk goes out next step
    sent: int = 0  # chunks sent to code2wav


class TalkerStage(StageBackend):
    def initialize(self, context: StageContext) -> None:
        params = context.parameters
        if context.device == "cpu":
            torch.set_num_threads(int(params.get("intra_op_threads", 1)))
        try:
            folder = checkpoint_folder(context.repository_parameters)
        except CheckpointFolderError as err:
            raise StageConfigError(str(err)) from err
        dtype = self._dtype(params.get("dtype", "auto"), context.device)
        warm = params.get("warm_graphs_tokens", 2048)
        if not isinstance(warm, int) or isinstance(warm, bool) or warm < 0:
            raise StageConfigError(
                f"parameters.warm_graphs_tokens must be an integer >= 0; found {warm!r}"
            )
        try:
            config = EngineConfig.from_table(
                {
                    **context.engine,
                    "device": context.device,
                    "dtype": dtype,
                    # on a GPU the stage's budget sizes (or checks) the KV cache
                    "gpu_memory_fraction": context.gpu_memory_fraction,
                }
            )
        except (TypeError, ValueError) as err:
            raise StageConfigError(f"[engine]: {err}") from err
        try:
            self.config = Qwen3OmniConfig.from_folder(folder)
            self.engine = talker_engine(folder, config)
        except (CheckpointError, MemoryBudgetError, OSError, KeyError, ValueError) as err:
            raise StageConfigError(f"checkpoint {folder}: {err}") from err
        model = self.engine.model
        assert isinstance(model, Qwen3OmniTalker) and isinstance(model.head, TalkerHead)
        self.model, self.head = model, model.head
        try:
            self.defaults = CodeSampling(
                temperature=float(params.get("temperature", 0.9)),
                top_k=int(params.get("top_k", 50)),
                top_p=float(params.get("top_p", 1.0)),
                repetition_penalty=float(params.get("repetition_penalty", 1.05)),
                predictor_top_k=int(params.get("predictor_top_k", 50)),
                predictor_top_p=float(params.get("predictor_top_p", 0.8)),
                suppress_eos=bool(params.get("ignore_eos", False)),
            )
            seconds = float(params.get("max_audio_seconds", 120.0))
        except (TypeError, ValueError) as err:
            raise StageConfigError(f"parameters: {err}") from err
        if not seconds > 0:
            raise StageConfigError(f"parameters.max_audio_seconds must be > 0; got {seconds}")
        self.max_frames = max(1, math.floor(seconds * FRAMES_PER_SECOND + 1e-6))
        # the decode graphs of every batch bucket at the contexts a speech reaches, captured
        # now (a capture while serving pauses every speech; 0: on first use); the code
        # predictor's graphs were captured with the engine (TalkerHead.capture_draws)
        lengths = self.engine.capture_graphs(warm)
        if lengths:
            log.info("talker: decode graphs captured at contexts %s", lengths)
        self._speeches: dict[int, Speech] = {}  # id(request) -> its speech, add() to its end
        self._by_engine_id: dict[str, Speech] = {}
        self._ids = itertools.count()

    @staticmethod
    def _dtype(value: Any, device: str) -> str:
        if value == "auto":
            return "bfloat16" if torch.device(device).type == "cuda" else "float32"
        if value not in ("float32", "bfloat16", "float16"):
            raise StageConfigError(
                f'parameters.dtype must be "auto", "float32", "bfloat16" or "float16"; '
                f"got {value!r}"
            )
        return str(value)

    @property
    def live_requests(self) -> int:
        """Requests this stage holds: 0 when every one ended or was aborted."""
        return len(self._speeches)

    def state(self, request: Request) -> TalkerFeed | None:
        """The request's talker input (its prompt, the text it heard); None before it joins
        the engine and once it ended or was aborted (tests observe the abort through it)."""
        speech = self._speeches.get(id(request))
        return speech.feed if speech is not None else None

    # ---- the ar contract (one compute thread: no locks) -----------------------------------

    def add(self, request: Request) -> None:
        self._speeches[id(request)] = Speech(request)

    def abort(self, request: Request) -> None:
        speech = self._speeches.pop(id(request), None)
        if speech is not None:
            self._drop(speech)
            log.info("talker: aborted %s after %d frames (%d requests running)",
                     request.id, speech.frames, len(self._speeches))  # fmt: skip

    def playback_seconds(self, chunk: dict[str, Any]) -> float:
        """How long a chunk's frames play (12.5 frames a second): the stage's lead metrics."""
        return len(chunk.get("frames", ())) / FRAMES_PER_SECOND

    def has_work(self) -> bool:
        """Some request can take a step without a new chunk (the thinker may be done long
        before the talker is): a finish to send, a prompt to prefill, a frame whose text is
        in."""
        return any(
            s.ending is not None
            or (s.feed is not None and (s.frames == 0 or s.feed.has_text(s.frames - 1)))
            for s in self._speeches.values()
        )

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for key, speech in list(self._speeches.items()):
            if speech.ending is not None:  # the frame cap came last step
                outputs.append(self._finish(speech, speech.ending))
                self._end(key, speech)
                continue
            try:
                self._take(speech)
                if speech.feed is None and speech.opening is not None and speech.received:
                    self._start(speech)
                self._hear(speech)
            except RequestAborted:
                continue  # its abort() comes before the next step
            except (TypeError, ValueError) as exc:  # InvalidRequest too: this request alone
                outputs.append(StepOutput(speech.request, error=exc))
                self._end(key, speech)
                continue
            if speech.done and speech.opening is None:  # an answer without a first id
                outputs.append(
                    StepOutput(
                        speech.request,
                        finished=True,
                        result={"finish_reason": "silent", "frames": 0},
                    )
                )
                self._end(key, speech)  # says nothing: code2wav sees the stream end alone
        for event in self.engine.step():
            outputs += self._event(event)
        return outputs

    # ---- one step's parts ------------------------------------------------------------------
    def _take(self, speech: Speech) -> None:
        chunks, ended = speech.request.take_stream()
        for chunk in chunks:
            if TalkerOpening.KEY in chunk:
                if speech.opening is not None:
                    raise ValueError("a second TalkerOpening for one request")
                speech.opening = self._checked(TalkerOpening.of(chunk))
            if ThinkerTokens.KEY in chunk:
                if speech.done:
                    raise ValueError("thinker tokens after the thinker's last chunk")
                tokens = ThinkerTokens.of(chunk)
                speech.received.extend(tokens.token_ids)
                speech.done = tokens.done
        if ended and not speech.done:
            speech.done = True  # the thinker's stream ended: nothing more to hear
        if speech.done and (speech.opening is None) != (not speech.received):
            raise ValueError(
                "the thinker sent a TalkerOpening without tokens, or tokens without one"
            )

    def _checked(self, opening: TalkerOpening) -> TalkerOpening:
        speech = opening.speech
        if speech.speed != 1.0:
            raise InvalidRequest(
                f"speed {speech.speed} is not supported by this voice (1.0 only)", param="speed"
            )
        try:
            speaker_id(self.config, speech.voice)
        except ValueError as err:
            raise InvalidRequest(str(err), param="voice") from err
        return opening

    def _start(self, speech: Speech) -> None:
        opening = speech.opening
        assert opening is not None
        options = opening.speech
        prompt = opening_prompt(
            self.config, self.model.text_embed, self.model, list(opening.prompt_ids),
            opening.multimodal_hidden, speech.received[0], speaker_id(self.config, options.voice),
        )  # fmt: skip
        sampling = self.defaults
        if options.temperature is not None:
            sampling = dataclasses.replace(self.defaults, temperature=options.temperature)
        feed = TalkerFeed(prompt[0], sampling)
        engine_id = f"{speech.request.id}#{next(self._ids)}"
        # the prompt's rows are given (the feed's); its ids only size it (codec pad)
        ids = [self.config.talker_ids.codec_pad] * prompt.shape[1]
        params = SamplingParams(seed=options.seed, max_tokens=self.max_frames)
        self.head.expect(engine_id, feed)
        try:
            self.engine.add(GenerationRequest(engine_id, ids, params))
        finally:
            self.head.forget(engine_id)  # taken by the add, or refused with it
        speech.feed, speech.engine_id = feed, engine_id
        self._by_engine_id[engine_id] = speech

    def _hear(self, speech: Speech) -> None:
        """Feed the thinker text in since the last step: step k hears token k + 1 once it is
        known not to be the last (then tts_eos, then tts_pad: the feed's end)."""
        feed = speech.feed
        if feed is None or feed.done:
            return
        heard = speech.received[1:-1]  # followed by another id: never the unheard last one
        if len(heard) > speech.fed:
            feed.hear(self.model.hear(heard[speech.fed :]))
            speech.fed = len(heard)
        if speech.done:
            feed.end()

    def _event(self, event: TokenEvent) -> list[StepOutput]:
        speech = self._by_engine_id.get(event.request_id)
        if speech is None or event.finish_reason is FinishReason.ABORT:
            return []  # aborted: its abort() dropped it
        outputs = []
        for frame in event.audio_frames:
            speech.frames += 1
            outputs.append(self._chunk(speech, {"frames": [frame]}))
        if event.finish_reason is FinishReason.STOP:  # codec EOS
            outputs.append(self._finish(speech, "stop"))
            self._end(id(speech.request), speech)
        elif event.finish_reason is not None:  # the frame cap: its finish goes out next step
            speech.ending = "length"
            self._by_engine_id.pop(speech.engine_id, None)
        return outputs

    def _end(self, key: int, speech: Speech) -> None:
        del self._speeches[key]
        self._drop(speech)

    def _drop(self, speech: Speech) -> None:
        """The request leaves the engine (its KV blocks freed now) and this stage's maps."""
        if self._by_engine_id.pop(speech.engine_id, None) is not None:
            self.engine.abort(speech.engine_id)
        speech.feed = None

    def _chunk(self, speech: Speech, chunk: dict[str, Any], finished: bool = False) -> StepOutput:
        if speech.sent == 0:
            assert speech.opening is not None
            chunk["speech"] = speech.opening.speech
        speech.sent += 1
        return StepOutput(speech.request, chunk=chunk, finished=finished,
                          result={"finish_reason": chunk.get("finish_reason"),
                                  "frames": speech.frames}
                          if finished else None)  # fmt: skip

    def _finish(self, speech: Speech, reason: str) -> StepOutput:
        return self._chunk(speech, {"frames": [], "finish_reason": reason}, finished=True)
