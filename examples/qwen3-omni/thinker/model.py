"""The thinker: Qwen3-Omni's MoE LLM on the engine (the qwen3_omni_moe family), one continuous
batch over every request; it hears a clip through its audio placeholders, whose rows take the
audio encoder's embeddings (engine PromptEmbeddings).

Inputs: {"chat": ChatInput, "prompt_ids", "audio_embeds"} (the audio encoder's payload).
Chunks to the caller: {"text": delta} as tokens are sampled (never a broken UTF-8 character).
Result: {"text", "finish_reason", "usage"}, as the chat stage contract has them
(repository/thinker/model.py).

When the request asks for speech (ChatInput.speech), its chunks also carry what the talker
hears (models/qwen3_omni/handoff.py), along `stream_to` only (never to the caller: those
contracts are for stages): a TalkerOpening (the prompt ids, the thinker's layer
`accept_hidden_layer` output at the prompt's multimodal placeholders, captured during prefill
and nothing else, the voice's options) with the first generated ids, then ThinkerTokens as ids
come, the last with done=True and the stop token that ended the answer. A text-only chat feeds
the talker nothing.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from omni_server.backend import (
    InvalidRequest,
    Payload,
    Request,
    StageBackend,
    StageConfigError,
    StageContext,
    StepOutput,
)
from omni_server.contracts import ChatInput, Sampling, SpeechOptions
from omni_server.engine import (
    CheckpointError,
    ContextLengthExceeded,
    Engine,
    EngineConfig,
    GenerationRequest,
    PromptEmbeddings,
    SamplingParams,
    TokenEvent,
)
from omni_server.engine.memory import MemoryBudgetError
from omni_server.models.qwen3_omni.config import Qwen3OmniConfig
from omni_server.models.qwen3_omni.folder import CheckpointFolderError, checkpoint_folder
from omni_server.models.qwen3_omni.handoff import TalkerOpening, ThinkerTokens

log = logging.getLogger("omni_server.examples.qwen3_omni.thinker")


class Thinker(StageBackend):
    def initialize(self, context: StageContext) -> None:
        threads = context.parameters.get("intra_op_threads", 1)
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise StageConfigError(
                f"parameters.intra_op_threads must be an integer >= 1; found {threads!r}"
            )
        ignore_eos = context.parameters.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise StageConfigError(
                f"parameters.ignore_eos must be true or false; found {ignore_eos!r}"
            )
        self.ignore_eos = ignore_eos
        warm = context.parameters.get("warm_graphs_tokens", 2048)
        if not isinstance(warm, int) or isinstance(warm, bool) or warm < 0:
            raise StageConfigError(
                f"parameters.warm_graphs_tokens must be an integer >= 0; found {warm!r}"
            )
        if context.device == "cpu":
            torch.set_num_threads(threads)
        try:
            config = EngineConfig.from_table(
                {
                    **context.engine,
                    "device": context.device,
                    # on a GPU the stage's budget sizes (or checks) the KV cache
                    "gpu_memory_fraction": context.gpu_memory_fraction,
                }
            )
        except (TypeError, ValueError) as err:
            raise StageConfigError(f"[engine]: {err}") from err
        try:
            folder = checkpoint_folder(context.repository_parameters)
            model = Qwen3OmniConfig.from_folder(folder)
            # one copy of the weights per device when replicas share them (weight_share = "on")
            self.engine = Engine.from_checkpoint(folder, config, weights=context.shared_weights)
        except (CheckpointFolderError, CheckpointError, MemoryBudgetError, KeyError) as err:
            raise StageConfigError(str(err)) from err
        self._warm(warm)
        # the audio placeholders: the prompt's multimodal rows (preprocessing refuses images and
        # videos), whose hidden state the talker hears
        self.audio_token_id = model.audio_token_id
        self.hidden_size = model.thinker.hidden_size
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}  # engine id -> request
        self._text: dict[str, list[str]] = {}  # engine id -> the deltas so far
        # engine id -> the talker's opening, until it goes out with the first ids
        self._opening: dict[str, tuple[tuple[int, ...], SpeechOptions]] = {}
        self._talking: set[str] = set()  # engine ids whose opening went to the talker

    def _warm(self, tokens: int) -> None:
        """On a GPU, before the first request: one prompt of a whole prefill step (the MoE
        kernel's prefill tiles compiled, the allocator warm), then the decode graphs of every
        batch bucket at the contexts up to `tokens` (Engine.capture_graphs). Measured without
        it: the first wave of each new concurrency waited 2.6-4.5 s for its first token while
        its buckets were captured (docs/models.md). 0: all on first use."""
        if self.engine.runner.graphs is None or tokens <= 0:
            return
        prompt = [0] * min(self.engine.config.max_step_tokens, self.engine.max_seq_len - 2)
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        self.engine.generate([GenerationRequest("__warm__", prompt, params)])
        lengths = self.engine.capture_graphs(tokens)
        log.info("thinker: decode graphs captured at contexts %s", lengths)

    def add(self, request: Request) -> None:
        chat = ChatInput.of(request.inputs)
        prompt: tuple[int, ...] = tuple(request.inputs["prompt_ids"])
        audio: torch.Tensor | None = request.inputs["audio_embeds"]
        given = None
        if audio is not None:
            positions = tuple(i for i, t in enumerate(prompt) if t == self.audio_token_id)
            given = PromptEmbeddings(positions, audio, keep_hidden=chat.speech is not None)
        engine_id = f"r{next(self._ids)}"
        try:
            self.engine.add(
                GenerationRequest(
                    engine_id, list(prompt), _sampling(chat.sampling, self.ignore_eos),
                    prompt_embeddings=given,
                )
            )  # fmt: skip
        except ContextLengthExceeded as err:
            raise InvalidRequest(
                str(err), code="context_length_exceeded", param="messages"
            ) from err
        self._requests[engine_id] = request
        self._text[engine_id] = []
        if chat.speech is not None:
            self._opening[engine_id] = (prompt, chat.speech)

    def step(self) -> list[StepOutput]:
        outputs = []
        for event in self.engine.step():
            request = self._requests.get(event.request_id)
            if request is None:
                continue  # an abort's final event
            self._text[event.request_id].append(event.text)
            chunk: Payload = {"text": event.text} if event.text else {}
            chunk.update(self._to_talker(event))
            output = StepOutput(request, chunk=chunk or None)
            if event.finished:
                del self._requests[event.request_id]
                self._opening.pop(event.request_id, None)
                self._talking.discard(event.request_id)
                output.finished = True
                output.result = {
                    "text": "".join(self._text.pop(event.request_id)),
                    "finish_reason": str(event.finish_reason),
                    "usage": {
                        "prompt_tokens": event.prompt_tokens,
                        "completion_tokens": event.completion_tokens,
                    },
                }
            outputs.append(output)
        return outputs

    def _to_talker(self, event: TokenEvent) -> dict[str, Any]:
        """The talker's part of this event's chunk (handoff.py): the opening with the first
        ids, then the ids; none for a text-only chat, or an answer that ended before its
        first id (the talker then hears nothing and says nothing)."""
        engine_id = event.request_id
        opening = self._opening.pop(engine_id, None)
        parts: dict[str, Any] = {}
        if opening is not None and not (event.finished and event.completion_tokens == 0):
            prompt, speech = opening
            hidden = event.prompt_hidden
            if hidden is None:  # no clip in the prompt: no multimodal rows
                hidden = torch.zeros(0, self.hidden_size)
            parts[TalkerOpening.KEY] = TalkerOpening(prompt, hidden, speech)
            self._talking.add(engine_id)
        if engine_id not in self._talking:
            return parts
        ids = list(event.token_ids)
        if event.stop_token_id is not None:
            ids.append(event.stop_token_id)  # the end of turn: the talker hears it
        if ids or event.finished:
            parts[ThinkerTokens.KEY] = ThinkerTokens(tuple(ids), done=event.finished)
        return parts

    def finish(self, request: Request) -> None:
        """The stage's `timeout_s` ran out: end the answer where it is, as `max_tokens` would
        (finish_reason "length"); its last text and result come out of the next step()."""
        for engine_id, held in self._requests.items():
            if held is request:
                self.engine.finish(engine_id)
                return

    def abort(self, request: Request) -> None:
        for engine_id, held in list(self._requests.items()):
            if held is request:
                del self._requests[engine_id]
                self._text.pop(engine_id, None)
                self._opening.pop(engine_id, None)
                self._talking.discard(engine_id)
                self.engine.abort(engine_id)


def _sampling(sampling: Sampling, ignore_eos: bool) -> SamplingParams:
    """The engine's sampler for the contract's fields; what the engine cannot run (top_p 0)
    is the caller's to fix."""
    try:
        return SamplingParams(
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=sampling.top_k,
            min_p=float(sampling.min_p),
            seed=sampling.seed,
            max_tokens=sampling.max_tokens,
            stop=sampling.stop,
            ignore_eos=ignore_eos,
        )
    except (TypeError, ValueError) as err:
        raise InvalidRequest(f"sampling: {err}") from err
