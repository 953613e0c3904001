"""What one token costs a forward, in units of one token's matmuls: the batcher's step budget.

A token at position p runs the same matmuls as any other (one unit) and attends to p + 1 keys,
which costs p + 1 over K units, where K (`keys_per_token`) is the context length at which a
token's attention costs as much as its matmuls. So a prefill chunk of n tokens from position s
costs n + (n * s + n * (n + 1) / 2) / K: at a long context a chunk of the same length costs many
times more than at the start (measured on this 2-core machine, SmolLM2 fp32, one thread: 256
tokens at context 0 take 0.86 s, at context 7680 9.5 s), so counting tokens alone would let one
long prompt stretch every step, and every running decode with it (issue 27.2).

K from the model's shape: its matmul FLOPs per token (2 x the weights a token multiplies)
over the attention FLOPs per key (4 x layers x heads x head_dim: q.k and p.v), times how
efficient the device's attention is against its matmuls: the CPU's gathered SDPA ran at a fifth
of its matmuls' FLOP rate in the measurement above (K ~ 770 keys for SmolLM2, against a FLOP
ratio of ~3900). On an H200 (bf16, a 512-token chunk at context 0 / 3584 / 7168): the 1.2B
shape measured K = 1638 against a FLOP ratio of 18856 (the chunk's gathered, masked SDPA), so
CUDA takes a tenth; SmolLM2's chunks there are launch-bound (K measured 8733), for which a
tenth only errs towards smaller chunks. EngineConfig's `attention_keys_per_token` pins K.
"""

from __future__ import annotations

import math

from omni_server.engine.config import LlamaShape

# Attention's FLOP efficiency against the matmuls', per device type (see the docstring).
ATTENTION_EFFICIENCY = {"cpu": 0.2, "cuda": 0.1}


def keys_per_token(shape: LlamaShape, device_type: str) -> int:
    """K: keys whose attention costs one token's matmuls on this device, from the shape."""
    per_layer = shape.hidden_size * shape.head_dim * (2 * shape.num_heads + 2 * shape.num_kv_heads)
    per_layer += 3 * shape.hidden_size * shape.intermediate_size
    matmul = 2 * (shape.num_layers * per_layer + shape.vocab_size * shape.hidden_size)
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim
    return max(1, round(matmul / attention * ATTENTION_EFFICIENCY.get(device_type, 1.0)))


class StepCost:
    """Costs in token units (floats) for a model whose attention costs 1 / `keys` unit a key."""

    def __init__(self, keys: int) -> None:
        self.keys = keys

    def decode(self, position: int) -> float:
        """One decode token at `position` (it attends to position + 1 keys)."""
        return 1.0 + (position + 1) / self.keys

    def chunk(self, start: int, length: int) -> float:
        """Prefill tokens start .. start + length - 1."""
        keys = length * start + length * (length + 1) / 2
        return length + keys / self.keys

    def fit(self, start: int, remaining: int, budget: float) -> int:
        """The longest chunk from `start` (at most `remaining` tokens) costing <= budget."""
        if budget <= 0 or remaining <= 0:
            return 0
        # n^2 / 2K + n (1 + (start + 1/2) / K) - budget <= 0: the positive root, then exact.
        a = 1 / (2 * self.keys)
        b = 1 + (start + 0.5) / self.keys
        n = min(remaining, int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a)))
        while n > 0 and self.chunk(start, n) > budget:
            n -= 1
        while n < remaining and self.chunk(start, n + 1) <= budget:
            n += 1
        return n
