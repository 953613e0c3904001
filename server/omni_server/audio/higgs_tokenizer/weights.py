"""The tokenizer folder's model.safetensors into our modules: names as transformers saves them,
weight norm folded where a tensor still carries it, the tensors the served code never reads
(the semantic decoder and its projection, training statistics of the codebooks) dropped, and
every other name required: a missing, unexpected or misshapen tensor is an error naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from omni_server.audio.higgs_tokenizer.config import TokenizerFolderError, read_config
from omni_server.audio.higgs_tokenizer.model import HiggsAudioTokenizer

# checkpoint tensors of training or of the semantic reconstruction branch (not run to serve)
UNUSED_PREFIXES = ("decoder_semantic.", "fc1.", "semantic_model.masked_spec_embed")
UNUSED_SUFFIXES = (".codebook.cluster_size", ".codebook.embed_avg", ".codebook.inited")
# weight norm as saved: (direction-scale name, direction name) -> the weight
WEIGHT_NORM = (
    (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
    (".weight_g", ".weight_v"),
)


def load(folder: Path, device: torch.device | str = "cpu") -> HiggsAudioTokenizer:
    """The tokenizer in `folder` (config.json + model.safetensors), float32, eval, on `device`."""
    config = read_config(folder)
    path = folder / "model.safetensors"
    if not path.is_file():
        raise TokenizerFolderError(f"audio tokenizer {folder}: no model.safetensors")
    tensors = fold_weight_norm(load_file(str(path)))
    tensors = {
        name: value
        for name, value in tensors.items()
        if not name.startswith(UNUSED_PREFIXES) and not name.endswith(UNUSED_SUFFIXES)
    }
    model = HiggsAudioTokenizer(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshapen = [
        f"{name} {tuple(tensors[name].shape)} (config.json implies {tuple(value.shape)})"
        for name, value in expected.items()
        if name in tensors and tensors[name].shape != value.shape
    ]
    for what, names in (("lacks", missing), ("has unexpected", unexpected), ("has", misshapen)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise TokenizerFolderError(f"{path}: {what} {', '.join(names[:3])}{more}")
    model.load_state_dict({name: value.float() for name, value in tensors.items()})
    model.fold_decode_table()
    return model.eval().requires_grad_(False).to(device)


def fold_weight_norm(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each (g, v) pair becomes `weight = g * v / |v|`, the norm over every dim where g has
    size 1 (dim 0 kept for the codec's convs, dim 2 for HuBERT's positional conv)."""
    out = dict(tensors)
    for scale_suffix, direction_suffix in WEIGHT_NORM:
        for name in [n for n in tensors if n.endswith(scale_suffix)]:
            stem = name[: -len(scale_suffix)]
            g = out.pop(name).double()
            v = out.pop(stem + direction_suffix).double()
            dims = [d for d in range(v.dim()) if g.shape[d] == 1]
            out[stem + ".weight"] = (g * v / v.norm(dim=dims, keepdim=True)).to(tensors[name].dtype)
    return out
