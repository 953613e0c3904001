"""Attention over a flat batch of tokens that reads and writes the paged KV cache.

One forward carries the tokens of many requests, flattened: first one decode token per decoding
request, then each prefilling request's chunk. `ForwardBatch` says, per token, its position and
the cache slot its K/V is written to, and, per request, which cache slots hold its context.

Grouped-query attention never repeats K/V (HF's `repeat_kv` maps query head h to KV head h // G,
G = H / Hkv; so does every path here): decode rows lay the G query heads of a KV head out as G
query rows against its keys (matmuls on the CPU, paged_decode.py's kernel on CUDA); a prefill
chunk goes to SDPA with `enable_gqa` over its context's keys (`prefill_attention`: flash
attention on CUDA in half precision).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from omni_server.engine.paged_decode import paged_decode_attention


@dataclass
class DecodeGroup:
    """The first `num_seqs` tokens of the batch: one new token per request, batched together.

    One form of three: the gathered one (CPU: torch's matmuls over each context gathered and
    padded), the span (CPU, one request whose blocks are consecutive: its context is one run of
    cache slots, read in place, nothing gathered or masked) or the paged one (CUDA with Triton:
    paged_decode.py reads each request's blocks, nothing gathered or padded).
    """

    num_seqs: int
    kv_slots: torch.Tensor | None = None  # [B, L] int64: slots of each context (0-padded)
    kv_mask: torch.Tensor | None = None  # [B, 1, 1, L] bool: True where slot is in that context
    block_tables: torch.Tensor | None = None  # [B, W] int32: each request's KV blocks
    context_lens: torch.Tensor | None = None  # [B] int32: keys each request attends to
    block_size: int = 0  # tokens per block (with block_tables)
    kv_span: tuple[int, int] | None = None  # (first slot, length): the one request's context


@dataclass
class PrefillChunk:
    """Tokens [start, start + length) of the batch: a chunk of one request's prompt."""

    start: int
    length: int
    # [ctx] int64: slots of positions 0..ctx-1, this chunk's included (its last n): the chunk
    # starts at position ctx - n and attends causally (attention.prefill_attention)
    kv_slots: torch.Tensor


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V goes (slot 0 = scratch)
    logits_indices: torch.Tensor  # [R] int64: tokens whose next-token logits are wanted
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]
    # What the model's family reads besides token ids (its head's step_inputs, head.py), e.g.
    # higgs_audio_v2's FrameInputs; None: token ids only. Only the family's own module reads it.
    family_inputs: Any = None


