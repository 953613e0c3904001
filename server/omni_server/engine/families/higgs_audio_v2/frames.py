"""Audio frames: one step of an audio-head model (Higgs Audio v2) emits K codes at once, one per
codebook, under a delay pattern; the text track beside them says what each position is.

The reference is transformers' `HiggsAudioV2GenerationMixin._sample` and its
`HiggsAudioV2DelayPatternLogitsProcessor`; this module reproduces them per request:

- **delay at the start.** Codebook k (0-based) is forced to the stream BOS code for the first
  k + 1 frames after `<|audio_out_bos|>` (counted from where that token sits in the prompt's last
  K tokens; no such token: only the first frame is forced).
- **delay at the end.** Once any codebook emits the stream EOS code, the next text-track token is
  the delay token; from then on, at each frame one more codebook is forced to EOS (codebook 0 at
  the first delayed frame, all K after K of them). The frame whose K codes are all EOS ends the
  request: its text-track token is `eos_token_id`.
- **the text track.** Each frame's position in the sequence holds `<|AUDIO_OUT|>` (or the delay
  token during the closing delay). Both are "frame tokens": the model embeds such a position as
  the sum of its K code embeddings and runs it through the audio FFN (a prompt's reference audio
  uses the same placeholders, with the frames given in the request).
- **sampling.** Per codebook, K rows of C codes: greedy, or temperature / top-k / top-p / min-p
  (sampling.py's filters), codebook k drawing the uniform of lane k at the frame's position
  from the request's seed, so a seeded request's frames do not depend on the batch it ran in.

- **repetition-aware sampling** (`SamplingParams.ras_window` / `ras_max_repeat`, transformers'
  `ras_win_len` / `ras_win_max_num_repeat`, which the published generation_config.json sets to
  7 / 2): after a frame is drawn, a codebook whose code (not BOS / EOS) already appears
  `ras_max_repeat` times in that codebook over the request's last `ras_window` frames (the
  prompt's included) is redrawn from the softmax of its raw logits, greedy requests too. The
  rule is the reference's; the draw is not: transformers uses the global torch RNG, the engine
  the request's seed (lane K + k), so seeded output stays reproducible and batch-independent
  but cannot equal the reference's sampled codes.

All of it is one function of tensors on the logits' device (`draw_frames`): a step's rows cross
as one float64 table (`frame_table`: sampling.py's columns, then the delay clocks and the
request's constants) plus, with repetition-aware sampling, one [R, W, K] window of recent
frames; the host reads back the [R, K] frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omni_server.engine.sampling import greedy_tokens
from omni_server.models.draws import COLUMNS, MIN_P, TEMPERATURE, filtered_draw, uniforms


@dataclass(frozen=True)
class AudioSpec:
    """The audio head of a checkpoint (config.json fields of higgs_audio_v2)."""

    num_codebooks: int  # K
    codebook_size: int  # C codes a codebook, its stream BOS / EOS codes included (1026 = 1024 + 2)
    stream_bos_id: int  # the code before a codebook's first real code (1024)
    stream_eos_id: int  # the code after its last (1025)
    audio_token_id: int  # <|AUDIO_OUT|>: a text-track position that carries a frame
    audio_bos_token_id: int  # <|audio_out_bos|>: ends a prompt that asks for audio
    audio_delay_token_id: int  # a frame's text-track token during the closing delay
    eos_token_id: int | None  # the text-track token after the all-EOS frame

    def is_frame_token(self, token_id: int) -> bool:
        return token_id == self.audio_token_id or token_id == self.audio_delay_token_id

    def next_text_token(self, frame: list[int], last_token: int) -> int:
        """The text-track token of a frame sampled after `last_token` (the reference's rule)."""
        eos = [code == self.stream_eos_id for code in frame]
        if all(eos) and self.eos_token_id is not None:
            return self.eos_token_id
        if any(eos) or last_token == self.audio_delay_token_id:
            return self.audio_delay_token_id
        return self.audio_token_id


# A frame table's columns past sampling.py's COLUMNS: the frames the request drew so far, the
# delay tokens among its last tokens so far (the closing delay's clock), ras_max_repeat (0: off),
# then K columns of BOS starts and K of EOS starts (`delay_starts`)
FRAMES_DRAWN, DELAYS, RAS_MAX_REPEAT, DELAY_STARTS = range(COLUMNS, COLUMNS + 4)


def delay_starts(spec: AudioSpec, prompt: list[int]) -> tuple[int, ...]:
    """A request's delay pattern as 2K constants (the reference keeps them as counters a batch
    row): codebook k is forced to BOS at the frame t (0-based) while bos[k] >= t, and to EOS
    once eos[k] <= the delay tokens seen as the last token so far (`DELAYS`)."""
    k = spec.num_codebooks
    delay = list(range(1, k + 1))
    window = prompt[-k:]
    bos = [0] * k  # no <|audio_out_bos|>: only the first frame is forced
    if spec.audio_bos_token_id in window:
        after = k - window.index(spec.audio_bos_token_id)
        bos = [d - after for d in delay]
    eos = list(delay)
    if spec.audio_delay_token_id in window:
        after = k - window.index(spec.audio_delay_token_id)
        eos = [d - after for d in delay]
    return (*bos, *eos)


def frame_table(rows: list[tuple[float, ...]], spec: AudioSpec) -> torch.Tensor:
    """[R, COLUMNS + 3 + 2K] float64 host: each row sampling.py's row + (position,) + (frames
    drawn, delays, ras_max_repeat) + delay_starts."""
    width = DELAY_STARTS + 2 * spec.num_codebooks
    return torch.from_numpy(np.array(rows, dtype=np.float64).reshape(len(rows), width))


def draw_frames(
    logits: torch.Tensor,  # [R, K * C] float32, the audio head's
    spec: AudioSpec,
    table: torch.Tensor,  # [R, F] frame_table on the logits' device
    window: torch.Tensor | None,  # [R, W, K] int64 recent frames (-1: none); None: no RAS row
    sampled: bool,  # some row has temperature > 0 (False: the filters are skipped)
) -> torch.Tensor:  # [R, K] int64
    """The frame of every row, pure tensor work (no host state, no sync): the delay masks,
    then greedy (the first maximum) or sampling.py's filtered draw per codebook, then the
    repetition-aware redraws."""
    rows, k, c = logits.shape[0], spec.num_codebooks, spec.codebook_size
    dev = logits.device
    starts = table[:, DELAY_STARTS : DELAY_STARTS + 2 * k]
    force_bos = starts[:, :k] >= table[:, FRAMES_DRAWN : FRAMES_DRAWN + 1]  # [R, K]
    force_eos = starts[:, k:] <= table[:, DELAYS : DELAYS + 1]
    codes = torch.arange(c, device=dev)  # [C]
    scores = logits.view(rows, k, c)  # out of place below: graph outputs are static buffers
    scores = scores.masked_fill(force_bos[..., None] & (codes != spec.stream_bos_id), -torch.inf)
    scores = scores.masked_fill(force_eos[..., None] & (codes != spec.stream_eos_id), -torch.inf)
    flat = scores.view(rows * k, c)
    frame = greedy_tokens(flat).view(rows, k)
    if not sampled and window is None:
        return frame
    # [R, 2K]: codebook k's draw at lane k, its repetition-aware redraw at lane K + k (one
    # hash pass for both)
    u = uniforms(table, torch.arange(2 * k, device=dev).expand(rows, 2 * k))
    if sampled:
        settings = table[:, TEMPERATURE : MIN_P + 1].to(torch.float32)  # [R, 4]
        each = settings[:, None, :].expand(rows, k, 4).reshape(rows * k, 4)  # [R * K, 4]
        picked = filtered_draw(flat, each, u[:, :k].reshape(-1))
        frame = torch.where(settings[:, :1] > 0, picked.view(rows, k), frame)
    if window is None:
        return frame
    # repetition-aware: a code seen ras_max_repeat times in its codebook's window is redrawn
    counts = (window == frame[:, None, :]).sum(dim=1)  # [R, K]
    most = table[:, RAS_MAX_REPEAT : RAS_MAX_REPEAT + 1]  # [R, 1]
    special = (frame == spec.stream_bos_id) | (frame == spec.stream_eos_id)
    repeats = (most > 0) & (counts >= most) & ~special
    cdf = logits.view(rows, k, c).softmax(dim=-1).cumsum(dim=-1)  # [R, K, C] raw logits
    target = u[:, k:].unsqueeze(-1) * cdf[..., -1:]
    redrawn = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=c - 1)
    return torch.where(repeats, redrawn, frame)
