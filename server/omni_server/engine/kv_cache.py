"""The KV cache: allocated once from a token budget, handed out in fixed-size blocks.

Layout per layer: `[num_slots, Hkv, D]` with slot = block * block_size + offset. A request owns a
block table (list of block ids); its token at position p lives in slot
`table[p // block_size] * block_size + p % block_size`. Block 0 is never handed out: it is the
scratch block that padded tokens (CUDA-graph buckets) write into and padded reads point at.

Why paged blocks and not fixed per-request slots: a fixed slot must hold the longest allowed
request (max_seq_len), so a budget of N tokens admits only N / max_seq_len requests however short
they are; blocks admit requests by what they really use. Reading is the same gather either way
(attention gathers a request's slots), so blocks cost no speed; docs/engine.md has the numbers.

Paired verbs: `can_allocate(n)` before `allocate(table, n)`; `free(table)` when the request
finishes or is aborted (at once: the blocks are reusable by the very next step).
"""

from __future__ import annotations

import math
import mmap

import torch

from omni_server.engine.config import LlamaShape


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Free-list of KV blocks. Block ids are 1..num_blocks (0 is the scratch block)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks, 0, -1))  # pop() hands out 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    def new_blocks(self, table: list[int], num_tokens: int) -> int:
        """Blocks `table` must gain to hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` in place to hold `num_tokens` tokens. Caller checked can_allocate."""
        need = self.new_blocks(table, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"KV cache: {need} blocks wanted, {len(self._free)} free")
        for _ in range(need):
            table.append(self._free.pop())

    def free(self, table: list[int]) -> None:
        """Return every block of `table` and empty it (so a double free is harmless)."""
        self._free.extend(reversed(table))
        table.clear()


class KVCache:
    """Per-layer K and V tensors plus the block allocator that hands their slots out."""

    def __init__(
        self,
        shape: LlamaShape,
        max_total_tokens: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        num_blocks = blocks_for(max_total_tokens, block_size)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.capacity_tokens = num_blocks * block_size
        num_slots = (num_blocks + 1) * block_size  # + the scratch block 0
        kv_shape = (num_slots, shape.num_kv_heads, shape.head_dim)
        self.k = [_zeros(kv_shape, dtype, device) for _ in range(shape.num_layers)]
        self.v = [_zeros(kv_shape, dtype, device) for _ in range(shape.num_layers)]

    @staticmethod
    def token_bytes(shape: LlamaShape, dtype: torch.dtype) -> int:
        """KV bytes one token takes: K and V of every layer (memory.py sizes the cache by it)."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * element

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def slot_matrix(self, tables: list[list[int]], length: int) -> torch.Tensor:
        """[B, length] int64 (CPU): slots of positions 0..length-1 of each request's table.

        Positions a table does not cover point into the scratch block 0 (callers mask them out).
        """
        bs = self.block_size
        nblocks = blocks_for(length, bs)
        if not tables or nblocks == 0:
            return torch.zeros(len(tables), length, dtype=torch.int64)
        padded = torch.zeros(len(tables), nblocks, dtype=torch.int64)
        for row, table in enumerate(tables):
            used = min(len(table), nblocks)
            padded[row, :used] = torch.tensor(table[:used], dtype=torch.int64)
        slots = padded.unsqueeze(-1) * bs + torch.arange(bs)  # [B, nblocks, bs]
        return slots.view(len(tables), -1)[:, :length]

    def block_matrix(self, tables: list[list[int]], width: int) -> torch.Tensor:
        """[B, width] int32 (CPU): each table's first `width` blocks, 0 past its end (the paged
        decode kernel reads a request's entries only up to its context)."""
        rows = [table[:width] + [0] * (width - len(table)) for table in tables]
        return torch.tensor(rows, dtype=torch.int32).view(len(tables), width)  # one copy

    def slot_span(self, table: list[int], length: int) -> tuple[int, int] | None:
        """(first slot, length) when positions 0..length-1 of `table` sit in consecutive
        slots (its blocks are consecutive), else None."""
        first = table[0]
        for i in range(1, blocks_for(length, self.block_size)):
            if table[i] != first + i:
                return None
        return first * self.block_size, length

    def slot_of(self, table: list[int], position: int) -> int:
        """The cache slot of `position` in a request whose block table is `table`."""
        return table[position // self.block_size] * self.block_size + position % self.block_size


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU, a view of an anonymous mapping: its pages are the kernel's
    shared zero page until a slot is written, so the cache costs nothing to allocate and only
    the slots requests use are ever faulted in. torch.zeros writes every byte at once: 368 MiB
    for the embedded thinker, 0.1 s on a quiet machine but 4-5 s of a restart on a loaded one
    (docs/runtime.md, "Recovery")."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)  # the tensor holds the mapping
