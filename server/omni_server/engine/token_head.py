"""A text token a step: the output of a language model's head (head.py's `Head`).

Sampling is sampling.py's, batched on the device from one table a step (each row's settings,
random key and the position of the token it draws: draws depend on nothing else, so a seeded
row draws alike in any batch and in a step launched ahead, overlap.py); greedy takes the decode
graph's argmax where it computed one. After
a token: it ends the request when it is a stop token (the request's stop_token_ids, else the
tokenizer's EOS; not with ignore_eos) or its text reaches a stop string (the text is cut before
it); otherwise it is detokenized into the request's text, of which the event carries the part
that can no longer begin a stop string.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_server.engine.draw_graphs import DrawGraphs
from omni_server.engine.sampling import (
    SamplingParams,
    draw,
    graph_draw,
    greedy_tokens,
    sampling_row,
)
from omni_server.engine.sequence import FinishReason, GenerationRequest, Sequence, TokenEvent
from omni_server.engine.step_batch import StepBatch
from omni_server.models.draws import COLUMNS, request_seed, step_table


class TokenHead:
    """The head of a text model: one token a step, its text detokenized as it comes."""

    argmax_is_draw = True

    # capture_draws: the sampled rows' draws in graphs (set on the instance; a subclass need
    # not call this class's __init__)
    graphs: DrawGraphs | None = None

    def capture_draws(self, max_rows: int, device: torch.device, width: int | None) -> None:
        if self.graphs is None or self.graphs.max_rows < max_rows:
            self.graphs = DrawGraphs(graph_draw, max_rows, device)
        if width is not None:  # one variant: the sampled rows' draw (greedy needs none)
            for b in self.graphs.buckets:
                table = torch.zeros(b, COLUMNS, dtype=torch.float64)
                greedy = torch.zeros(b, dtype=torch.int64, device=device)
                self.graphs(None, torch.zeros(b, width, device=device), [table, greedy])

    def check(self, request: GenerationRequest) -> None:
        if request.audio_codes:
            raise ValueError("audio_codes given, but this model has no audio head")
        if request.prompt_embeddings is not None:
            raise ValueError("prompt embeddings given, but this model embeds token ids only")

    def start(self, request: GenerationRequest, token_ids: list[int]) -> Any:
        return None

    def step_inputs(self, batch: StepBatch, device: torch.device) -> Any:
        return None

    def graph_inputs(self, rows: int, device: torch.device) -> Any:
        return None

    def fill_graph_inputs(self, static: Any, decodes: list[Sequence]) -> None:
        return None

    def profile_inputs(self, decodes: int, rows: int, device: torch.device) -> Any:
        return None

    def draw(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None
    ) -> torch.Tensor:  # [R] int64 on the device
        if all(s.params.greedy for s in seqs):  # no table to build: the argmax
            return greedy_tokens(logits) if greedy is None else greedy
        # each row draws the token at position num_tokens (a PENDING one of a step in flight
        # counted: the same position as the synchronous step's)
        table = step_table([(*s.sampling_row, s.num_tokens) for s in seqs])
        tokens = greedy_tokens(logits) if greedy is None else greedy
        graphs = self.graphs
        if graphs is not None and logits.is_cuda and len(seqs) <= graphs.max_rows:
            return graphs(None, logits, [table, tokens])  # valid until its next replay
        return draw(logits, table, tokens)

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None
    ) -> list[int]:
        return self.draw(logits, seqs, greedy).tolist()

    def profile_sample(self, logits: torch.Tensor) -> None:
        row = sampling_row(SamplingParams(temperature=1.0, top_p=0.9, top_k=50), request_seed(0))
        draw(logits, step_table([(*row, 1)] * logits.shape[0]))

    def append(self, seq: Sequence, draw: int) -> TokenEvent:
        token = draw
        seq.token_ids.append(token)
        params = seq.params
        new_ids: list[int] = []
        stopped_on = None
        if token in seq.stop_token_ids and not params.ignore_eos:
            seq.finish_reason = FinishReason.STOP  # the EOS token is not part of the answer
            stopped_on = token
        else:
            new_ids.append(token)
            if seq.detokenizer is not None:
                before = len(seq.text)
                seq.text += seq.detokenizer.push(token)
                _check_stop_strings(seq, before)
        if seq.finish_reason is None and seq.num_output_tokens >= seq.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        if seq.finish_reason is not None:
            if seq.detokenizer is not None and seq.finish_reason is not FinishReason.STOP:
                seq.text += seq.detokenizer.flush()
            event = seq.event(new_ids, seq.take_text(final=True))
            event.stop_token_id = stopped_on
            return event
        return seq.event(new_ids, seq.take_text(final=False))


def _check_stop_strings(seq: Sequence, before: int) -> None:
    stops = seq.params.stop
    if not stops:
        return
    longest = max(len(s) for s in stops)
    start = max(0, before - longest + 1)  # a stop string may straddle the last delta
    hits = [i for i in (seq.text.find(s, start) for s in stops) if i >= 0]
    if hits:
        seq.text = seq.text[: min(hits)]  # the stop string is not part of the answer
        seq.finish_reason = FinishReason.STOP
