"""Many speeches' talker steps at once (plain torch; the talker stage of examples/qwen3-omni).

A speech's life here, one frame a cycle:

    start          its prompt prefilled alone (prompts differ in length); the first frame's
                   code-0 logits are ready
    choose_code0   code 0 from its logits (repetition penalty, the reference's suppression,
                   then greedy or seeded sampling); codec EOS ends the speech
    complete       codes 1 .. G-1 by the code predictor, every chosen row in one batch (all
                   rows are at the same depth: the predictor starts afresh each frame); the
                   frame's G embeddings summed are the talker's next input, minus its text
    advance        + the thinker text of this step (the caller waits until it has it: late text
                   is never replaced by tts_pad), every ready row in one talker forward

Rows share the talker's weights and every linear / MoE product of a step; attention runs per
row over each speech's own KV cache (lengths differ), so a row's numbers do not depend on the
batch. Sampled codes take the counter-based uniforms the engine uses (models/draws.py) of (the
speech's seed, its frame's position, the code's group): reproducible and batch-independent,
the same bits on the CPU and a GPU, and no draw waits for the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omni_server.models.draws import (
    MIN_P,
    TEMPERATURE,
    filtered_draw,
    request_seed,
    seed_key,
    step_table,
    uniforms,
)
from omni_server.models.qwen3_omni.layers import (
    DecoderLayer,
    KVCache,
    apply_rotary,
    attend,
    rotary_cos_sin,
)
from omni_server.models.qwen3_omni.talker import CodePredictor, Talker
from omni_server.models.qwen3_omni.thinker import Decoder, prompt_positions


@dataclass(frozen=True)
class CodeSampling:
    """How a speech's codes are chosen. temperature 0: greedy (code 0 and the residual codes).
    The residual codes sample with their own top-k / top-p (the reference: 50, 0.8)."""

    temperature: float = 0.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    predictor_top_k: int = 50
    predictor_top_p: float = 0.8
    suppress_eos: bool = False  # never end (benchmarks, and the tests' long comparisons)

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must lie in 0..2; got {self.temperature}")
        if self.top_k < 0 or self.predictor_top_k < 0:
            raise ValueError("top_k must be >= 0 (0: off)")
        if not (0.0 < self.top_p <= 1.0 and 0.0 < self.predictor_top_p <= 1.0):
            raise ValueError("top_p must lie in (0, 1]")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0; got {self.repetition_penalty}")


# One row's draw (a row of models/draws.py's table): temperature (0: greedy), top-k (0: off),
# top-p, the request's key (draws.seed_key) and the position of the frame drawn. A frame's
# code 0 draws lane 0 of its position, its code g (1 .. G-1) lane g: every uniform is a pure
# function of (seed, position, lane), so a seeded speech's frames do not depend on the batch,
# the device or the order rows were stepped in, and no draw waits for the host.
Rule = tuple[float, int, float, float, float, int]


def draw_table(rules: list[Rule], device: torch.device) -> torch.Tensor | None:
    """The rows' draws as one table [B, COLUMNS] on `device` (one copy), None when every row is
    greedy (then `pick_rows` is one argmax)."""
    if not any(rule[0] > 0 for rule in rules):
        return None
    # TEMPERATURE, TOP_K, TOP_P, MIN_P, KEY_LO, KEY_HI, POSITION
    rows: list[tuple[float, ...]] = [
        (t, float(k), float(p), 0.0, lo, hi, float(pos)) for t, k, p, lo, hi, pos in rules
    ]
    return step_table(rows).to(device, non_blocking=device.type == "cuda")


def pick_rows(logits: torch.Tensor, table: torch.Tensor | None, lane: int = 0) -> torch.Tensor:
    """One id a row of logits [B, V] -> [B] long, pure tensor work on their device (no host
    sync; a CUDA graph can hold it): greedy rows (temperature 0, or no `table`) their argmax;
    sampled rows by temperature, top-k, top-p, then the inverse CDF at the uniform of (key,
    position, lane) (draws.filtered_draw)."""
    greedy = torch.argmax(logits, dim=-1)
    if table is None:
        return greedy
    settings = table[:, TEMPERATURE : MIN_P + 1].to(torch.float32)
    picked = filtered_draw(logits.float(), settings, uniforms(table, lane))
    return torch.where(settings[:, TEMPERATURE] > 0, picked, greedy)


@dataclass(eq=False)
class SpeechState:
    """One speech's talker side. Invariant: `pending` is None exactly when `logits` / `hidden`
    are the next frame's (a frame was completed and waits for its text otherwise)."""

    kv: KVCache
    logits: torch.Tensor  # [V]: the next frame's code-0 logits
    hidden: torch.Tensor  # [1, 1, hidden]: the talker's last normed hidden state
    sampling: CodeSampling
    key: tuple[float, float]  # the speech's seed as its draws' key (models/draws.py: seed_key)
    position: int  # the talker position of the next frame's code 0 (the prompt's length first)
    first_codes: list[int] = field(default_factory=list)  # code 0 of every frame so far
    pending: torch.Tensor | None = None  # [1, 1, hidden]: the last frame's summed embeddings

    @property
    def frames(self) -> int:
        return len(self.first_codes)


