"""Qwen3-Omni's talker step (the engine's `Head`, engine/head.py): a frame of G codes a request
a step, and the next step's input embedding, from the talker's codec logits and last hidden
state (model.py).

    add      the caller first hands the head the request's `TalkerFeed` (`expect`): its prompt
             [T, C] (talker_input.opening_prompt), its code sampling, the thinker text heard so
             far; start() takes it into the request's TalkerState
    ready    a frame's next input needs the text of its step (the thinker's token, then
             tts_eos, then tts_pad): a request whose text is not in yet sits the step out
             (late text is never replaced by tts_pad)
    run      step_inputs(): every row's input embedding (TalkerRows): prompt rows from the
             feed, a generated position's = its frame's G code embeddings summed + its text
    sample   code 0 of every row (repetition penalty over its codes 0 so far, the reference's
             suppression, then greedy or the request's seeded top-k / top-p), then codes
             1 .. G-1 of every row not ending by one code predictor run for all; one host
             read of code 0, one of the frames (no draw waits for the host)
    record   append(): the frame (TokenEvent.audio_frames), codec EOS ends ("stop"), the
             frame cap (max_tokens) too ("length")

A row's numbers do not depend on the batch (per-row attention over its own blocks; a sampled
code is the engine's counter-based draw of (the request's seed, its frame's position, its
group), as talker_batch.py draws it), so a request's frames are the same alone or among
others, and the same as talker_batch's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from omni_server.engine.config import LlamaShape
from omni_server.engine.draw_graphs import DrawGraphs
from omni_server.engine.sequence import FinishReason, GenerationRequest, Sequence, TokenEvent
from omni_server.engine.step_batch import StepBatch
from omni_server.models.draws import COLUMNS, KEY_HI, KEY_LO
from omni_server.models.qwen3_omni.config import Qwen3OmniConfig
from omni_server.models.qwen3_omni.talker import CodePredictor
from omni_server.models.qwen3_omni.talker_batch import (
    CodeSampling,
    Rule,
    draw_table,
    pick_rows,
    residual_codes,
)


class TalkerParts(Protocol):
    """What the head reads of its model (model.py's Qwen3OmniTalker)."""

    @property
    def shape(self) -> LlamaShape: ...

    @property
    def config(self) -> Qwen3OmniConfig: ...

    @property
    def embed(self) -> nn.Embedding: ...  # the codec ids' embedding

    @property
    def code_predictor(self) -> CodePredictor: ...

    def hear(self, token_ids: list[int]) -> torch.Tensor: ...


@dataclass
class TalkerRows:
    """Every row's input embedding of a step (ForwardBatch.family_inputs), flat row order."""

    values: torch.Tensor  # [T, C]


@dataclass(eq=False)
class TalkerFeed:
    """One request's talker input, kept by its caller, who feeds the thinker's text as it
    streams (`hear`). Step k (the k-th frame's next input) hears text row k, then tts_eos
    once `done`, then tts_pad."""

    prompt: torch.Tensor  # [T, C] the talker prompt's input embeddings
    sampling: CodeSampling = field(default_factory=CodeSampling)
    heard: list[torch.Tensor] = field(default_factory=list)  # [C] each, in step order
    done: bool = False  # no more text comes

    def hear(self, rows: torch.Tensor, done: bool = False) -> None:
        """Append the talker's view of thinker tokens [n, C] (Qwen3OmniTalker.hear)."""
        if self.done:
            raise ValueError("text heard after the thinker's end")
        self.heard.extend(rows.unbind(0))
        self.done = done

    def end(self) -> None:
        """The thinker is done: tts_eos next, then tts_pad."""
        self.done = True

    def has_text(self, step: int) -> bool:
        return step < len(self.heard) or self.done


@dataclass(eq=False)
class TalkerState:
    """One request's talker side (Sequence.state), through preemption."""

    feed: TalkerFeed
    first_codes: list[int] = field(default_factory=list)  # code 0 of every frame so far
    sums: list[torch.Tensor] = field(default_factory=list)  # [C] each frame's codes summed


@dataclass
class TalkerDraw:
    """One row's draw: code 0, and unless it is codec EOS the whole frame and its codes'
    embeddings summed [C]."""

    code0: int
    frame: list[int] | None = None
    codes_sum: torch.Tensor | None = None


def _state(seq: Sequence) -> TalkerState:
    assert isinstance(seq.state, TalkerState), "a talker request carries TalkerState"
    return seq.state


class TalkerHead:
    argmax_is_draw = False  # a frame is code 0 then the code predictor's: no argmax in a graph

    def __init__(self, model: TalkerParts) -> None:
        self.model = model
        self._expected: dict[str, TalkerFeed] = {}  # request id -> feed, until start()
        self._specials: tuple[torch.Tensor, torch.Tensor] | None = None  # tts_eos, tts_pad
        self.graphs: DrawGraphs | None = None  # capture_draws: the code predictor's frames
        self._never: torch.Tensor | None = None  # _suppressed, once a device

    # ---- requests --------------------------------------------------------------------------

    def expect(self, request_id: str, feed: TalkerFeed) -> None:
        """The feed of a request about to be added (Engine.add takes it; `forget` it when the
        add fails)."""
        self._expected[request_id] = feed

    def forget(self, request_id: str) -> None:
        self._expected.pop(request_id, None)

    def check(self, request: GenerationRequest) -> None:
        feed = self._expected.get(request.request_id)
        if feed is None:
            raise ValueError("a talker request needs its TalkerFeed first (TalkerHead.expect)")
        if request.audio_codes or request.prompt_embeddings is not None:
            raise ValueError("a talker request's inputs come in its TalkerFeed")
        width = self.model.shape.hidden_size
        if feed.prompt.dim() != 2 or feed.prompt.shape != (len(request.prompt_token_ids), width):
            raise ValueError(
                f"the talker prompt is {tuple(feed.prompt.shape)}; expected "
                f"({len(request.prompt_token_ids)}, {width}): a row a prompt token"
            )

    def start(self, request: GenerationRequest, token_ids: list[int]) -> TalkerState:
        return TalkerState(self._expected.pop(request.request_id))

    def ready(self, seq: Sequence) -> bool:
        """The input of the request's last position is known: a prompt row, or a frame whose
        step's text is in (its decode row, or the end of a recompute after preemption)."""
        step = seq.num_tokens - 1 - seq.num_prompt_tokens
        return step < 0 or _state(seq).feed.has_text(step)

    # ---- inputs ----------------------------------------------------------------------------

    def _text(self, feed: TalkerFeed, step: int) -> torch.Tensor:
        if step < len(feed.heard):
            return feed.heard[step]
        assert feed.done, "a row runs only once its text is in (ready)"
        if self._specials is None:
            config = self.model.config  # as tts_specials: the three projected together
            ids = [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]
            _, eos, pad = self.model.hear(ids).unbind(0)
            self._specials = (eos, pad)
        eos, pad = self._specials
        return eos if step == len(feed.heard) else pad

    def _input(self, seq: Sequence, position: int) -> torch.Tensor:
        """The input embedding [C] of a generated position: its frame's codes + its text."""
        state = _state(seq)
        step = position - seq.num_prompt_tokens
        return state.sums[step] + self._text(state.feed, step).to(state.sums[step])

    def step_inputs(self, batch: StepBatch, device: torch.device) -> TalkerRows:
        rows = [self._input(seq, seq.num_computed)[None] for seq in batch.decodes]
        for work in batch.prefills:
            seq, end = work.seq, work.start + work.length
            prompt = _state(seq).feed.prompt
            if work.start < seq.num_prompt_tokens:
                rows.append(prompt[work.start : min(end, seq.num_prompt_tokens)])
            for position in range(max(work.start, seq.num_prompt_tokens), end):
                rows.append(self._input(seq, position)[None])  # a recompute after preemption
        dtype = self.model.embed.weight.dtype
        return TalkerRows(torch.cat([r.to(device=device, dtype=dtype) for r in rows]))

    def graph_inputs(self, rows: int, device: torch.device) -> TalkerRows:
        width, dtype = self.model.shape.hidden_size, self.model.embed.weight.dtype
        return TalkerRows(torch.zeros(rows, width, dtype=dtype, device=device))

    def fill_graph_inputs(self, static: TalkerRows, decodes: list[Sequence]) -> None:
        rows = torch.stack([self._input(seq, seq.num_computed) for seq in decodes])
        static.values.zero_()  # padded rows: a zero input (their output is unused)
        static.values[: len(decodes)].copy_(rows)

    def profile_inputs(self, decodes: int, rows: int, device: torch.device) -> TalkerRows:
        return self.graph_inputs(rows, device)

    # ---- the draw --------------------------------------------------------------------------

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None
    ) -> list[TalkerDraw]:
        vocab = self.model.shape.vocab_size
        codes, hidden = logits[:, :vocab].clone(), logits[:, vocab:]  # [R, V], [R, C]
        states = [_state(s) for s in seqs]
        eos = self.model.config.talker_ids.codec_eos
        # repetition penalty over each row's codes 0 so far: the (row, code) pairs of all rows
        # of one penalty in one copy and one indexed update (a loop of rows was 4 launches and
        # a copy a row: the host's work grew with the batch); the scalar as the reference's
        by_penalty: dict[float, tuple[list[int], list[int]]] = {}
        for row, state in enumerate(states):
            penalty = state.feed.sampling.repetition_penalty
            if penalty != 1.0 and state.first_codes:
                in_rows, at_codes = by_penalty.setdefault(penalty, ([], []))
                seen = sorted(set(state.first_codes))
                in_rows += [row] * len(seen)
                at_codes += seen
        for penalty, pairs in by_penalty.items():
            at = torch.tensor(pairs, device=codes.device).unbind(0)
            picked = codes[at]
            codes[at] = torch.where(picked < 0, picked * penalty, picked / penalty)
        quiet = [row for row, state in enumerate(states) if state.feed.sampling.suppress_eos]
        if quiet:
            codes[torch.tensor(quiet, device=codes.device), eos] = -float("inf")
        codes.masked_fill_(self._suppressed(codes.device), -float("inf"))  # no host sync
        # a frame draws at its code 0's position (the sequence's next token) with the key of
        # the request's seed (Sequence.sampling_row: a fresh one for an unseeded request)
        keyed = [
            (seq.sampling_row[KEY_LO], seq.sampling_row[KEY_HI], seq.num_tokens) for seq in seqs
        ]
        rules: list[Rule] = [
            (s.feed.sampling.temperature, s.feed.sampling.top_k, s.feed.sampling.top_p, *d)
            for s, d in zip(states, keyed, strict=True)
        ]
        code0s: list[int] = pick_rows(codes, draw_table(rules, codes.device)).tolist()
        draws = [TalkerDraw(c) for c in code0s]
        going = [row for row, c in enumerate(code0s) if c != eos]
        if not going:
            return draws
        predictor_rules: list[Rule] = [
            (states[r].feed.sampling.temperature, states[r].feed.sampling.predictor_top_k,
             states[r].feed.sampling.predictor_top_p, *keyed[r])
            for r in going
        ]  # fmt: skip
        index = torch.tensor(going, device=logits.device)
        rows = hidden.index_select(0, index)
        first = torch.tensor([code0s[r] for r in going], device=logits.device)
        table = draw_table(predictor_rules, logits.device)
        if self.graphs is not None and len(going) <= self.graphs.max_rows:
            sampled = table is not None
            inputs = [first] if table is None else [first, table]
            rest, sums = self.graphs.outputs(sampled, rows, inputs)
            sums = sums.clone()  # the graph's static output: the next replay overwrites it
        else:
            rest, sums = self._frames(table is not None, rows, first, table)
        for k, (row, others) in enumerate(zip(going, rest.tolist(), strict=True)):
            draws[row] = TalkerDraw(code0s[row], [code0s[row], *others], sums[k])
        return draws

    @torch.no_grad()
    def _frames(
        self,
        sampled: bool,
        hidden: torch.Tensor,  # [B, C] float32: the talker's last normed hidden state
        code0: torch.Tensor,  # [B] int64
        table: torch.Tensor | None = None,  # [B, COLUMNS] draw_table of the predictor's draws
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes 1 .. G-1 [B, G - 1] and the frame's G code embeddings summed [B, C] for rows
        whose code 0 is chosen: tensor work alone, so `capture_draws` can hold it in graphs
        (`sampled` fixes the branch at capture: without it every row is greedy)."""
        dtype = self.model.embed.weight.dtype
        rest, sums = residual_codes(
            self.model.code_predictor,
            hidden.to(dtype)[:, None],
            self.model.embed(code0)[:, None],
            table if sampled else None,
        )
        return rest, sums[:, 0]

    def _suppressed(self, device: torch.device) -> torch.Tensor:
        """[V] bool: the ids the reference never lets win (the last 1024 but codec EOS)."""
        if self._never is None or self._never.device != device:
            vocab, eos = self.model.shape.vocab_size, self.model.config.talker_ids.codec_eos
            never = torch.zeros(vocab, dtype=torch.bool, device=device)
            never[max(0, vocab - 1024) :] = True
            never[eos] = False
            self._never = never
        return self._never

    def draw(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None
    ) -> torch.Tensor:
        # only a step in flight asks (overlap.py), and argmax_is_draw False keeps every step
        # synchronous: a frame is read back before the code predictor runs
        raise NotImplementedError("the talker's steps never go in flight (argmax_is_draw)")

    def capture_draws(self, max_rows: int, device: torch.device, width: int | None) -> None:
        """The code predictor's G - 1 steps (and their draws) as CUDA graphs, greedy and
        sampled, for every rows bucket, captured now: eagerly a frame is ~G x layers x 30 small
        kernels, launch-bound (the profile in docs/models.md); a replay is one launch. Code 0
        stays eager (its repetition penalty reads the host's codes so far)."""
        if self.graphs is not None and self.graphs.max_rows >= max_rows:
            return
        self.graphs = DrawGraphs(self._frames, max_rows, device)
        size = self.model.shape.hidden_size  # the rows' hidden state (`width`: the logits')
        for b in self.graphs.buckets:
            hidden = torch.zeros(b, size, device=device)
            code0 = torch.zeros(b, dtype=torch.int64, device=device)
            table = torch.zeros(b, COLUMNS, dtype=torch.float64, device=device)
            self.graphs.outputs(False, hidden, [code0])
            self.graphs.outputs(True, hidden, [code0, table])

    def profile_sample(self, logits: torch.Tensor) -> None:
        vocab = self.model.shape.vocab_size
        code0s = torch.argmax(logits[:, :vocab], dim=-1)
        self._frames(False, logits[:, vocab:], code0s)

    def append(self, seq: Sequence, draw: TalkerDraw) -> TokenEvent:
        """Record a frame (or codec EOS): the token appended is code 0 (the position's id; its
        input is the head's, step_inputs)."""
        seq.token_ids.append(draw.code0)
        if draw.frame is None or draw.codes_sum is None:
            seq.finish_reason = FinishReason.STOP  # codec EOS: no frame
            return seq.event([], "")
        state = _state(seq)
        state.first_codes.append(draw.code0)
        state.sums.append(draw.codes_sum)
        if len(state.sums) >= seq.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        event = seq.event([draw.code0], "")
        event.audio_frames = [draw.frame]
        return event
