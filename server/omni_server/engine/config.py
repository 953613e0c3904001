"""Engine and model-shape configuration.

`EngineConfig` is what a stage's `[engine]` table in stage.toml maps onto (`from_table` checks
names and types and says which field is wrong). `LlamaShape` is the model's hyperparameters, read
from a GGUF or a checkpoint's config.json (engine/families) or written by hand for random-weight
benchmarks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3's RoPE frequency scaling (config.json `rope_type: "llama3"`): wavelengths past
    `original_max_position_embeddings / low_freq_factor` are stretched by `factor`, those under
    `... / high_freq_factor` kept, the band between interpolated (transformers' formula)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaShape:
    """Hyperparameters of a Llama-architecture decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    rope_scaling: Llama3RopeScaling | None = None  # None: plain RoPE at rope_theta

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + embed + self.hidden_size


# SmolLM2-135M (what the embedded GGUF holds), for random-weight runs without reading the file.
SMOLLM2_135M = LlamaShape(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
)

# A ~1.2B Llama shape (Llama-3.2-1B's), to show how speed scales with model size.
LLAMA_1B = LlamaShape(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
)

# The KV budget in tokens when nothing sizes it (the CPU, or a GPU stage without a fraction).
DEFAULT_MAX_TOTAL_TOKENS = 16384

# Llama-3.2-3B's decoder: the backbone of Higgs Audio v2 (its text shape, without the audio
# head and DualFFN), for the engine's speed at the size of the Higgs tts_engine.
LLAMA_3B = LlamaShape(
    vocab_size=128256,
    hidden_size=3072,
    intermediate_size=8192,
    num_layers=28,
    num_heads=24,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
)

