"""The family seam: what a model family is (`Family`), what a checkpoint's config says the model
is (`Architecture`), where a model's weights come from (`ModelSource`: a checkpoint folder, a GGUF
file, random weights, all loaded by one path, engine/loading.py), the module a family builds
(`FamilyModel`), and weights read only when the model asks for them (`LazyWeights`). The
registry of families is the package (`families/__init__.py`)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from omni_server.engine.config import LlamaShape
from omni_server.engine.head import StepModel
from omni_server.engine.parallel import TensorParallel
from omni_server.engine.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from gguf import GGUFReader


@dataclass(frozen=True)
class Architecture:
    """What a checkpoint says its model is: the decoder's shape (a family adds its own fields,
    as higgs_audio_v2 its audio head)."""

    shape: LlamaShape


# A checkpoint tensor by name, read when called.
TensorSource = Callable[[str], torch.Tensor]


class FamilyModel(StepModel, Protocol):
    """The module a family builds: the engine's StepModel, placed on a device and given its
    weights by the one load path (engine/loading.py)."""

    def place(
        self, device: torch.device | str, dtype: torch.dtype, cpu_weight_order: str = "rows"
    ) -> FamilyModel:
        """Move to `device` in `dtype` (meta-built weights get storage, to be filled)."""
        ...

    def adopt(self, weights: Mapping[str, torch.Tensor], device: torch.device | str) -> Any:
        """Make `weights` the parameters themselves (a sharing follower)."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy engine-named weights in (families/llama/model.py names them)."""
        ...

    def init_random(self, seed: int = 0) -> None: ...

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]: ...


class LazyWeights(Mapping[str, torch.Tensor]):
    """Engine-named weights, each read (and converted) from the checkpoint only when the model's
    load_weights asks for it and dropped after its copy: a 5B model's float32 copy never sits
    whole in host memory."""

    def __init__(self) -> None:
        self._read: dict[str, Callable[[], torch.Tensor]] = {}

    def add(self, name: str, read: Callable[[], torch.Tensor]) -> None:
        self._read[name] = read

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._read[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._read)

    def __len__(self) -> int:
        return len(self._read)


class Family(abc.ABC):
    name: str
    model_types: tuple[str, ...]  # config.json's model_type values it reads
    # checkpoint tensors the engine does not use (a training-only head): neither missing nor extra
    ignored_weights: tuple[str, ...] = ()
    gguf_architecture: str | None = None  # a GGUF's general.architecture it reads (open_gguf)

    @abc.abstractmethod
    def read(self, config: Mapping[str, Any], folder: Path) -> Architecture: ...

    @abc.abstractmethod
    def expected_weights(self, spec: Architecture) -> dict[str, tuple[int, ...]]: ...

    @abc.abstractmethod
    def build(self, spec: Architecture, max_positions: int, tp: TensorParallel) -> FamilyModel: ...

    @abc.abstractmethod
    def load(self, model: FamilyModel, tensors: TensorSource, spec: Architecture) -> None: ...

    def open_gguf(self, path: Path, reader: GGUFReader, metadata: dict[str, Any]) -> ModelSource:
        """A GGUF file of this family (gguf_architecture), its header read, nothing dequantized."""
        raise NotImplementedError(f"the {self.name} family reads no GGUF")


class ModelSource(abc.ABC):
    """Where a model comes from, opened and checked before anything is placed: the family that
    builds its module, its architecture, how the placed module gets its weights, its tokenizer.
    A checkpoint folder (engine/checkpoint.py), a GGUF file (families/llama/gguf.py) and random
    weights (engine/loading.py) are three sources of one load path."""

    family: Family
    spec: Architecture

    @abc.abstractmethod
    def fill(self, model: FamilyModel) -> None:
        """Give the placed module its weights."""

    def ready_weights(
        self, model: FamilyModel, device: torch.device
    ) -> Mapping[str, torch.Tensor] | None:
        """Weights `model` (built, not yet placed) takes as they are on `device`, no copy (a
        prepared file's read-only mapping, engine/prepared_gguf.py); None, the default: the
        module is placed and `fill` gives it its weights."""
        return None

    @abc.abstractmethod
    def tokenizer(self) -> TextTokenizer | None:
        """The model's tokenizer (None: token ids only)."""
