"""Engine and model-shape configuration.

`EngineConfig` is what a stage's `[engine]` table in stage.toml maps onto; it is declared once,
torch-free, in omni_server/engine_config.py (the compiler checks stage files with it) and
re-exported here. `LlamaShape` is the model's hyperparameters, read from a GGUF or a checkpoint's
config.json (engine/families) or written by hand for random-weight benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_server.engine_config import DEFAULT_MAX_TOTAL_TOKENS, EngineConfig, EngineConfigError

__all__ = [
    "DEFAULT_MAX_TOTAL_TOKENS",
    "LLAMA_1B",
    "LLAMA_3B",
    "SHAPES",
    "SMOLLM2_135M",
    "EngineConfig",
    "EngineConfigError",
    "Llama3RopeScaling",
    "LlamaShape",
]


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
