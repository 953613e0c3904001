"""Tensor parallelism for the engine's Llama: which slice of each weight a rank keeps, and the
one all-reduce that closes each half of a decoder block (Megatron-style).

Over T ranks, rank r keeps:

  wqkv     [(H + 2 Hkv) D, C]  column-parallel: its H/T query heads and Hkv/T KV heads, so
                               attention runs on local heads only (query head h reads KV head
                               h // (H / Hkv), which stays on the same rank)
  wo       [C, H D]            row-parallel: the input columns of its query heads; the partial
                               outputs of all ranks are summed (all-reduce #1)
  w_gate_up[2 I, C]            column-parallel: its I/T rows of gate and of up
  w_down   [C, I]              row-parallel: its I/T input columns; summed (all-reduce #2)
  embed, norms, LM head        replicated: every rank has the same hidden states and logits,
                               so every rank samples the same token from the same seed

The KV cache of a rank holds its Hkv/T heads only. Weights load whole; each rank slices its part
(`shard`), so a TP=T model computes what the TP=1 model does, up to the summation order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from omni_server.engine.config import LlamaShape


class ShardingError(ValueError):
    """The model cannot be split over the ranks (a tp_size that does not divide its heads)."""


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group. size 1 (the default): no parallelism."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed StageProcesses (NCCL on GPUs, gloo on CPU)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallelism: rank {self.rank} of {self.size} ranks")
        if self.size > 1 and self.group is None:
            raise ValueError(f"tensor parallelism over {self.size} ranks needs a process group")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (a no-op alone). May be captured in a CUDA graph."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def smallest(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the ranks (a collective: every rank calls it)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        box = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.group)
        return int(box.item())

    def first(self, value: float, device: torch.device) -> float:
        """Rank 0's `value` on every rank (a collective: every rank calls it). The engine's
        clock goes through it, so time-dependent scheduling decides alike on every rank."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        box = torch.tensor([value], dtype=torch.float64, device=device)
        dist.broadcast(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return float(box.item())

    def check(self, shape: LlamaShape) -> None:
        """Refuse a shape whose heads or MLP cannot be split evenly over the ranks."""
        fields = {
            "num_heads": shape.num_heads,
            "num_kv_heads": shape.num_kv_heads,
            "intermediate_size": shape.intermediate_size,
        }
        bad = [f"{name} = {value}" for name, value in fields.items() if value % self.size]
        if bad:
            raise ShardingError(
                f"tp_size = {self.size} must divide the model's {', '.join(bad)} (its shape: "
                f"{shape.num_heads} heads, {shape.num_kv_heads} KV heads, intermediate "
                f"{shape.intermediate_size}); choose a tp_size dividing all three"
            )

    def local_shape(self, shape: LlamaShape) -> LlamaShape:
        """The shape of this rank's share: heads and MLP width divided by the group size."""
        self.check(shape)
        return dataclasses.replace(
            shape,
            num_heads=shape.num_heads // self.size,
            num_kv_heads=shape.num_kv_heads // self.size,
            intermediate_size=shape.intermediate_size // self.size,
        )

    def rows(self, full: torch.Tensor, segments: tuple[int, ...]) -> torch.Tensor:
        """Column-parallel slice of a fused [sum(segments), C] weight: this rank's 1/T of the
        rows of each segment (e.g. Q, K, V), concatenated in segment order."""
        if self.size == 1:
            return full
        assert sum(segments) == full.shape[0], (segments, tuple(full.shape))
        parts = [seg.chunk(self.size, dim=0)[self.rank] for seg in full.split(segments, dim=0)]
        return torch.cat(parts, dim=0)

    def columns(self, full: torch.Tensor) -> torch.Tensor:
        """Row-parallel slice of a [C, K] weight: this rank's 1/T of the K input columns."""
        if self.size == 1:
            return full
        return full.chunk(self.size, dim=1)[self.rank].contiguous()


SINGLE = TensorParallel()