@torch.no_grad()
def start(
    talker: Talker,
    prompt: torch.Tensor,  # [1, T, hidden]
    max_frames: int,
    sampling: CodeSampling,
    seed: int | None,
) -> SpeechState:
    """Prefill a speech's prompt; its KV cache holds the prompt and `max_frames` frames."""
    kv = KVCache.for_decoder(talker.shape, prompt.shape[1] + max_frames + 1, like=prompt)
    hidden, _ = talker.model(prompt, prompt_positions(0, prompt.shape[1]), kv)
    last = hidden[:, -1:]
    key = seed_key(request_seed(seed))
    return SpeechState(kv, talker.codec_head(last)[0, 0], last, sampling, key, prompt.shape[1])


def choose_code0s(talker: Talker, states: list[SpeechState]) -> list[int]:
    """Code 0 of every row's next frame: repetition penalty over its codes 0 so far (positive
    logits divided, negative multiplied), the last 1024 ids but codec EOS suppressed (codec EOS
    too with `suppress_eos`), then greedy or sampled. One host sync for all rows."""
    logits = torch.stack([s.logits for s in states]).float()  # [B, V]
    for row, state in enumerate(states):
        penalty = state.sampling.repetition_penalty
        if penalty != 1.0 and state.first_codes:
            seen = torch.tensor(sorted(set(state.first_codes)), device=logits.device)
            picked = logits[row, seen]
            logits[row, seen] = torch.where(picked < 0, picked * penalty, picked / penalty)
        if state.sampling.suppress_eos:
            logits[row, talker.ids.codec_eos] = -float("inf")
    logits[:, talker.suppressed] = -float("inf")
    rules: list[Rule] = [
        (s.sampling.temperature, s.sampling.top_k, s.sampling.top_p, *s.key, s.position)
        for s in states
    ]
    codes: list[int] = pick_rows(logits, draw_table(rules, logits.device)).tolist()
    return codes


@torch.no_grad()
def complete(talker: Talker, states: list[SpeechState], code0s: list[int]) -> list[list[int]]:
    """Each row's frame [code 0, codes 1 .. G-1], the code predictor run once for all rows;
    leaves each row's summed code embeddings in `pending`."""
    device = states[0].hidden.device
    first = talker.codec_embedding(torch.tensor(code0s, device=device)[:, None])  # [B, 1, h]
    hidden = torch.cat([s.hidden for s in states])  # [B, 1, h]
    rules: list[Rule] = [
        (s.sampling.temperature, s.sampling.predictor_top_k, s.sampling.predictor_top_p,
         *s.key, s.position)
        for s in states
    ]  # fmt: skip
    table = draw_table(rules, device)
    picked, step_input = residual_codes(talker.code_predictor, hidden, first, table)
    codes: list[list[int]] = picked.tolist()  # [B, G - 1]: one host sync
    for row, (state, code0) in enumerate(zip(states, code0s, strict=True)):
        state.pending = step_input[row : row + 1]
        state.first_codes.append(code0)
        state.position += 1
    return [[code0, *rest] for code0, rest in zip(code0s, codes, strict=True)]


