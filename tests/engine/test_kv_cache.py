"""The block allocator's paired verbs and the slot arithmetic of the paged cache."""

from __future__ import annotations

import torch

from omni_server.engine.config import LlamaShape
from omni_server.engine.kv_cache import BlockAllocator, KVCache, blocks_for


def test_allocate_free_paired_and_block_zero_reserved() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=16)
    a: list[int] = []
    assert alloc.new_blocks(a, 33) == 3 and alloc.can_allocate(3)
    alloc.allocate(a, 33)
    assert len(a) == 3 and 0 not in a and alloc.num_free == 1
    alloc.allocate(a, 48)  # still 3 blocks: no growth
    assert len(a) == 3
    b: list[int] = []
    assert not alloc.can_allocate(alloc.new_blocks(b, 17))
    alloc.free(a)
    assert a == [] and alloc.num_free == 4
    alloc.free(a)  # freeing an emptied table is harmless
    assert alloc.num_free == 4
    alloc.allocate(b, 64)
    assert sorted(b) == [1, 2, 3, 4]


def test_slot_matrix_maps_positions_through_the_table() -> None:
    shape = LlamaShape(64, 32, 64, 1, 2, 1, 16, 1e4, 1e-5, 128)
    cache = KVCache(shape, max_total_tokens=64, block_size=4, dtype=torch.float32, device="cpu")
    assert cache.capacity_tokens == 64 and cache.k[0].shape == (68, 1, 16)  # + scratch block
    slots = cache.slot_matrix([[3, 1], [2]], 6)
    assert slots.tolist() == [[12, 13, 14, 15, 4, 5], [8, 9, 10, 11, 0, 1]]  # past the table: 0
    assert blocks_for(0, 4) == 0 and blocks_for(5, 4) == 2


def test_slot_span_only_for_consecutive_blocks() -> None:
    shape = LlamaShape(64, 32, 64, 1, 2, 1, 16, 1e4, 1e-5, 128)
    cache = KVCache(shape, max_total_tokens=64, block_size=4, dtype=torch.float32, device="cpu")
    assert cache.slot_span([2, 3, 4], 10) == (8, 10)  # positions 0..9 in slots 8..17
    assert cache.slot_span([2, 3, 1], 8) == (8, 8)  # the blocks past the context do not count
    assert cache.slot_span([2, 3, 1], 9) is None
    assert cache.slot_span([3, 2], 5) is None
    assert cache.slot_span([5], 1) == (20, 1)
