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
max_audio_seconds). An abort frees the request's KV cache at once.

Voices: the checkpoint's speakers (config.json talker_config.speaker_id); another voice is an
InvalidRequest naming it and the speakers. Speed: 1.0 only (an InvalidRequest otherwise). A
thinker that ends before its first id sends the talker nothing (handoff.py): the request ends
here without a chunk, and code2wav sees its stream end alone.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omni_server.backend import (
    InvalidRequest,
    Request,
    RequestAborted,
    StageBackend,
    StageConfigError,
    StageContext,
    StepOutput,
)
from omni_server.models.qwen3_omni import talker_batch
from omni_server.models.qwen3_omni.config import Qwen3OmniConfig
from omni_server.models.qwen3_omni.handoff import TalkerOpening, ThinkerTokens
from omni_server.models.qwen3_omni.talker import Talker
from omni_server.models.qwen3_omni.talker_batch import CodeSampling, SpeechState
from omni_server.models.qwen3_omni.talker_input import opening_prompt, speaker_id, tts_specials
from omni_server.models.qwen3_omni.weights import CheckpointWeights

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
    state: SpeechState | None = None
    sent: int = 0  # chunks sent to code2wav


def checkpoint_folder(parameters: Any) -> Path:
    value = parameters.get("checkpoint")
    if not isinstance(value, str) or not value:
        raise StageConfigError(
            "parameters.checkpoint is not set: serve with --parameters.checkpoint DIR "
            "(a Qwen3-Omni checkpoint folder)"
        )
    folder = Path(value).expanduser().resolve()
    if not folder.is_dir():
        raise StageConfigError(f"checkpoint {folder}: no such folder")
    return folder