SHAPES: dict[str, LlamaShape] = {
    "smollm2-135m": SMOLLM2_135M,
    "llama-1b": LLAMA_1B,
    "llama-3b": LLAMA_3B,
}
DECODE_ATTENTION = ("auto", "paged", "gather")
CPU_WEIGHT_ORDER = ("rows", "columns")
OVERLAP_DECODE = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs. Every field can come from a stage's `[engine]` table.

    max_total_tokens: KV cache capacity in tokens, over all requests; allocated once. None:
                      sized from gpu_memory_fraction on a GPU (memory.py), else
                      DEFAULT_MAX_TOTAL_TOKENS.
    max_batch_size:   most requests in one step (running requests, prefilling or decoding;
                      media requests ahead of their listeners may hold KV beyond it while
                      sitting a step out: deadline_order.py).
    max_step_tokens:  budget of one forward, in tokens weighted by their attention's cost
                      (step_cost.py): decode tokens first, prefill chunks fill the rest, so a
                      long prompt is prefilled in chunks whose cost, not length, is bounded.
    max_seq_len:      longest prompt + completion of one request; None = the model's context,
                      clamped to max_total_tokens so one request alone always fits.
    block_size:       tokens per KV block (paged cache).
    dtype, device:    "float32" | "bfloat16" | "float16"; "cpu" | "cuda" | "cuda:N".
    cuda_graphs:      capture decode steps in CUDA graphs per padded batch-size bucket (CUDA only).
    compile:          torch.compile the model's forward (optional; off by default).
    attention_keys_per_token: the context length at which one token's attention costs as much
                      as its matmuls (step_cost.py): a token at position p counts 1 + p / K
                      of the step budgets. None: from the model's shape and the device.
    max_prefill_beside_decodes: the budget of a step's prefill chunks while requests decode
                      (in the same units), so running streams keep their pace while a long
                      prompt prefills. None: 32 on the CPU (a chunk of 32 tokens costs about
                      two decode steps of SmolLM2 there), max_step_tokens on CUDA.
    decode_attention: "auto" | "paged" | "gather": decode attention over the block tables by
                      a Triton kernel (paged_decode.py; "auto" picks it on CUDA where Triton
                      imports) or by gathering each context and torch matmuls (the CPU's).
    playback_order:   order a step that cannot hold everyone by the listeners' deadlines of
                      media requests (GenerationRequest.playback_seconds; deadline_order.py).
                      False: the plain order for every request (a peer to measure against).
    cpu_weight_order: "rows" | "columns": "columns" stores the float32 CPU weights wider
                      than they are deep (QKV, gate/up, the vocabulary head) by columns. A
                      one-row step (one request decoding) reads that layout 1.3-2x faster on
                      the development machine; a step of 4-8 rows reads it 12-17% slower
                      (docs/engine.md has both; huge_pages.py). So it suits a stage that
                      mostly serves one stream at a time. Ignored on a GPU and in other dtypes.
    overlap_decode:   "auto" | "on" | "off": launch a greedy decode step before the previous
                      step's tokens are read (its input ids come from that step's argmax on
                      the device; overlap.py), so the host's work of a step runs while the GPU
                      computes. "auto": where decode graphs run, one rank (no TP), text models.
                      "on": also eager steps (tests on the CPU). "off": every step synchronous.
    gpu_memory_fraction: the stage's share of its GPU (not an [engine] key: the stage's own
                      field, which the backend passes on). On a GPU it sizes the KV cache, or
                      checks a given max_total_tokens against it; ignored on the CPU.
    """

    max_total_tokens: int | None = None
    max_batch_size: int = 64
    max_step_tokens: int = 512
    max_seq_len: int | None = None
    block_size: int = 16
    dtype: str = "float32"
    device: str = "cpu"
    cuda_graphs: bool = True
    compile: bool = False
    attention_keys_per_token: int | None = None
    max_prefill_beside_decodes: int | None = None
    decode_attention: str = "auto"
    playback_order: bool = True
    cpu_weight_order: str = "rows"
    overlap_decode: str = "auto"
    gpu_memory_fraction: float | None = None

    def __post_init__(self) -> None:
        positive = ("max_total_tokens", "max_batch_size", "max_step_tokens", "block_size")
        for name in positive:
            value = getattr(self, name)
            if value is None and name == "max_total_tokens":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"engine.{name} must be a positive integer, got {value!r}")
        for name in ("attention_keys_per_token", "max_prefill_beside_decodes"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise ValueError(f"engine.{name} must be a positive integer, got {value!r}")
        if self.max_seq_len is not None and (
            not isinstance(self.max_seq_len, int) or self.max_seq_len <= 1
        ):
            raise ValueError(f"engine.max_seq_len must be an integer > 1, got {self.max_seq_len!r}")
        if self.max_step_tokens <= self.max_batch_size:
            raise ValueError(
                f"engine.max_step_tokens ({self.max_step_tokens}) must exceed "
                f"engine.max_batch_size ({self.max_batch_size}): decodes take one token each "
                "and prefill needs the rest"
            )
        for name in ("cuda_graphs", "compile", "playback_order"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"engine.{name} must be true or false, got {getattr(self, name)!r}"
                )
        fraction = self.gpu_memory_fraction
        if fraction is not None and (
            not isinstance(fraction, int | float)
            or isinstance(fraction, bool)
            or not 0 < fraction <= 1
        ):
            raise ValueError(f"gpu_memory_fraction must be a number in (0, 1], got {fraction!r}")
        if self.cpu_weight_order not in CPU_WEIGHT_ORDER:
            raise ValueError(
                f"engine.cpu_weight_order must be one of {list(CPU_WEIGHT_ORDER)}, got "
                f"{self.cpu_weight_order!r}"
            )
        if self.overlap_decode not in OVERLAP_DECODE:
            raise ValueError(
                f"engine.overlap_decode must be one of {list(OVERLAP_DECODE)}, got "
                f"{self.overlap_decode!r}"
            )
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"engine.decode_attention must be one of {list(DECODE_ATTENTION)}, got "
                f"{self.decode_attention!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"engine.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not (
            self.device == "cpu" or self.device.startswith("cuda")
        ):
            raise ValueError(f"engine.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    @property
    def sized_from_fraction(self) -> bool:
        """The KV cache takes what the GPU budget leaves (no pinned max_total_tokens)."""
        return (
            self.max_total_tokens is None
            and self.gpu_memory_fraction is not None
            and self.device.startswith("cuda")
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_table(cls, table: Mapping[str, object]) -> EngineConfig:
        """Build from a stage.toml `[engine]` table; unknown keys and wrong types are errors."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - set(fields))
        if unknown:
            raise ValueError(f"unknown engine field(s) {unknown}; valid: {sorted(fields)}")
        return cls(**table)  # type: ignore[arg-type]  # __post_init__ checks every value
