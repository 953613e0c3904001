"""Higgs Audio v2's step output (the engine's `Head`, engine/head.py): one frame of K codes a
request a step, drawn under the delay pattern (frames.py), and the text-track token it implies.

What the engine's generic step asks of it, and where the old audio branches of the engine went:

    check / start       the request's frames against its prompt's frame tokens; FrameState
    step_inputs         the frames of the batch's frame positions (FrameInputs), flat row order
    graph_inputs / fill a decode graph's static [b, K] codes (every decode row is a frame)
    sample / draw       one frame table + RAS window to the device, draw_frames, [R, K] back
    append              the text-track token, the frame recorded, the end of audio
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omni_server.engine.attention import ForwardBatch
from omni_server.engine.draw_graphs import DrawGraphs
from omni_server.engine.families.higgs_audio_v2.frames import (
    DELAY_STARTS,
    AudioSpec,
    delay_starts,
    draw_frames,
    frame_table,
)
from omni_server.engine.sampling import SamplingParams, sampling_row
from omni_server.engine.sequence import FinishReason, GenerationRequest, Sequence, TokenEvent
from omni_server.engine.step_batch import StepBatch
from omni_server.models.draws import request_seed

SERVED_RAS_WINDOW = 7  # the published generation_config.json's ras_win_len


@dataclass
class FrameInputs:
    """The frames of a step's audio rows (ForwardBatch.family_inputs)."""

    audio_codes: torch.Tensor  # [A, K] int64 codes of the audio rows
    audio_rows: torch.Tensor | None = None  # [A] int64 rows that are audio; None: every row is
    text_rows: torch.Tensor | None = None  # [T - A] int64 the other rows (set with audio_rows)


def frame_inputs(batch: ForwardBatch) -> FrameInputs | None:
    """The batch's frames; None: every row is text (a batch built without this head, as a
    plain prefill in the tests, is text too)."""
    inputs = batch.family_inputs
    assert inputs is None or isinstance(inputs, FrameInputs), type(inputs)
    return inputs


@dataclass
class FrameState:
    """One request's frames (Sequence.state), kept through preemption."""

    # its constant columns of a frame table past the clocks: (ras_max_repeat, *delay_starts)
    constants: tuple[int, ...]
    # position -> its frame, for every frame token (prompt and output): what the model embeds
    frames: dict[int, list[int]]
    # delay tokens among the tokens it sampled after so far (the closing delay's clock): the
    # prompt's last token, then each text-track token appended
    delays: int
    # [ras_window, K] int64 the last frames, oldest first (prompt's included), -1 where none
    # yet: repetition-aware sampling's window; None when the request does not ask for it
    window: np.ndarray | None


def _state(seq: Sequence) -> FrameState:
    assert isinstance(seq.state, FrameState), "an audio model's requests carry FrameState"
    return seq.state


