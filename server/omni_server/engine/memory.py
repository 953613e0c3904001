"""How big the KV cache may be on a GPU: the budget arithmetic, pure (no torch, no device).

A GPU stage declares `gpu_memory_fraction`; its process's allocator is capped at fraction x
total (stage/budgets.py). The engine then gives its KV cache what the budget leaves:

    KV bytes = total x fraction - resident - workspace - margin - rounding

- resident:  what the process's allocator already holds before the KV cache (the weights, the
             RoPE table, tensors of other stages of the process), measured;
- workspace: the peak of the engine's largest steps (prefill at max_step_tokens, the largest
             decode batch at max_seq_len, sampling) plus CUDA-graph memory, measured by a
             profile forward (workspace.py);
- margin:    MARGIN_FRACTION of the budget, at least MARGIN_MIN_BYTES: the allocator's
             fragmentation and what a profile cannot see (a graph pool's growth, cuBLAS
             handles made later);
- rounding:  the caching allocator rounds each large tensor up to 2 MiB; the cache is one K and
             one V tensor per layer.

The cache holds one scratch block besides the blocks it hands out (kv_cache.py), so the tokens
it can serve are (KV bytes / bytes a token) rounded down to whole blocks, minus one block.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30
MARGIN_FRACTION = 0.02
MARGIN_MIN_BYTES = 64 * MiB
ALLOCATOR_ROUNDING = 2 * MiB  # large blocks of torch's caching allocator are 2 MiB multiples


class MemoryBudgetError(ValueError):
    """The stage's memory fraction cannot hold what its engine needs; the message says why."""


def fmt_bytes(n: float) -> str:
    """'1.5 GiB' from 1 GiB up, else '-200 MiB' (the sign kept: a budget can be overdrawn)."""
    if abs(n) >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / MiB:.0f} MiB"


def margin_bytes(budget: int) -> int:
    return max(MARGIN_MIN_BYTES, int(budget * MARGIN_FRACTION))


@dataclass(frozen=True)
class KVBudget:
    """Every term of one KV sizing, in bytes (tokens where named)."""

    device: str  # "cuda:0"
    total: int  # the device's memory
    fraction: float  # the stage's gpu_memory_fraction
    resident: int  # weights and anything else the allocator held before the KV cache
    workspace: int  # profiled peak of the largest steps (+ CUDA-graph memory)
    token_bytes: int  # KV bytes one token takes (K and V, every layer)
    num_tensors: int  # K and V tensors of the cache (2 x layers)
    block_size: int

    @property
    def budget(self) -> int:
        return int(self.total * self.fraction)

    @property
    def margin(self) -> int:
        return margin_bytes(self.budget)

    @property
    def rounding(self) -> int:
        return self.num_tensors * ALLOCATOR_ROUNDING

    @property
    def kv_bytes(self) -> int:
        """What the budget leaves for the KV cache (negative when it is overdrawn already)."""
        return self.budget - self.resident - self.workspace - self.margin - self.rounding

    @property
    def max_tokens(self) -> int:
        """The most tokens a cache in kv_bytes can serve: whole blocks, less the scratch block."""
        if self.kv_bytes <= 0:
            return 0
        blocks = self.kv_bytes // (self.token_bytes * self.block_size) - 1
        return max(0, blocks * self.block_size)

    def bytes_for(self, tokens: int) -> int:
        """KV bytes of a cache serving `tokens` (its blocks plus the scratch block)."""
        blocks = -(-tokens // self.block_size) + 1
        return blocks * self.block_size * self.token_bytes

    def describe(self) -> str:
        """One line with every term (the INFO log of a sizing)."""
        return (
            f"gpu_memory_fraction {self.fraction:g} of {self.device} ({fmt_bytes(self.total)}) "
            f"= {fmt_bytes(self.budget)}: weights {fmt_bytes(self.resident)}, workspace "
            f"{fmt_bytes(self.workspace)}, margin {fmt_bytes(self.margin)}, allocator rounding "
            f"{fmt_bytes(self.rounding)}; KV cache {fmt_bytes(self.kv_bytes)} = "
            f"{self.max_tokens} tokens ({self.token_bytes / 1024:g} KiB a token)"
        )

    def _overdrawn(self, leaves: str) -> str:
        return (
            f"gpu_memory_fraction {self.fraction:g} of {self.device} ({fmt_bytes(self.total)}) "
            f"{leaves} after {fmt_bytes(self.resident)} of weights, {fmt_bytes(self.workspace)} "
            f"of workspace and {fmt_bytes(self.margin + self.rounding)} of margin"
        )


def size_kv_cache(budget: KVBudget, max_seq_len: int) -> int:
    """KV tokens for a cache sized from the fraction; one request of max_seq_len must fit.

    Raises MemoryBudgetError (a fraction the allocator cannot honour) naming every term."""
    tokens = budget.max_tokens
    if tokens < max_seq_len:
        need = budget.bytes_for(max_seq_len)
        raise MemoryBudgetError(
            budget._overdrawn(f"leaves {fmt_bytes(budget.kv_bytes)} for the KV cache")
            + f"; one request of max_seq_len {max_seq_len} needs {fmt_bytes(need)} "
            "(raise the fraction, or lower engine.max_seq_len / max_batch_size / "
            "max_step_tokens)"
        )
    return tokens


def check_pinned(budget: KVBudget, max_total_tokens: int) -> None:
    """A pinned engine.max_total_tokens must fit the same budget; MemoryBudgetError if not."""
    need = budget.bytes_for(max_total_tokens)
    if need > budget.kv_bytes:
        raise MemoryBudgetError(
            f"engine.max_total_tokens {max_total_tokens} needs {fmt_bytes(need)} of KV cache, but "
            + budget._overdrawn(f"leaves {fmt_bytes(budget.kv_bytes)}")
            + f" (at most {budget.max_tokens} tokens fit)"
        )


def check_host_kv(max_total_tokens: int, token_bytes: int, available: int) -> None:
    """On the CPU the KV cache is host memory, allocated and zeroed at once: a cache of
    `max_total_tokens` that the memory the machine has available cannot hold is refused
    (MemoryBudgetError) rather than the host running out of memory with every process on it."""
    need = max_total_tokens * token_bytes
    if need > available:
        raise MemoryBudgetError(
            f"engine.max_total_tokens {max_total_tokens} needs {fmt_bytes(need)} of KV cache in "
            f"host memory, but this machine has {fmt_bytes(available)} available (at most "
            f"{available // max(token_bytes, 1)} tokens fit)"
        )
