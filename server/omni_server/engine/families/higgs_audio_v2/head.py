"""Higgs Audio v2's step output (the engine's `Head`, engine/head.py): one frame of K codes a
request a step, drawn under the delay pattern (frames.py), and the text-track token it implies.

What the engine's generic step asks of it, and where the old audio branches of the engine went:

    check / start       the request's frames against its prompt's frame tokens; FrameState
    step_inputs         the frames of the batch's frame positions (FrameInputs), flat row order
    graph_inputs / fill a decode graph's static [b, K] codes (every decode row is a frame)
    sample              delay masks, sample_frames, repetition-aware redraws
    append              the text-track token, the frame recorded, the end of audio
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omni_server.engine.attention import ForwardBatch
from omni_server.engine.families.higgs_audio_v2.frames import (
    AudioSpec,
    DelayState,
    redraw_repeats,
    sample_frames,
)
from omni_server.engine.sampling import SamplingParams
from omni_server.engine.sequence import FinishReason, GenerationRequest, Sequence, TokenEvent
from omni_server.engine.step_batch import StepBatch


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

    delay: DelayState
    # position -> its frame, for every frame token (prompt and output): what the model embeds
    frames: dict[int, list[int]]
    # the frames in order (prompt's, then generated): repetition-aware sampling's window
    history: list[list[int]] = field(default_factory=list)


def _state(seq: Sequence) -> FrameState:
    assert isinstance(seq.state, FrameState), "an audio model's requests carry FrameState"
    return seq.state


class FrameHead:
    """The audio head: [K * C] logits a row, one frame of K codes a request a step."""

    argmax_is_draw = False  # a frame is K draws under masks: no argmax in the graph

    def __init__(self, spec: AudioSpec) -> None:
        self.spec = spec

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
        audio = self.spec
        positions = [i for i, t in enumerate(token_ids) if audio.is_frame_token(t)]
        frames = dict(zip(positions, request.audio_codes or [], strict=True))
        return FrameState(DelayState(audio, token_ids), frames, list(frames.values()))

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

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None
    ) -> list[list[int]]:
        params, generators = [s.params for s in seqs], [s.generator for s in seqs]
        masks = [_state(s).delay.next_masks(s.token_ids[-1]) for s in seqs]
        frames = sample_frames(logits, self.spec, masks, params, generators)
        if any(p.ras_window for p in params):
            histories = [_state(s).history for s in seqs]
            redraw_repeats(logits, self.spec, frames, histories, params, generators)
        return frames

    def profile_sample(self, logits: torch.Tensor) -> None:
        rows, k = logits.shape[0], self.spec.num_codebooks
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * rows
        generators = [torch.Generator().manual_seed(0) for _ in range(rows)]
        masks = [([False] * k, [False] * k)] * rows
        sample_frames(logits, self.spec, masks, params, generators)

    def append(self, seq: Sequence, draw: list[int]) -> TokenEvent:
        """The reference's bookkeeping after a frame: its text-track token, the end of audio."""
        frame, audio = draw, self.spec
        token = audio.next_text_token(frame, seq.token_ids[-1])
        ends = token == audio.eos_token_id
        if ends and seq.params.ignore_eos:  # benchmarks: keep decoding frames past the end
            token, ends = audio.audio_delay_token_id, False
        seq.token_ids.append(token)
        if audio.is_frame_token(token):  # the next step embeds this frame at this position
            state = _state(seq)
            state.frames[seq.num_tokens - 1] = frame
            state.history.append(frame)
        if ends:
            seq.finish_reason = FinishReason.STOP
        elif seq.num_output_tokens >= seq.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        event = seq.event([] if ends else [token], "")
        event.audio_frames = [frame]
        return event
