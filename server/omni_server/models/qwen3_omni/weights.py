"""A checkpoint folder's safetensors (one file, or shards listed by
model.safetensors.index.json), read by published tensor name."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class CheckpointWeights:
    """Tensor name -> file, from the headers; tensors are read when asked for."""

    def __init__(self, folder: Path | str) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.folder / file for name, file in weight_map.items()}
        elif (self.folder / "model.safetensors").is_file():
            single = self.folder / "model.safetensors"
            with safe_open(str(single), framework="pt", device="cpu") as f:
                self.files = dict.fromkeys(f.keys(), single)
        else:
            raise FileNotFoundError(f"{self.folder}: no model.safetensors(.index.json)")

    def prefixed(self, prefix: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Every tensor under `prefix` (dotted), named without it."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name, file in self.files.items():
            if name.startswith(prefix):
                by_file.setdefault(file, []).append(name)
        if not by_file:
            raise KeyError(f"{self.folder}: no tensor named {prefix}*")
        out = {}
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in names:
                    tensor = f.get_tensor(name)
                    out[name[len(prefix) :]] = tensor if dtype is None else tensor.to(dtype)
        return out


def load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` into `module`'s parameters by name; every parameter must be given and
    every tensor used (a layout mismatch is an error naming the first names, never a silent
    random weight)."""
    own = dict(module.named_parameters())
    missing = sorted(own.keys() - tensors.keys())
    unused = sorted(tensors.keys() - own.keys())
    if missing or unused:
        raise KeyError(f"weights do not fit: missing {missing[:5]}, unused {unused[:5]}")
    with torch.no_grad():
        for name, param in own.items():
            if param.shape != tensors[name].shape:
                raise ValueError(
                    f"{name}: shape {tuple(tensors[name].shape)}, expected {tuple(param.shape)}"
                )
            param.copy_(tensors[name])
