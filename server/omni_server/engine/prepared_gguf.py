"""A GGUF opened through its prepared file (prepared.py), for stage processes that come back.

The first process to load a GGUF with a `prepared` directory reads the GGUF, dequantizes it,
places the weights, and writes them (and the GGUF's header: shape, tokenizer) as the prepared
file. A process after it (a restart after a crash or a freeze, another replica started later)
finds the file, checks it, and takes its weights from the read-only mapping (on the CPU the
mapping is the module's parameters; a GPU copies them in): it reads neither the GGUF's header
nor its quantized blocks. A stale or refused file is
prepared again and replaced. Replicas that start together each prepare (the last rename wins;
the contents are the same).

    source = open_prepared_gguf(path, directory, config, tp)   # a ModelSource (loading.py)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from omni_server.engine import prepared
from omni_server.engine.config import EngineConfig
from omni_server.engine.families import FAMILIES, FamilyModel, ModelSource, open_gguf
from omni_server.engine.families.llama.gguf import GGUFFile
from omni_server.engine.parallel import TensorParallel
from omni_server.engine.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


def open_prepared_gguf(
    path: Path, directory: Path, config: EngineConfig, tp: TensorParallel
) -> ModelSource:
    """The GGUF `path` as a source whose weights come from (or go to) its prepared file in
    `directory` for this dtype, device type, weight order and TP rank."""
    started = time.perf_counter()
    settings = {
        "dtype": config.dtype,
        "device": torch.device(config.device).type,
        "order": config.cpu_weight_order,
        "tp": f"{tp.rank}of{tp.size}",
    }
    file = directory / prepared.file_name(path, **settings)
    expected = prepared.stamp(path, **settings)
    try:
        kept = prepared.read(file, expected)
        if kept is not None:
            return MappedWeights(_reopened(path, kept.header.get("source")), kept, started)
    except prepared.PreparedError as err:
        log.warning("prepared weights %s refused (%s): preparing them again", file, err)
    source = open_gguf(path)
    if not isinstance(source, GGUFFile):  # a family whose GGUF cannot be opened from a header
        return source
    return PreparingWeights(source, file, {"stamp": expected, "source": source.header()})


def _reopened(path: Path, header: Any) -> GGUFFile:
    """The GGUF source from the header its prepared file kept."""
    if not isinstance(header, dict):
        raise prepared.PreparedError("no source header")
    metadata, tied = header.get("metadata"), header.get("tied")
    if not isinstance(metadata, dict) or not isinstance(tied, bool):
        raise prepared.PreparedError("its source header is not a GGUF header this engine reads")
    family = FAMILIES.get(str(metadata.get("general.architecture")))
    if family is None or family.gguf_architecture is None:
        raise prepared.PreparedError("its source header is not a GGUF header this engine reads")
    try:
        return GGUFFile(family, path, metadata, tied)
    except ValueError as err:  # its header no longer reads as a shape (GGUFFormatError)
        raise prepared.PreparedError(str(err)) from None


class MappedWeights(ModelSource):
    """`source` (opened from the prepared file's header) with the file's weights: on the CPU
    the module's parameters are the read-only mapping itself (nothing copied, the page cache
    shared with every process that maps it); on a GPU they are copied in."""

    def __init__(self, source: GGUFFile, kept: prepared.PreparedFile, started: float) -> None:
        self.family = source.family
        self.spec = source.spec
        self._source = source
        self._kept = kept
        self._started = started

    def ready_weights(
        self, model: FamilyModel, device: torch.device
    ) -> Mapping[str, torch.Tensor] | None:
        if device.type != "cpu":
            return None  # fill() copies them to the device
        weights = self._fitting(model)
        self._log("mapped read-only", len(weights))
        return weights

    def fill(self, model: FamilyModel) -> None:
        weights = self._fitting(model)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(weights[name])
        self._kept.close()
        self._log(f"copied to {next(iter(params.values())).device}", len(params))

    def tokenizer(self) -> TextTokenizer | None:
        return self._source.tokenizer()

    def _fitting(self, model: FamilyModel) -> dict[str, torch.Tensor]:
        """The file's parameters by name, checked against the module's names and shapes. The
        stamp matched, so a misfit is a code change under one engine version: the file is
        removed (the next start prepares it again) and the load fails."""
        kept = self._kept
        weights = {name: kept.parameter(name) for name in kept.tensors}
        expected = {name: p.shape for name, p in model.named_parameters()}
        wrong = sorted(set(expected) ^ set(weights)) + [
            n for n, shape in expected.items() if n in weights and weights[n].shape != shape
        ]
        if wrong:
            kept.path.unlink(missing_ok=True)
            raise ValueError(
                f"prepared weights {kept.path} do not fit the model ({', '.join(wrong[:4])}): "
                "removed; the next start prepares them again"
            )
        return weights

    def _log(self, how: str, count: int) -> None:
        log.info(
            "prepared weights %s %s: %d tensors, %.1f MiB, checked in %.2f s",
            how,
            self._kept.path,
            count,
            self._kept.nbytes / 2**20,
            time.perf_counter() - self._started,
        )


class PreparingWeights(ModelSource):
    """`source` prepared as usual, its placed weights then written as the prepared file."""

    def __init__(self, source: GGUFFile, file: Path, metadata: dict[str, Any]) -> None:
        self.family = source.family
        self.spec = source.spec
        self._source = source
        self._file = file
        self._metadata = metadata

    def fill(self, model: FamilyModel) -> None:
        self._source.fill(model)
        started = time.perf_counter()
        try:
            nbytes = prepared.write(self._file, dict(model.named_parameters()), self._metadata)
        except OSError as err:  # a full disk costs the next restart its head start, no more
            log.warning("prepared weights %s not written (%s)", self._file, err)
            return
        log.info(
            "prepared weights written %s: %.1f MiB in %.2f s",
            self._file,
            nbytes / 2**20,
            time.perf_counter() - started,
        )

    def tokenizer(self) -> TextTokenizer | None:
        return self._source.tokenizer()
