"""The engine's step workspace on a GPU, measured before the KV cache exists (memory.py sizes
the cache from it).

Profile forwards through the real model, against a scratch cache of two blocks (reads may
repeat slots: the gathers still allocate their full size), each at the largest shape a step can
take:

  mixed:   max_batch_size - 1 decodes at context max_seq_len (gathered: the padded gather of
           a batch whose longest request is max_seq_len; paged: the kernel's partial results)
           + one prefill chunk filling max_step_tokens that ends at max_seq_len (its context
           gather; a causal mask where SDPA builds one), then sampling every row with top-p
           (a sort over the vocabulary);
  prefill: one chunk of max_step_tokens tokens ending at max_seq_len;
  decode:  max_batch_size decodes at context max_seq_len, then sampling.

Eager steps reuse one another's memory, so their workspace is the largest peak. Decode graphs
(cuda_graphs) keep a private pool: the largest graph's intermediates (the decode peak) plus
every graph's static inputs and logits, which live as long as the engine, and the cuBLAS
workspace of the side stream they are captured on; that adds on top.
Peaks are torch.cuda.max_memory_allocated above what was allocated before each forward.
On the CPU the forwards run (tests) and every peak reads 0.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from omni_server.engine.attention import DecodeGroup, ForwardBatch, PrefillChunk
from omni_server.engine.config import DEFAULT_MAX_TOTAL_TOKENS, EngineConfig
from omni_server.engine.cuda_graphs import batch_buckets, context_buckets
from omni_server.engine.head import StepModel
from omni_server.engine.kv_cache import KVCache
from omni_server.engine.memory import KVBudget, check_host_kv, check_pinned, size_kv_cache
from omni_server.engine.paged_decode import use_paged

log = logging.getLogger("omni_server.engine")

_SMALL_BLOCK = 512  # the caching allocator's granularity for small tensors


@dataclass(frozen=True)
class Workspace:
    mixed: int  # peak of the mixed step, bytes
    prefill: int
    decode: int
    graphs: int  # decode graphs' pool and static buffers (0 without graphs)

    @property
    def total(self) -> int:
        return max(self.mixed, self.prefill, self.decode) + self.graphs


def plan_kv_cache(
    model: StepModel, config: EngineConfig, max_seq_len: int
) -> tuple[int, KVBudget | None]:
    """The KV cache's token budget, and the sizing it came from (None where nothing is sized).

    On a GPU with a memory fraction: sized from it, or a pinned max_total_tokens checked
    against it (MemoryBudgetError when the budget cannot hold it). Elsewhere: max_total_tokens,
    or DEFAULT_MAX_TOTAL_TOKENS; on the CPU checked against the host memory available."""
    device = next(model.parameters()).device
    fraction = config.gpu_memory_fraction
    if device.type == "cpu":
        tokens = config.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS
        token_bytes = KVCache.token_bytes(model.local_shape, config.torch_dtype)
        check_host_kv(tokens, token_bytes, available_host_bytes())
        return tokens, None
    if device.type != "cuda" or fraction is None:
        return config.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS, None
    pinned = config.max_total_tokens
    if pinned is not None:  # no step can see a longer context than the cache holds
        max_seq_len = min(max_seq_len, pinned)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    resident = torch.cuda.memory_reserved(device)
    workspace = measure_workspace(model, config, max_seq_len)
    index = device.index if device.index is not None else torch.cuda.current_device()
    budget = KVBudget(
        device=f"cuda:{index}",
        total=torch.cuda.mem_get_info(device)[1],
        fraction=fraction,
        resident=resident,
        workspace=workspace.total,
        token_bytes=KVCache.token_bytes(model.local_shape, config.torch_dtype),
        num_tensors=2 * model.local_shape.num_layers,
        block_size=config.block_size,
    )
    if pinned is None:
        tokens = size_kv_cache(budget, max_seq_len)
        log.info("KV cache sized from %s", budget.describe())
        return tokens, budget
    check_pinned(budget, pinned)
    log.info("KV cache pinned at %d tokens, within %s", pinned, budget.describe())
    return pinned, budget


def available_host_bytes() -> int:
    """Memory the host can give without swapping (MemAvailable: free plus reclaimable cache);
    free pages where /proc/meminfo is unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def measure_workspace(model: StepModel, config: EngineConfig, max_seq_len: int) -> Workspace:
    device = next(model.parameters()).device
    scratch = KVCache(
        model.local_shape, config.block_size, config.block_size, config.torch_dtype, device
    )
    batch = config.max_batch_size
    decodes = batch - 1
    chunk = min(config.max_step_tokens - decodes, max_seq_len)
    prefill_len = min(config.max_step_tokens, max_seq_len)
    paged = use_paged(config.decode_attention, device)
    with torch.inference_mode():
        mixed = _peak(device, _step, model, scratch, decodes, chunk, max_seq_len, paged)
        prefill = _peak(device, _step, model, scratch, 0, prefill_len, max_seq_len, paged)
        decode = _peak(device, _step, model, scratch, batch, 0, max_seq_len, paged)
    del scratch
    graphs = 0
    if config.cuda_graphs and device.type == "cuda":
        statics = graph_static_bytes(
            model.shape.vocab_size, batch, max_seq_len, paged, config.block_size
        )
        graphs = decode + statics + _side_stream_workspace(device, config.torch_dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Workspace(mixed, prefill, decode, graphs)


def graph_static_bytes(
    vocab_size: int, max_batch_size: int, max_seq_len: int, paged: bool, block_size: int
) -> int:
    """What every decode graph keeps for the engine's life: its float32 logits [b, V] and
    greedy tokens [b] int64 (in the graph pool) and its static inputs (cuda_graphs.py: [b]
    int64 logit rows and one buffer of [3, b] int64 rows, paged followed by [b] int32 lengths
    and a [b, L / block] int32 table; gathered: [b, L] int64 slots and a [b, 1, 1, L] bool
    mask besides)."""
    total = 0
    for b in batch_buckets(max_batch_size):
        for length in context_buckets(max_seq_len):
            sizes = [b * vocab_size * 4, b * 8, b * 8]
            if paged:
                small = b + b * -(-length // block_size)
                sizes += [(3 * b + -(-small // 2)) * 8]
            else:
                sizes += [3 * b * 8, b * length * 8, b * length]
            total += sum(-(-s // _SMALL_BLOCK) * _SMALL_BLOCK for s in sizes)
    return total


def _side_stream_workspace(device: torch.device, dtype: torch.dtype) -> int:
    """What the first matmul on a stream of its own leaves allocated: cuBLAS's workspace for
    that stream, which the decode graphs' side stream keeps (cuda_graphs.py)."""
    a = torch.ones(64, 64, dtype=dtype, device=device)
    with torch.cuda.stream(torch.cuda.Stream(device=device)):
        return _peak(device, torch.matmul, a, a)


def _peak(device: torch.device, run: Callable[..., object], *args: Any) -> int:
    """Bytes allocated at the peak of run(*args) above what was allocated before (0 on CPU)."""
    if device.type != "cuda":
        run(*args)
        return 0
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run(*args)
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - base)


def _step(
    model: StepModel,
    scratch: KVCache,
    decodes: int,
    chunk: int,
    context: int,
    paged: bool,
) -> None:
    """One forward of `decodes` decode tokens at `context` and one prefill chunk of `chunk`
    tokens ending at `context`, then sampling of every row that would sample."""
    dev = scratch.k[0].device
    num_slots = scratch.k[0].shape[0]
    tokens = decodes + chunk
    start = context - chunk
    decode = None
    if decodes and paged:  # the kernel reads block 0 over and over: no gather to allocate
        width = -(-context // scratch.block_size)
        table = torch.zeros(decodes, width, dtype=torch.int32, device=dev)
        lens = torch.full((decodes,), context, dtype=torch.int32, device=dev)
        decode = DecodeGroup(decodes, block_tables=table, context_lens=lens,
                             block_size=scratch.block_size)  # fmt: skip
    elif decodes:
        slots = torch.zeros(decodes, context, dtype=torch.int64, device=dev)
        kv_mask = torch.ones(decodes, 1, 1, context, dtype=torch.bool, device=dev)
        decode = DecodeGroup(decodes, slots, kv_mask)
    prefills = []
    if chunk:
        # the chunk's context, the prefix gathered (its attention: causal, bottom-right)
        kv_slots = torch.zeros(context, dtype=torch.int64, device=dev)
        prefills.append(PrefillChunk(decodes, chunk, kv_slots))
    positions = [context - 1] * decodes + list(range(start, context))
    rows = list(range(decodes)) + ([tokens - 1] if chunk else [])
    fwd = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=dev),
        positions=torch.tensor(positions, dtype=torch.int64, device=dev),
        slot_mapping=torch.arange(tokens, device=dev) % num_slots,
        logits_indices=torch.tensor(rows, dtype=torch.int64, device=dev),
        decode=decode,
        prefills=prefills,
        # the head's inputs of such a step (a model whose decodes differ from its prompt rows
        # takes both paths, mixed)
        family_inputs=model.head.profile_inputs(decodes, tokens, dev),
    )
    logits = model.forward(fwd, scratch.k, scratch.v)
    model.head.profile_sample(logits)
