"""The thinker's head: the engine's text head (a token a step), plus the prompt rows whose
input is an encoder's output instead of a token's embedding (GenerationRequest's
`PromptEmbeddings`: the audio tower's output at the audio placeholders), and the hidden state
the talker hears at those rows (the tapped layer's output, handed back once on the request's
first event, TokenEvent.prompt_hidden).

    add      start(): the request's PromptRowsState (positions, values, the tap's buffer)
    run      step_inputs(): PromptRows, the batch's flat rows that take given values and whose
             tapped hidden state is kept (prefill chunks only: a decode row is a generated
             token's, never a placeholder's)
    forward  Qwen3OmniThinker puts the values in, and `PromptRows.keep` copies the tap's rows
             into each request's buffer
    record   append(): the text head's event, with the buffer on the first one

Decode graphs carry no inputs of this head (every decode row is a token). A preempted request
recomputes its prompt: the same rows take the same values; the tap's buffer went out with
the first event and is not written again.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from omni_server.engine.sequence import GenerationRequest, Sequence, TokenEvent
from omni_server.engine.step_batch import StepBatch
from omni_server.engine.token_head import TokenHead


@dataclass
class PromptRowsState:
    """One request's given rows (Sequence.state)."""

    positions: list[int]  # ascending prompt positions
    values: torch.Tensor  # [M, C] their input embeddings
    # [M, C] the tap's output there (keep_hidden), filled in prefill; None once handed out (the
    # event owns it: a recomputed prompt after a preemption never writes into it again)
    hidden: torch.Tensor | None


@dataclass
class PromptRows:
    """One eager step's given rows (ForwardBatch.family_inputs), in the batch's flat order."""

    rows: torch.Tensor  # [N] int64 flat rows that take `values`
    values: torch.Tensor  # [N, C]
    # where each kept row's tapped hidden state goes: (flat rows [n] int64, its state, the
    # indices [n] of those rows in the state's buffer)
    keeps: list[tuple[torch.Tensor, PromptRowsState, torch.Tensor]] = field(default_factory=list)

    def keep(self, tapped: torch.Tensor) -> None:
        """Copy the tapped layer's output [T, C] at the kept rows into their requests' buffers."""
        for rows, state, index in self.keeps:
            assert state.hidden is not None
            state.hidden.index_copy_(0, index, tapped.index_select(0, rows).to(state.hidden))


def _state(seq: Sequence) -> PromptRowsState | None:
    state = seq.state
    assert state is None or isinstance(state, PromptRowsState)
    return state


class PromptRowsHead(TokenHead):
    """The text head of a model that also takes given embeddings for some prompt rows."""

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size

    def check(self, request: GenerationRequest) -> None:
        if request.audio_codes:
            raise ValueError("audio_codes given, but this model has no audio head")
        given = request.prompt_embeddings
        if given is None:
            return
        if given.values.shape[1] != self.hidden_size:
            raise ValueError(
                f"prompt embeddings are {given.values.shape[1]} wide; the model's hidden size "
                f"is {self.hidden_size}"
            )
        if given.positions and not 0 <= given.positions[0] <= given.positions[-1] < len(
            request.prompt_token_ids
        ):
            raise ValueError("prompt embedding positions lie outside the prompt")

    def start(self, request: GenerationRequest, token_ids: list[int]) -> PromptRowsState | None:
        given = request.prompt_embeddings
        if given is None or not given.positions:
            return None
        values = given.values.float()
        hidden = torch.zeros_like(values) if given.keep_hidden else None
        return PromptRowsState(list(given.positions), values, hidden)

    def step_inputs(self, batch: StepBatch, device: torch.device) -> PromptRows | None:
        row = len(batch.decodes)  # decode rows come first and take no given values
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        keeps = []
        for work in batch.prefills:
            state = _state(work.seq)
            if state is not None:
                lo = bisect.bisect_left(state.positions, work.start)
                hi = bisect.bisect_left(state.positions, work.start + work.length)
                if hi > lo:
                    flat = torch.tensor(state.positions[lo:hi]) - work.start + row
                    rows.append(flat)
                    values.append(state.values[lo:hi])
                    if state.hidden is not None:
                        index = torch.arange(lo, hi, device=state.hidden.device)
                        keeps.append((flat.to(device), state, index))
            row += work.length
        if not rows:
            return None
        return PromptRows(torch.cat(rows).to(device), torch.cat(values).to(device), keeps)

    def append(self, seq: Sequence, draw: int) -> TokenEvent:
        event = super().append(seq, draw)
        state = _state(seq)
        if state is not None and state.hidden is not None:
            # the first append follows the prompt's last chunk: every row has been tapped
            event.prompt_hidden, state.hidden = state.hidden, None
        return event