class TalkerStage(StageBackend):
    def initialize(self, context: StageContext) -> None:
        params = context.parameters
        if context.device == "cpu":
            torch.set_num_threads(int(params.get("intra_op_threads", 1)))
        folder = checkpoint_folder(context.repository_parameters)
        dtype = self._dtype(params.get("dtype", "auto"), context.device)
        try:
            self.config = Qwen3OmniConfig.from_folder(folder)
            talker, _ = Talker.from_checkpoint(folder, dtype)
            table = CheckpointWeights(folder).prefixed("thinker.model.embed_tokens.", dtype)
        except (OSError, KeyError, ValueError) as err:
            raise StageConfigError(f"checkpoint {folder}: {err}") from err
        self.talker = talker.to(context.device)
        self.embed_tokens = nn.Embedding.from_pretrained(table["weight"]).to(context.device)
        _, self.tts_eos, self.tts_pad = tts_specials(self.config, self.embed_tokens, self.talker)
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
        self._speeches: dict[int, Speech] = {}  # id(request) -> its speech, add() to its end

    @staticmethod
    def _dtype(value: Any, device: str) -> torch.dtype:
        if value == "auto":
            return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        if value not in ("float32", "bfloat16", "float16"):
            raise StageConfigError(
                f'parameters.dtype must be "auto", "float32", "bfloat16" or "float16"; '
                f"got {value!r}"
            )
        dtype: torch.dtype = getattr(torch, value)
        return dtype

    @property
    def live_requests(self) -> int:
        """Requests this stage holds: 0 when every one ended or was aborted."""
        return len(self._speeches)

    def state(self, request: Request) -> SpeechState | None:
        """The request's talker state (KV cache, logits); None before its prefill and once it
        ended or was aborted (tests observe the abort through it)."""
        speech = self._speeches.get(id(request))
        return speech.state if speech is not None else None

    # ---- the ar contract (one compute thread: no locks) -----------------------------------

    def add(self, request: Request) -> None:
        self._speeches[id(request)] = Speech(request)

    def abort(self, request: Request) -> None:
        speech = self._speeches.pop(id(request), None)
        if speech is not None:
            frames = speech.state.frames if speech.state is not None else 0
            log.info("talker: aborted %s after %d frames (%d requests running)",
                     request.id, frames, len(self._speeches))  # fmt: skip

    def playback_seconds(self, chunk: dict[str, Any]) -> float:
        """How long a chunk's frames play (12.5 frames a second): the stage's lead metrics."""
        return len(chunk.get("frames", ())) / FRAMES_PER_SECOND

    def has_work(self) -> bool:
        """Some request can take a step without a new chunk (the thinker may be done long
        before the talker is)."""
        return any(
            self._can_choose(s) or self._text(s) is not None for s in self._speeches.values()
        )

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for key, speech in list(self._speeches.items()):
            try:
                self._take(speech)
                if speech.state is None and speech.opening is not None and speech.received:
                    self._start(speech)
            except RequestAborted:
                continue  # its abort() comes before the next step
            except (TypeError, ValueError) as exc:  # InvalidRequest too: this request alone
                outputs.append(StepOutput(speech.request, error=exc))
                del self._speeches[key]
                continue
            if speech.done and speech.opening is None:  # an answer without a first id
                outputs.append(
                    StepOutput(
                        speech.request,
                        finished=True,
                        result={"finish_reason": "silent", "frames": 0},
                    )
                )
                del self._speeches[key]  # says nothing: code2wav sees the stream end alone
        outputs += self._frames()
        self._advance()
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
            self.config, self.embed_tokens, self.talker, list(opening.prompt_ids),
            opening.multimodal_hidden, speech.received[0], speaker_id(self.config, options.voice),
        )  # fmt: skip
        sampling = self.defaults
        if options.temperature is not None:
            sampling = dataclasses.replace(self.defaults, temperature=options.temperature)
        speech.state = talker_batch.start(
            self.talker, prompt, self.max_frames, sampling, options.seed
        )

    def _can_choose(self, speech: Speech) -> bool:
        return speech.state is not None and speech.state.pending is None

    def _frames(self) -> list[StepOutput]:
        """Code 0 for every request whose next frame is due (one choice for all), codec EOS or
        the frame cap ending it; the frames of the others completed in one code predictor run
        and sent."""
        outputs, due = [], []
        for key, speech in list(self._speeches.items()):
            state = speech.state
            if state is None or state.pending is not None:
                continue
            if state.frames >= self.max_frames:
                outputs.append(self._finish(speech, "length"))
                del self._speeches[key]
            else:
                due.append(speech)
        if not due:
            return outputs
        states = [s.state for s in due if s.state is not None]
        code0s = talker_batch.choose_code0s(self.talker, states)
        chosen, kept = [], []
        for speech, code0 in zip(due, code0s, strict=True):
            if code0 == self.config.talker_ids.codec_eos:
                outputs.append(self._finish(speech, "stop"))
                del self._speeches[id(speech.request)]
            else:
                chosen.append(speech)
                kept.append(code0)
        if chosen:
            states = [s.state for s in chosen if s.state is not None]
            frames = talker_batch.complete(self.talker, states, kept)
            outputs += [
                self._chunk(s, {"frames": [f]}) for s, f in zip(chosen, frames, strict=True)
            ]
        return outputs

    def _advance(self) -> None:
        """Every request whose frame waits and whose text for that frame is in: one talker
        forward for all of them."""
        ready, texts = [], []
        for speech in self._speeches.values():
            text = self._text(speech)
            if text is not None:
                ready.append(speech)
                texts.append(text)
        if not ready:
            return
        ids = [t for t in texts if isinstance(t, int)]
        projected = iter(())
        if ids:
            table = self.embed_tokens(torch.tensor(ids, device=self.embed_tokens.weight.device))
            projected = iter(self.talker.text_projection(table[:, None]))  # [n, 1, h] each row
        rows = [next(projected)[None] if isinstance(t, int) else t for t in texts]
        talker_batch.advance(
            self.talker, [s.state for s in ready if s.state is not None], torch.cat(rows)
        )

    def _text(self, speech: Speech) -> int | torch.Tensor | None:
        """What the talker hears with the frame waiting in `speech` (step k = frames - 1): the
        thinker's token k + 1 once known not to be the last, tts_eos right after the last
        heard one, tts_pad after that; None: nothing waits, or the text is not in yet."""
        state = speech.state
        if state is None or state.pending is None:
            return None
        k = state.frames - 1
        heard = speech.received[1:-1]  # followed by another id: never the unheard last one
        if k < len(heard):
            return heard[k]
        if not speech.done:
            return None
        return self.tts_eos if k == len(heard) else self.tts_pad

    def _chunk(self, speech: Speech, chunk: dict[str, Any], finished: bool = False) -> StepOutput:
        if speech.sent == 0:
            assert speech.opening is not None
            chunk["speech"] = speech.opening.speech
        speech.sent += 1
        return StepOutput(speech.request, chunk=chunk, finished=finished,
                          result={"finish_reason": chunk.get("finish_reason"),
                                  "frames": speech.state.frames if speech.state else 0}
                          if finished else None)  # fmt: skip

    def _finish(self, speech: Speech, reason: str) -> StepOutput:
        return self._chunk(speech, {"frames": [], "finish_reason": reason}, finished=True)