class FrameHead:
    """The audio head: [K * C] logits a row, one frame of K codes a request a step."""

    argmax_is_draw = False  # a frame is K draws under masks: no argmax in the graph

    def __init__(self, spec: AudioSpec) -> None:
        self.spec = spec
        self.graphs: DrawGraphs | None = None  # capture_draws: the frame draws in graphs

    def capture_draws(self, max_rows: int, device: torch.device, width: int | None) -> None:
        if self.graphs is None or self.graphs.max_rows < max_rows:
            self.graphs = DrawGraphs(self._graph_draw, max_rows, device)
        if width is None:
            return
        # the served variants: greedy or sampled, with or without repetition-aware sampling
        # over the published window (7 frames); another window is captured on first use
        k = self.spec.num_codebooks
        for sampled, ras in ((False, False), (True, False), (False, True), (True, True)):
            for b in self.graphs.buckets:
                inputs = [frame_table([(0.0,) * (DELAY_STARTS + 2 * k)] * b, self.spec)]
                if ras:
                    inputs.append(torch.full((b, SERVED_RAS_WINDOW, k), -1, dtype=torch.int64))
                logits = torch.zeros(b, width, device=device)
                self.graphs((sampled, ras), logits, inputs)

    def _graph_draw(
        self, variant: tuple[bool, bool], logits: torch.Tensor, table: torch.Tensor,
        *window: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """draw_frames as DrawGraphs captures it: variant (sampled, repetition-aware)."""
        sampled, ras = variant
        return draw_frames(logits, self.spec, table, window[0] if ras else None, sampled)

    def check(self, request: GenerationRequest) -> None:
        audio, frames = self.spec, request.audio_codes or []
        if request.params.stop:
            raise ValueError("stop strings do not apply to an audio-frame model")
        if request.prompt_embeddings is not None:
            raise ValueError("prompt embeddings do not apply to an audio-frame model")
        placeholders = sum(audio.is_frame_token(t) for t in request.prompt_token_ids)
        if placeholders != len(frames):
            raise ValueError(
                f"the prompt has {placeholders} audio frame token(s) but {len(frames)} frame(s) "
                "of audio_codes were given"
            )
        k, c = audio.num_codebooks, audio.codebook_size
        for frame in frames:
            if len(frame) != k or any(not isinstance(x, int) or not 0 <= x < c for x in frame):
                raise ValueError(f"each audio frame must be {k} integer codes in [0, {c})")

    def start(self, request: GenerationRequest, token_ids: list[int]) -> FrameState:
        audio, params = self.spec, request.params
        positions = [i for i, t in enumerate(token_ids) if audio.is_frame_token(t)]
        frames = dict(zip(positions, request.audio_codes or [], strict=True))
        window = None
        if params.ras_window:
            window = np.full((params.ras_window, audio.num_codebooks), -1, dtype=np.int64)
            recent = list(frames.values())[-params.ras_window :]
            if recent:
                window[-len(recent) :] = recent
        constants = (params.ras_max_repeat, *delay_starts(audio, token_ids))
        delays = int(token_ids[-1] == audio.audio_delay_token_id)
        return FrameState(constants, frames, delays, window)

    def step_inputs(self, batch: StepBatch, device: torch.device) -> FrameInputs | None:
        """Mark the batch's frame positions (decodes first, then each chunk: the flat order)."""
        rows: list[int] = []
        codes: list[list[int]] = []
        row = 0
        for seq in batch.decodes:
            frame = _state(seq).frames.get(seq.num_computed)
            if frame is not None:
                rows.append(row)
                codes.append(frame)
            row += 1
        for work in batch.prefills:
            frames = _state(work.seq).frames
            for pos in range(work.start, work.start + work.length):
                frame = frames.get(pos)
                if frame is not None:
                    rows.append(row)
                    codes.append(frame)
                row += 1
        if not rows:
            return None  # text only
        inputs = FrameInputs(torch.tensor(codes, dtype=torch.int64, device=device))  # [A, K]
        if len(rows) == row:
            return inputs  # audio only: audio_rows None
        audio = set(rows)
        text = [r for r in range(row) if r not in audio]
        inputs.audio_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        inputs.text_rows = torch.tensor(text, dtype=torch.int64, device=device)
        return inputs

    def graph_inputs(self, rows: int, device: torch.device) -> FrameInputs:
        # every row a frame (audio_rows None): the audio path alone
        k = self.spec.num_codebooks
        return FrameInputs(torch.zeros(rows, k, dtype=torch.int64, device=device))

    def fill_graph_inputs(self, static: FrameInputs, decodes: list[Sequence]) -> None:
        # every generated position of an audio model is a frame: a decode is audio only
        codes = [_state(seq).frames[seq.num_computed] for seq in decodes]
        static.audio_codes.zero_()  # padded rows embed frame 0 (their output is unused)
        static.audio_codes[: len(codes)].copy_(torch.tensor(codes), non_blocking=True)

    def profile_inputs(self, decodes: int, rows: int, device: torch.device) -> FrameInputs | None:
        if not decodes:
            return None
        # an audio model decodes frames: its audio path, mixed with a prompt's text rows
        k = self.spec.num_codebooks
        inputs = FrameInputs(torch.zeros(decodes, k, dtype=torch.int64, device=device))
        if rows > decodes:
            inputs.audio_rows = torch.arange(decodes, device=device)
            inputs.text_rows = torch.arange(decodes, rows, device=device)
        return inputs

    def draw(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None
    ) -> torch.Tensor:  # [R, K] int64 on the logits' device
        """One frame table (a row a request: its sampling row, the position and clocks of the
        frame it draws, its constants) and, where a row asks for repetition-aware sampling,
        one window [R, W, K]: two host-to-device copies, then draw_frames."""
        states = [_state(s) for s in seqs]
        rows = [
            (*s.sampling_row, s.num_tokens, s.num_output_tokens, st.delays, *st.constants)
            for s, st in zip(seqs, states, strict=True)
        ]
        table = frame_table(rows, self.spec)
        return self._draw(logits, table, [st.window for st in states])

    def _draw(
        self, logits: torch.Tensor, table: torch.Tensor, windows: list[np.ndarray | None]
    ) -> torch.Tensor:
        dev, rows = logits.device, len(windows)
        sampled = bool((table[:, 0] > 0).any())
        window = None
        widths = [0 if w is None else len(w) for w in windows]
        if any(widths):  # rows without RAS (or a shorter window) padded with -1: never a code
            host = np.full((rows, max(widths), self.spec.num_codebooks), -1, np.int64)
            for i, w in enumerate(windows):
                if w is not None:
                    host[i, host.shape[1] - len(w) :] = w
            window = torch.from_numpy(host)
        graphs = self.graphs
        if graphs is not None and dev.type == "cuda" and 0 < rows <= graphs.max_rows:
            inputs = [table] if window is None else [table, window]
            return graphs((sampled, window is not None), logits, inputs)
        copy = dev.type == "cuda"
        table = table.to(dev, non_blocking=copy)
        window = None if window is None else window.to(dev, non_blocking=copy)
        return draw_frames(logits, self.spec, table, window, sampled)

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None
    ) -> list[list[int]]:
        if not seqs:  # a step of prefill chunks that complete no prompt
            return []
        frames: list[list[int]] = self.draw(logits, seqs, greedy).tolist()
        return frames

    def profile_sample(self, logits: torch.Tensor) -> None:
        rows, k = logits.shape[0], self.spec.num_codebooks
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        row = (*sampling_row(params, request_seed(0)), 1, 0, 0, 2, *([0] * (2 * k)))
        windows: list[np.ndarray | None] = [np.zeros((7, k), np.int64)] * rows
        self._draw(logits, frame_table([row] * rows, self.spec), windows)

    def append(self, seq: Sequence, draw: list[int]) -> TokenEvent:
        """The reference's bookkeeping after a frame: its text-track token, the end of audio."""
        frame, audio = draw, self.spec
        token = audio.next_text_token(frame, seq.token_ids[-1])
        ends = token == audio.eos_token_id
        if ends and seq.params.ignore_eos:  # benchmarks: keep decoding frames past the end
            token, ends = audio.audio_delay_token_id, False
        seq.token_ids.append(token)
        state = _state(seq)
        state.delays += token == audio.audio_delay_token_id
        if audio.is_frame_token(token):  # the next step embeds this frame at this position
            state.frames[seq.num_tokens - 1] = frame
            window = state.window
            if window is not None:
                window[:-1] = window[1:].copy()
                window[-1] = frame
        if ends:
            seq.finish_reason = FinishReason.STOP
        elif seq.num_output_tokens >= seq.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        event = seq.event([] if ends else [token], "")
        event.audio_frames = [frame]
        return event
