"""The thinker: a chat LLM on the engine, one continuous batch over every request.

Inputs: `chat`, the typed `contracts.ChatInput` (docs/backends.md): the messages, the sampling
(max_tokens None: up to the context window; temperature 0: greedy) and `speech`, None or the
voice's `SpeechOptions`, handed to the voice with the first chunk (omni models).
Chunks: {"text": delta} as tokens are sampled (never a broken UTF-8 character); the first also
carries "speech" when the request has one. Result: {"text", "finish_reason", "usage"}.

Parameters for benchmarks (omni-bench chat-serve): `checkpoint`, another chat model (a checkpoint
folder with its tokenizer.json, or a GGUF file) instead of the embedded SmolLM2-135M;
`ignore_eos`, every answer runs to its max_tokens (random weights have no end worth waiting for).
"""

from __future__ import annotations

import itertools

import torch

from omni_server.backend import (
    InvalidRequest,
    Payload,
    Request,
    StageBackend,
    StageConfigError,
    StageContext,
    StepOutput,
    checked_text,
)
from omni_server.contracts import ChatInput, Sampling, SpeechOptions
from omni_server.engine import (
    ChatTemplateError,
    CheckpointError,
    ContextLengthExceeded,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
)
from omni_server.engine.memory import MemoryBudgetError
from omni_server.engine.parallel import ShardingError, TensorParallel


class Thinker(StageBackend):
    def initialize(self, context: StageContext) -> None:
        threads = context.parameters.get("intra_op_threads", 1)
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise StageConfigError(
                f"parameters.intra_op_threads must be an integer >= 1; found {threads!r}"
            )
        if context.device == "cpu":
            torch.set_num_threads(threads)
        checkpoint = context.parameters.get("checkpoint")
        if checkpoint is not None and not isinstance(checkpoint, str):
            raise StageConfigError(f"parameters.checkpoint must be a path; found {checkpoint!r}")
        self._ignore_eos = context.parameters.get("ignore_eos", False)
        if not isinstance(self._ignore_eos, bool):
            raise StageConfigError(
                f"parameters.ignore_eos must be true or false; found {self._ignore_eos!r}"
            )
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
        # tp_size > 1: this rank keeps its share of the heads and the MLP (engine/parallel.py)
        tp = TensorParallel(context.tp_rank, context.tp_size, context.process_group)
        try:
            # one copy of the weights per device when replicas share them (weight_share = "on");
            # a GGUF's dequantized weights kept in the run for a restarted process to map
            # (engine/prepared.py: a restart under load in seconds, not a minute)
            if checkpoint is None:
                self.engine = Engine.from_gguf(
                    config, weights=context.shared_weights, tp=tp, prepared=context.prepared_dir
                )
            else:
                self.engine = Engine.from_checkpoint(
                    checkpoint,
                    config,
                    tp=tp,
                    weights=context.shared_weights,
                    prepared=context.prepared_dir,
                )
        except CheckpointError as err:  # names the folder and what it lacks
            raise StageConfigError(str(err)) from err
        except MemoryBudgetError as err:  # the fraction cannot hold the model and one request
            raise StageConfigError(str(err)) from err
        except ShardingError as err:  # SmolLM2-135M's 9 heads / 3 KV heads: no tp_size = 2
            raise StageConfigError(str(err)) from err
        if self.engine.tokenizer is None:
            raise StageConfigError(
                f"parameters.checkpoint {checkpoint}: no tokenizer.json (a chat model needs one)"
            )
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}  # engine id -> request
        # engine id -> the voice's options, until the first chunk
        self._speech: dict[str, SpeechOptions] = {}
        self._text: dict[str, list[str]] = {}  # engine id -> the deltas so far

    def add(self, request: Request) -> None:
        chat = ChatInput.of(request.inputs)
        tokenizer = self.engine.tokenizer
        assert tokenizer is not None  # initialize checked
        try:
            text = tokenizer.apply_chat_template([m.to_dict() for m in chat.messages])
        except ChatTemplateError as err:  # e.g. roles the model's template refuses
            raise InvalidRequest(str(err), param="messages") from err
        # A prompt too long for the context whatever its tokens is refused before tokenizing
        # it: the work of one request stays bounded (the tokenizer releases the GIL, so even
        # the longest allowed one never stops the process's heartbeat).
        longest = self.engine.max_seq_len * tokenizer.max_token_chars
        if len(text) > longest:
            raise InvalidRequest(
                f"the prompt has {len(text)} characters: more than {self.engine.max_seq_len} "
                f"tokens of this model's context can hold (at most {tokenizer.max_token_chars} "
                "characters a token)",
                code="context_length_exceeded",
                param="messages",
            )
        # the tokenizer refuses a lone surrogate (TypeError): the caller's fault, a 400
        prompt = tokenizer.encode(checked_text(text, "messages"))
        params = _sampling(chat.sampling, self._ignore_eos)
        engine_id = f"r{next(self._ids)}"
        try:
            self.engine.add(GenerationRequest(engine_id, prompt, params))
        except ContextLengthExceeded as err:
            raise InvalidRequest(
                str(err), code="context_length_exceeded", param="messages"
            ) from err
        self._requests[engine_id] = request
        self._text[engine_id] = []
        if chat.speech is not None:
            self._speech[engine_id] = chat.speech

    def step(self) -> list[StepOutput]:
        outputs = []
        for event in self.engine.step():
            request = self._requests.get(event.request_id)
            if request is None:
                continue  # an abort's final event
            self._text[event.request_id].append(event.text)
            chunk: Payload | None = None
            speech = self._speech.pop(event.request_id, None)
            if event.text or speech is not None:
                chunk = {"text": event.text}
                if speech is not None:
                    chunk["speech"] = speech
            output = StepOutput(request, chunk=chunk)
            if event.finished:
                del self._requests[event.request_id]
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
                self._speech.pop(engine_id, None)
                self._text.pop(engine_id, None)
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
