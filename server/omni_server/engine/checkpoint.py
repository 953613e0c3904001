"""A Hugging Face checkpoint folder (a ModelSource, families/base.py), read as published:
config.json picks the family (`model_type`), the safetensors files (one, or shards listed by
model.safetensors.index.json) hold the weights, tokenizer.json + tokenizer_config.json the
tokenizer and chat template.

Everything is checked before a weight is placed: the config's fields (the family's `read`), then
every tensor's name and shape from the safetensors headers against what the config implies. Any
disagreement is one CheckpointError naming the folder and the first problems found.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omni_server.engine.errors import CheckpointError
from omni_server.engine.families import Architecture, Family, FamilyModel, ModelSource, family_for
from omni_server.engine.hf_tokenizer import HFTokenizer


@dataclass
class Checkpoint(ModelSource):
    folder: Path
    config: dict[str, Any]  # config.json
    family: Family
    spec: Architecture
    files: dict[str, Path]  # tensor name -> the safetensors file holding it

    def fill(self, model: FamilyModel) -> None:
        """The family's load: tensors read one at a time, renamed, placed; each file opened once
        for the whole load (opening one parses its header: ~3 ms for a thousand tensors, paid
        per tensor before, 1-2 minutes of a 30B MoE checkpoint's ~19k expert matrices)."""
        from safetensors import safe_open

        with contextlib.ExitStack() as stack:
            opened: dict[Path, Any] = {}

            def tensor(name: str) -> torch.Tensor:
                path = self.files[name]
                f = opened.get(path)
                if f is None:
                    f = opened[path] = stack.enter_context(
                        safe_open(str(path), framework="pt", device="cpu")
                    )
                return f.get_tensor(name)

            self.family.load(model, tensor, self.spec)

    def tokenizer(self) -> HFTokenizer | None:
        """The folder's tokenizer (None without tokenizer.json: token ids only). A completion
        ends at generation_config.json's eos_token_id, else config.json's."""
        if not (self.folder / "tokenizer.json").is_file():
            return None
        generation = _json(self.folder / "generation_config.json", self.folder)
        eos = generation.get("eos_token_id", self.config.get("eos_token_id"))
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        return HFTokenizer(self.folder, [int(i) for i in ids])


def open_checkpoint(folder: Path | str) -> Checkpoint:
    """Read config.json and the safetensors headers and check them against each other."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(folder, "not a folder")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(folder, "no config.json (a Hugging Face checkpoint folder has one)")
    config = _json(config_path, folder)
    family = family_for(config, folder)
    spec = family.read(config, folder)
    shapes, files = _tensor_headers(folder)
    _check_weights(folder, family, family.expected_weights(spec), shapes)
    return Checkpoint(folder, config, family, spec, files)


def _json(path: Path, folder: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(folder, f"{path.name} is not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise CheckpointError(folder, f"{path.name} is not a JSON object")
    return data


def _tensor_headers(folder: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, Path]]:
    """Every tensor's shape and file, from the headers only (nothing is read)."""
    from safetensors import SafetensorError, safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json(index, folder).get("weight_map")
        if not isinstance(weight_map, Mapping):
            raise CheckpointError(folder, f"{index.name} has no weight_map")
        paths = sorted({folder / str(f) for f in weight_map.values()})
    else:
        paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(folder, "no *.safetensors weights")
    shapes: dict[str, tuple[int, ...]] = {}
    files: dict[str, Path] = {}
    for path in paths:
        if not path.is_file():
            raise CheckpointError(folder, f"{path.name} (listed in the index) is missing")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open has keys(), no __iter__)
                    shapes[name] = tuple(f.get_slice(name).get_shape())
                    files[name] = path
        except (SafetensorError, OSError) as err:
            raise CheckpointError(folder, f"{path.name} is not a safetensors file ({err})") from err
    return shapes, files


def _check_weights(
    folder: Path,
    family: Family,
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
) -> None:
    def ignored(name: str) -> bool:
        return any(name == i or name.endswith("." + i) for i in family.ignored_weights)

    missing = sorted(set(expected) - set(found))
    extra = sorted(n for n in set(found) - set(expected) if not ignored(n))
    wrong = [
        f"{n} is {list(found[n])}, config.json implies {list(expected[n])}"
        for n in sorted(set(expected) & set(found))
        if found[n] != expected[n]
    ]
    problems = []
    if wrong:
        problems.append(
            "; ".join(wrong[:3]) + (f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else "")
        )
    if missing:
        problems.append(f"{len(missing)} weight(s) missing for {family.name}: {_few(missing)}")
    if extra:
        problems.append(f"{len(extra)} unexpected weight(s) for {family.name}: {_few(extra)}")
    if problems:
        raise CheckpointError(folder, "; ".join(problems))


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:4])
    return shown + (f", ... (+{len(names) - 4})" if len(names) > 4 else "")
