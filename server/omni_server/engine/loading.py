"""One load path for every model: a source (a checkpoint folder, a GGUF file, random weights;
families/base.py `ModelSource`) names its family and architecture; the family builds the module
on the meta device; it is placed on the engine's device and the source fills it. A sharing
follower (a stage's `context.shared_weights`) builds the same module around its leader's
tensors instead, and reads nothing but the header.

    source = open_model(path)          # folder: config.json's model_type; *.gguf: its header
    model = load_model(source, config, tp, shared)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from omni_server.engine.config import EngineConfig, LlamaShape
from omni_server.engine.families import (
    FAMILIES,
    Architecture,
    FamilyModel,
    ModelSource,
    open_gguf,
)
from omni_server.engine.families.llama.gguf import smollm2_gguf_path
from omni_server.engine.parallel import SINGLE, TensorParallel
from omni_server.engine.tokenizer import TextTokenizer

# a stage's `context.shared_weights(key, load)`: load() on a leader, the leader's tensors else
SharedWeights = Callable[
    [str, Callable[[], Mapping[str, torch.Tensor]]], Mapping[str, torch.Tensor]
]


def open_model(
    path: Path | str | None,
    prepared: Path | None = None,
    config: EngineConfig | None = None,
    tp: TensorParallel = SINGLE,
) -> ModelSource:
    """A checkpoint folder (engine/checkpoint.py) or a GGUF file (families: by its
    general.architecture); None: the embedded SmolLM2-135M GGUF. Nothing is placed. With a
    `prepared` directory a GGUF's placed weights (for `config` and `tp`) are kept there as a
    file for the processes after this one, or taken from it (prepared_gguf.py); a checkpoint
    folder is safetensors already and is read as it is."""
    from omni_server.engine.checkpoint import open_checkpoint

    path = Path(path) if path is not None else smollm2_gguf_path()
    if path.is_file():  # a checkpoint is a folder; a GGUF, one file
        if prepared is not None and config is not None:
            from omni_server.engine.prepared_gguf import open_prepared_gguf

            return open_prepared_gguf(path, prepared, config, tp)
        return open_gguf(path)
    return open_checkpoint(path)


class RandomWeights(ModelSource):
    """A Llama of a given shape with random weights, no tokenizer (token ids only): speed
    benchmarks and scheduling tests. Drawn on the device, the same for every tp_size."""

    def __init__(self, shape: LlamaShape, seed: int = 0) -> None:
        self.family = FAMILIES["llama"]
        self.spec = Architecture(shape)
        self.seed = seed

    def fill(self, model: FamilyModel) -> None:
        model.init_random(self.seed)

    def tokenizer(self) -> TextTokenizer | None:
        return None


def load_model(
    source: ModelSource,
    config: EngineConfig,
    tp: TensorParallel = SINGLE,
    shared: SharedWeights | None = None,
) -> FamilyModel:
    """The source's module on config.device in config.dtype, with its weights. With `tp`,
    this rank keeps its slice (ValueError when tp.size does not divide the heads). With
    `shared`, the placed weights come through it (keyed by the family's name): a follower
    aliases its leader's tensors."""
    if shared is None:
        return _placed(source, config, tp)

    def load() -> dict[str, torch.Tensor]:
        return dict(_placed(source, config, tp).named_parameters())

    return _with_weights(source, config, tp, shared(source.family.name, load))


def _built(source: ModelSource, config: EngineConfig, tp: TensorParallel) -> FamilyModel:
    """The module on the meta device: nothing allocated (place() does, the source fills)."""
    shape = source.spec.shape
    limit = min(config.max_seq_len or shape.max_position_embeddings, shape.max_position_embeddings)
    with torch.device("meta"):
        return source.family.build(source.spec, limit, tp)


def _placed(source: ModelSource, config: EngineConfig, tp: TensorParallel) -> FamilyModel:
    model = _built(source, config, tp)
    ready = source.ready_weights(model, torch.device(config.device))
    if ready is not None:  # prepared weights mapped from a file: taken as they are
        return adopted(model, config, ready)
    model = model.place(config.device, config.torch_dtype, config.cpu_weight_order)
    source.fill(model)
    return model


def _with_weights(
    source: ModelSource,
    config: EngineConfig,
    tp: TensorParallel,
    weights: Mapping[str, torch.Tensor],
) -> FamilyModel:
    """The source's module around a sharing leader's `weights` (adopted)."""
    return adopted(_built(source, config, tp), config, weights)


def adopted(
    model: FamilyModel, config: EngineConfig, weights: Mapping[str, torch.Tensor]
) -> FamilyModel:
    """`model` (built on the meta device: nothing allocated) with `weights` themselves as its
    parameters (no copy: a sharing follower's tensors alias its leader's memory, a restarted
    process's its prepared file's mapping), after checking they are exactly the module's: the
    same names, shapes, dtype and device."""
    device = torch.device(config.device)
    expected = dict(model.named_parameters())
    if set(weights) != set(expected):
        missing, extra = set(expected) - set(weights), set(weights) - set(expected)
        raise ValueError(f"weights: missing {sorted(missing)}, unexpected {sorted(extra)}")
    for name, param in expected.items():
        value = weights[name]
        if value.shape != param.shape or value.dtype != config.torch_dtype:
            raise ValueError(
                f"weight {name}: {tuple(value.shape)} {value.dtype}, the model needs "
                f"{tuple(param.shape)} {config.torch_dtype}"
            )
        if value.device.type != device.type or (
            device.index is not None and value.device.index != device.index
        ):
            raise ValueError(f"weight {name} is on {value.device}, not {device}")
    model.adopt(weights, device)
    return model