def residual_codes(
    predictor: CodePredictor,
    hidden: torch.Tensor,  # [B, 1, h] the talker's last normed hidden state of each row
    first: torch.Tensor,  # [B, 1, h] each row's code-0 embedding
    table: torch.Tensor | None,  # draw_table of the rows' frames (None: all greedy)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes 1 .. G-1 of B frames [B, G - 1] (on the device, no host sync) by one code
    predictor run over all rows (a fresh KV cache of G positions), and each row's G code
    embeddings summed [B, 1, h] (code 0's first, then in group order: the talker's next input,
    minus its text). Code g draws lane g of its frame's position. Pure tensor work with no host
    sync: the talker family replays it from CUDA graphs (head.py)."""
    groups = len(predictor.lm_head) + 1
    kv = KVCache.for_decoder(predictor.shape, groups, batch=hidden.shape[0], like=hidden)
    x, step_input, picked = torch.cat((hidden, first), dim=1), first.clone(), []
    for g in range(groups - 1):
        positions = torch.arange(kv.length, kv.length + x.shape[1], device=x.device)
        out, _ = predictor.model(x, positions, kv)
        ids = pick_rows(predictor.lm_head[g](out[:, -1]), table, lane=g + 1)  # [B]
        picked.append(ids)
        x = predictor.codec_embedding[g](ids[:, None])  # [B, 1, h]
        step_input = step_input + x
    return torch.stack(picked, dim=1), step_input


@torch.no_grad()
def advance(talker: Talker, states: list[SpeechState], texts: torch.Tensor) -> None:
    """Feed each row's pending frame plus its text [B, 1, h] to the talker, one forward for all
    rows; each row's next code-0 logits and hidden state are then ready."""
    pending = [s.pending for s in states]
    if any(p is None for p in pending):
        raise RuntimeError("advance: a row has no completed frame to feed")
    x = torch.cat([p for p in pending if p is not None]) + texts.to(states[0].hidden)
    hidden = decode_rows(talker.model, x, [s.kv for s in states])
    logits = talker.codec_head(hidden)  # [B, 1, V]
    for row, state in enumerate(states):
        state.hidden = hidden[row : row + 1]
        state.logits = logits[row, 0]
        state.pending = None


def decode_rows(decoder: Decoder, x: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
    """One new position for each of B sequences [B, 1, hidden], each over its own KV cache (at
    its own length): projections, norms and MLP / experts batched, attention per row. Returns
    the normed hidden states [B, 1, hidden] and advances every cache by one."""
    b = x.shape[0]
    positions = torch.tensor([c.length for c in caches])
    cos, sin = rotary_cos_sin(
        positions.expand(3, -1), decoder.inv_freq, decoder.shape.mrope_section
    )
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]  # [B, 1, 1, D]: row b's position
    for layer in decoder.layers:
        assert isinstance(layer, DecoderLayer)
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, 1, -1, attn.head_dim)
        k = attn.k_proj(h).view(b, 1, -1, attn.head_dim)
        v = attn.v_proj(h).view(b, 1, -1, attn.head_dim).transpose(1, 2)
        if attn.q_norm is not None and attn.k_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B, H, 1, D]
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        rows = []
        for row, cache in enumerate(caches):
            keys, values = cache.write(layer.index, k[row : row + 1], v[row : row + 1])
            seen = torch.ones(1, keys.shape[2], dtype=torch.bool, device=x.device)
            rows.append(attend(q[row : row + 1], keys, values, seen, attn.head_dim**-0.5))
        x = x + attn.o_proj(torch.cat(rows))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    for cache in caches:
        cache.advance(1)
    out: torch.Tensor = decoder.norm(x)
    return out