def paged_attention(
    q: torch.Tensor,  # [T, H, D]  (RoPE applied)
    k_cache: torch.Tensor,  # [S, Hkv, D]  (this layer; the batch's new K already written)
    v_cache: torch.Tensor,  # [S, Hkv, D]
    batch: ForwardBatch,
) -> torch.Tensor:  # [T, H, D]
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    decode = batch.decode
    if decode is not None and decode.kv_span is not None:  # batch-1 decode on the CPU
        start, end = decode.kv_span[0], sum(decode.kv_span)
        one = _one_query(q[:1], k_cache[start:end], v_cache[start:end])
        if not batch.prefills:
            return one  # no gather, no mask, no copy
    whole = decode is not None and decode.num_seqs == q.shape[0] and not batch.prefills
    if whole and decode is not None and decode.block_tables is not None:
        assert decode.context_lens is not None  # every row a decode: the kernel's output as is
        return paged_decode_attention(
            q, k_cache, v_cache, decode.block_tables, decode.context_lens, decode.block_size
        )
    out = torch.empty_like(q)
    if decode is not None and decode.kv_span is not None:
        out[:1] = one
    elif decode is not None and decode.block_tables is not None:
        assert decode.context_lens is not None
        b = decode.num_seqs
        out[:b] = paged_decode_attention(
            q[:b], k_cache, v_cache, decode.block_tables, decode.context_lens, decode.block_size
        )
    elif decode is not None and decode.num_seqs:
        assert decode.kv_slots is not None and decode.kv_mask is not None
        b = decode.num_seqs
        qd = q[:b].view(b, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
        kd = _gather(k_cache, decode.kv_slots).transpose(1, 2)  # [B, Hkv, L, D]
        vd = _gather(v_cache, decode.kv_slots).transpose(1, 2)
        # Plain matmuls, not SDPA: for one query row per head SDPA's CPU flash kernel costs a
        # parallel region per call (~1 ms on a loaded 2-core machine); this is 4 small kernels.
        scores = torch.matmul(qd, kd.transpose(-1, -2)) * head_dim**-0.5  # [B, Hkv, G, L]
        scores = scores.float().masked_fill_(~decode.kv_mask, float("-inf"))
        od = torch.matmul(scores.softmax(dim=-1).to(vd.dtype), vd)  # [B, Hkv, G, D]
        out[:b] = od.reshape(b, num_heads, head_dim)
    for chunk in batch.prefills:
        n = chunk.length
        kp = _gather(k_cache, chunk.kv_slots)  # [ctx, Hkv, D]: this chunk's context only
        vp = _gather(v_cache, chunk.kv_slots)
        out[chunk.start : chunk.start + n] = prefill_attention(
            q[chunk.start : chunk.start + n], kp, vp
        )
    return out


def _one_query(
    q: torch.Tensor,  # [1, H, D]: one request's decode token
    k: torch.Tensor,  # [L, Hkv, D]: its whole context, a view of the cache
    v: torch.Tensor,
) -> torch.Tensor:  # [1, H, D]
    # The G query heads of a KV head are G rows against its keys: two bmm over strided views
    # (BLAS reads them in place) and a softmax, the gathered path's numbers without its copies.
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    qd = q.view(num_kv_heads, -1, head_dim)  # [Hkv, G, D]
    scores = torch.bmm(qd, k.permute(1, 2, 0)).mul_(head_dim**-0.5)  # [Hkv, G, L]
    if scores.dtype == torch.float32:
        probs = scores.softmax(dim=-1)
    else:  # softmax in float32, as the gathered path
        probs = scores.float().softmax(dim=-1).to(v.dtype)
    return torch.bmm(probs, v.transpose(0, 1)).view(1, -1, head_dim)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for slots of any shape [...] -> [..., Hkv, D].

    index_select, not advanced indexing: on CPU the latter opens a parallel region per call that
    costs ~1 ms on a loaded 2-core machine, against a few microseconds for the copy itself.
    """
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def prefill_attention(
    q: torch.Tensor,  # [n, H, D]: a chunk's queries, positions ctx - n .. ctx - 1
    k: torch.Tensor,  # [ctx, Hkv, D]: its request's keys at positions 0 .. ctx - 1
    v: torch.Tensor,
) -> torch.Tensor:  # [n, H, D]
    """Causal attention of one prompt chunk over its context: SDPA with `enable_gqa`, the G
    query heads of a KV head read its keys as they are (no K/V repeated or broadcast).

    [n, H, D] is flash attention's own [S, H, D] layout, so the [1, H, n, D] views cost no copy
    on CUDA. A chunk after the first (ctx > n) attends to the whole prefix plus its own causal
    part: the causal mask aligned bottom-right (query i at position ctx - n + i), which SDPA's
    is_causal (top-left) is not; torch's `causal_lower_right` bias runs it in flash attention
    without a mask where it can (CUDA, half precision) and materializes the [n, ctx] mask only
    where it cannot (CPU, float32)."""
    n, ctx = q.shape[0], k.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    kh = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
    vh = v.transpose(0, 1).unsqueeze(0)
    if ctx == n:  # the first chunk: top-left and bottom-right alignment agree
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        # imported at first use: torch.nn.attention.bias imports torch._dynamo, 2-3 s of a
        # stage process's start on a loaded machine (docs/runtime.md, "Recovery")
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(n, ctx)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, enable_gqa=True)
    return o[0].transpose(0, 1)  # [n, H, D]
