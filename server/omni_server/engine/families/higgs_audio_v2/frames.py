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
  with the request's own generator drawing K uniforms a frame in codebook order (sampling.py), so
  a seeded request's frames do not depend on the batch it ran in.

- **repetition-aware sampling** (`SamplingParams.ras_window` / `ras_max_repeat`, transformers'
  `ras_win_len` / `ras_win_max_num_repeat`, which the published generation_config.json sets to
  7 / 2): after a frame is drawn, a codebook whose code (not BOS / EOS) already appears
  `ras_max_repeat` times in that codebook over the request's last `ras_window` frames (the
  prompt's included) is redrawn from the softmax of its raw logits, greedy requests too. The
  rule is the reference's; the draw is not: transformers uses the global torch RNG, the engine
  the request's own generator (one more uniform a redrawn codebook), so seeded output stays
  reproducible and batch-independent but cannot equal the reference's sampled codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_server.engine.sampling import SamplingParams, greedy_tokens


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


class DelayState:
    """One request's delay counters (the reference keeps one row of these per batch row).

    bos[k] >= 0: codebook k is forced to BOS at the next frame (then decremented);
    eos[k] <= 0: codebook k is forced to EOS (each frame after a delay token decrements all).
    Lives as long as the request, through preemption: a recomputed prompt never re-derives it.
    """

    def __init__(self, spec: AudioSpec, prompt: list[int]) -> None:
        self.spec = spec
        k = spec.num_codebooks
        delay = list(range(1, k + 1))
        window = prompt[-k:]
        self.bos = [0] * k
        if spec.audio_bos_token_id in window:
            after = k - window.index(spec.audio_bos_token_id)
            self.bos = [d - after for d in delay]
        self.eos = list(delay)
        if spec.audio_delay_token_id in window:
            after = k - window.index(spec.audio_delay_token_id)
            self.eos = [d - after for d in delay]

    def next_masks(self, last_token: int) -> tuple[list[bool], list[bool]]:
        """(force BOS, force EOS) per codebook for the frame about to be sampled; advances the
        counters as the reference does once per generation step."""
        force_bos = [b >= 0 for b in self.bos]
        self.bos = [b - 1 if f else b for b, f in zip(self.bos, force_bos, strict=True)]
        if last_token == self.spec.audio_delay_token_id:
            self.eos = [e - 1 for e in self.eos]
        return force_bos, [e <= 0 for e in self.eos]


def sample_frames(
    logits: torch.Tensor,  # [R, K * C] float32, the audio head's
    spec: AudioSpec,
    masks: list[tuple[list[bool], list[bool]]],  # per row: DelayState.next_masks
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[list[int]]:  # [R][K] codes
    """The frame of every row: the delay masks applied, then greedy or sampling.py's sampler,
    row by row the same function, for all R x K codebooks at once on the logits' device, with
    one host-to-device copy (masks, settings and uniforms in one tensor) and one copy back.

    The same codes as sampling.sample per row: temperature, then top-k, top-p, min-p over the
    sorted probabilities, the inverse CDF in vocabulary order at the request's uniform (its
    generator draws K in codebook order; a greedy request draws none); greedy rows take the
    argmax (the first maximum)."""
    rows, k, c = logits.shape[0], spec.num_codebooks, spec.codebook_size
    if rows == 0:  # a step of prefill chunks that complete no prompt
        return []
    device = logits.device
    # [R, K, 7]: force BOS, force EOS, temperature (0: greedy), top-k, top-p, min-p, uniform
    host = torch.zeros((rows, k, 7), dtype=torch.float32)
    host[:, :, 0] = torch.tensor([m[0] for m in masks], dtype=torch.float32)
    host[:, :, 1] = torch.tensor([m[1] for m in masks], dtype=torch.float32)
    settings = [(p.temperature, p.top_k or c, p.top_p, p.min_p) for p in params]
    host[:, :, 2:6] = torch.tensor(settings, dtype=torch.float32)[:, None, :]
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            host[i, :, 6] = torch.rand(k, generator=g)  # equal to K draws of one, in order
    table = host.to(device, non_blocking=device.type == "cuda").view(rows * k, 7)
    force_bos, force_eos = table[:, 0:1] > 0, table[:, 1:2] > 0  # [N, 1], N = R * K
    temperature, top_k, top_p, min_p, uniform = (table[:, i : i + 1] for i in range(2, 7))
    codes = torch.arange(c, device=device)  # [C]
    scores = logits.view(rows * k, c)  # out of place below: graph outputs are static buffers
    scores = scores.masked_fill(force_bos & (codes != spec.stream_bos_id), -torch.inf)
    scores = scores.masked_fill(force_eos & (codes != spec.stream_eos_id), -torch.inf)
    greedy = greedy_tokens(scores)  # [N]
    if all(p.greedy for p in params):
        return greedy.view(rows, k).tolist()
    # sampling.py's _sample_rows on every row (a greedy row's result is discarded below)
    scaled = scores / torch.where(temperature > 0, temperature, 1.0)
    sorted_scores, order = torch.sort(scaled, dim=-1, descending=True)  # [N, C]
    probs = sorted_scores.softmax(dim=-1)
    drop = codes >= top_k  # ranks past top-k
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p
    drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False
    kept = torch.zeros_like(probs).scatter_(1, order, probs.masked_fill(drop, 0.0))
    cdf = kept.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
    picked = torch.where(temperature.squeeze(1) > 0, picked.clamp_(max=c - 1), greedy)
    return picked.view(rows, k).tolist()


def redraw_repeats(
    logits: torch.Tensor,  # [R, K * C] float32 raw (no delay masks, no temperature)
    spec: AudioSpec,
    frames: list[list[int]],  # [R][K] just drawn; codes are replaced in place
    histories: list[list[list[int]]],  # per row: the request's frames so far, oldest first
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> None:
    """Repetition-aware sampling, the reference's rule with the request's own generator: the
    repeats found on the host, all of them redrawn in one batch (a request's uniforms drawn in
    codebook order, as one codebook at a time would)."""
    k, c = spec.num_codebooks, spec.codebook_size
    special = (spec.stream_bos_id, spec.stream_eos_id)
    picks: list[tuple[int, int]] = []  # (row, codebook) to redraw, in draw order
    uniforms: list[torch.Tensor] = []
    for i, p in enumerate(params):
        window = histories[i][-p.ras_window :] if p.ras_window else []
        for j in range(k if window else 0):
            code = frames[i][j]
            if code in special or sum(f[j] == code for f in window) < p.ras_max_repeat:
                continue
            picks.append((i, j))
            uniforms.append(torch.rand((), generator=generators[i]))
    if not picks:
        return
    index = torch.tensor([i * k + j for i, j in picks], device=logits.device)
    cdf = logits.view(-1, c).index_select(0, index).softmax(dim=-1).cumsum(dim=-1)  # [P, C]
    u = torch.stack(uniforms).to(logits.device).unsqueeze(1)  # [P, 1]
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=c - 1)
    for (i, j), code in zip(picks, picked.tolist(), strict=True):
        frames[i][j] = code
