"""One request's state inside the engine: plain counters plus a status (nano-vllm style)."""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_server.engine.sampling import SamplingParams, sampling_row
from omni_server.engine.tokenizer import IncrementalDetokenizer, TextTokenizer
from omni_server.models.draws import request_seed
from omni_server.playback import Playback


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # abort(id)


class Status(enum.Enum):
    WAITING = enum.auto()  # queued, holds no KV blocks
    RUNNING = enum.auto()  # holds KV blocks; prefilling or decoding
    FINISHED = enum.auto()  # blocks freed


@dataclass(frozen=True)
class PromptEmbeddings:
    """Prompt rows whose input embedding is given, not looked up by token id: an encoder's
    output at the prompt's placeholder tokens (an omni model's audio). Only a family whose
    head reads them takes them (the text head refuses them). `keep_hidden`: the family also
    hands back its tapped layer's hidden state at these rows, once, on the request's first
    event (TokenEvent.prompt_hidden), for a stage that hears the prompt through it."""

    positions: tuple[int, ...]  # ascending prompt positions
    values: torch.Tensor  # [len(positions), hidden] floating
    keep_hidden: bool = False

    def __post_init__(self) -> None:
        values = self.values
        if not isinstance(values, torch.Tensor) or values.dim() != 2:
            raise ValueError("prompt embeddings must be a 2-D tensor [rows, hidden]")
        if not values.is_floating_point() or values.shape[0] != len(self.positions):
            raise ValueError(
                f"{len(self.positions)} positions, {values.shape[0]} floating embedding rows"
            )
        if any(b <= a for a, b in zip(self.positions, self.positions[1:], strict=False)):
            raise ValueError("prompt embedding positions must be strictly ascending")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # Audio-frame models: the frames (K codes each) of the prompt's frame tokens, in order (a
    # reference voice, delay pattern applied as the reference processor builds it).
    audio_codes: list[list[int]] | None = None
    # Media models: how long the media of one step's output plays (Higgs: a frame, 1/25 s).
    # Set, the batcher orders this request by its listener's deadline when the step cannot
    # hold everyone (deadline_order.py); None: no playback of its own (a thinker feeding a
    # voice), the plain order.
    playback_seconds: float | None = None
    # Models that take embeddings for some prompt rows (PromptEmbeddings); None: ids only.
    prompt_embeddings: PromptEmbeddings | None = None


@dataclass
class TokenEvent:
    """What one step produced for one request. Text deltas concatenate to the full answer."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far
    # Audio-frame models: the frame this step produced ([K] codes, the delay pattern's BOS / EOS
    # codes included, as the reference's generate() returns them); token_ids then holds its
    # text-track token (audio or delay token; none on the final, all-EOS frame).
    audio_frames: list[list[int]] = field(default_factory=list)
    # The stop token that ended the request (finish_reason "stop" on a stop token; it is not
    # part of the answer, so not in token_ids); None otherwise.
    stop_token_id: int | None = None
    # PromptEmbeddings.keep_hidden: [rows, hidden] the tapped layer's output at those rows, on
    # the request's first event only.
    prompt_hidden: torch.Tensor | None = None


class Sequence:
    """Invariant: tokens [0, num_computed) have K/V in the cache slots of `block_table`."""

    def __init__(
        self,
        request: GenerationRequest,
        max_tokens: int,
        tokenizer: TextTokenizer | None,
        arrival: int,
    ) -> None:
        self.request_id = request.request_id
        self.params = request.params
        self.token_ids: list[int] = list(request.prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(self.token_ids)
        self.max_tokens = max_tokens
        self.num_computed = 0
        self.block_table: list[int] = []
        self.status = Status.WAITING
        self.arrival = arrival  # admission order; the newest running request is preempted first
        # its constant columns of a step's sampling table (settings, random key: sampling.py)
        self.sampling_row = sampling_row(request.params, request_seed(request.params.seed))
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.text = ""  # output text so far (after stop-string truncation)
        self.emitted_chars = 0  # how much of `text` has left in events
        self.finish_reason: FinishReason | None = None
        # a text model's stop tokens: the request's own, else the tokenizer's EOS
        self.stop_token_ids: Collection[int] = request.params.stop_token_ids or (
            tokenizer.eos_token_ids if tokenizer is not None else ()
        )
        # the model's head's own state of this request (head.py: Head.start), through preemption
        self.state: Any = None
        # how far ahead of its listener its output is (None: it plays nothing itself)
        self.playback_seconds = request.playback_seconds
        self.playback = Playback() if request.playback_seconds is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decodes_next(self) -> bool:
        """Its next step is a decode row: one position left, and that position an output token's.

        The last token of a prompt whose chunks left it alone is a prefill chunk of one row,
        never a decode: a head may build a decode row's input from what the request generated
        (Higgs' frames, the talker's summed codes), which a prompt position has none of (a
        Higgs prompt chunked to leave its last token alone broke the decode graph's inputs)."""
        return (
            self.num_tokens - self.num_computed == 1 and self.num_computed >= self.num_prompt_tokens
        )

    @property
    def prefills_next(self) -> bool:
        """Its next step is a prefill chunk: positions left that are not one decode row."""
        return self.num_computed < self.num_tokens and not self.decodes_next

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def take_text(self, final: bool) -> str:
        """The next text delta. Unless final, hold back what could still begin a stop string."""
        end = len(self.text)
        if not final and self.params.stop:
            end -= max(len(s) for s in self.params.stop) - 1
        if end <= self.emitted_chars:
            return ""
        delta = self.text[self.emitted_chars : end]
        self.emitted_chars = end
        return delta

    def event(self, token_ids: list[int], text: str) -> TokenEvent:
        """This step's event of the request, its counters as they stand."""
        return TokenEvent(
            request_id=self.request_id,
            token_ids=token_ids,
            text=text,
            finished=self.finish_reason is not None,
            finish_reason=self.finish_reason,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_output_tokens,
        )
