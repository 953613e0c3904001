"""Prepared weights (engine/prepared.py, prepared_gguf.py): the first load of a GGUF writes its
placed weights as a checked safetensors file; a later load maps that file (it reads neither the
GGUF's header nor its blocks) and its module's parameters are the read-only mapping; a stale,
corrupt, truncated or foreign file is refused and prepared again. A tiny random GGUF stands in
for SmolLM2 (the same load path in milliseconds)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from omni_server.engine import (
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
    prepared_gguf,
)
from omni_server.engine import prepared as prepared_file
from omni_server.stage.worker import prepared_dir
from tests.fixtures.tiny_gguf import write_tiny_gguf

LOGGER = "omni_server.engine.prepared_gguf"
CONFIG = {"max_total_tokens": 256, "max_batch_size": 4, "cpu_weight_order": "columns"}


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    path = tmp_path / "prepared"
    path.mkdir(mode=0o700)
    return path


def _load(gguf: Path, directory: Path) -> Engine:
    return Engine.from_gguf(EngineConfig.from_table(CONFIG), path=gguf, prepared=directory)


def _the_file(directory: Path) -> Path:
    (file,) = directory.iterdir()  # one file: no temporary left behind
    return file


def _answer(engine: Engine) -> list[int]:
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "hi there"}])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    events = engine.generate([GenerationRequest("r", ids, params)])["r"]
    return [t for event in events for t in event.token_ids]


def _outcomes(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What each load did with the prepared file, in order: written, mapped, copied, refused."""
    words = ("written", "mapped", "copied", "refused")
    return [
        next(w for w in words if w in r.getMessage())
        for r in caplog.records
        if r.name == LOGGER and any(w in r.getMessage() for w in words)
    ]


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            low, high = line.split()[0].split("-")
            ranges.append((int(low, 16), int(high, 16)))
    return ranges


def test_a_second_load_maps_the_prepared_file_read_only(
    gguf: Path, directory: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    first = _load(gguf, directory)
    file = _the_file(directory)
    assert file.stat().st_mode & 0o777 == 0o600

    def no_gguf(path: Path) -> None:
        raise AssertionError(f"the GGUF {path} was opened: the prepared file was not used")

    monkeypatch.setattr(prepared_gguf, "open_gguf", no_gguf)
    second = _load(gguf, directory)
    assert _outcomes(caplog) == ["written", "mapped"]
    ranges = _mapped_ranges(file)
    assert ranges, "the prepared file is not mapped"
    ones = dict(first.model.named_parameters())
    for name, param in second.model.named_parameters():
        # the same values in the same memory order, and the memory is the file's mapping
        assert torch.equal(param, ones[name]) and param.stride() == ones[name].stride(), name
        assert any(low <= param.data_ptr() < high for low, high in ranges), name
    assert any(not p.is_contiguous() for p in second.model.parameters())  # by columns
    assert _answer(second) == _answer(first)


@pytest.mark.gpu
def test_on_a_gpu_the_prepared_weights_are_copied_in(
    gguf: Path, directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    config = EngineConfig.from_table({**CONFIG, "device": "cuda:0"})
    first = Engine.from_gguf(config, path=gguf, prepared=directory)
    second = Engine.from_gguf(config, path=gguf, prepared=directory)
    assert _outcomes(caplog) == ["written", "copied"]
    ones = dict(first.model.named_parameters())
    for name, param in second.model.named_parameters():
        assert param.device.type == "cuda" and torch.equal(param, ones[name]), name
    assert _answer(second) == _answer(first)


def test_the_prepared_file_is_safetensors(gguf: Path, directory: Path) -> None:
    from safetensors import safe_open

    engine = _load(gguf, directory)
    params = dict(engine.model.named_parameters())
    with safe_open(str(_the_file(directory)), framework="pt", device="cpu") as f:
        header = f.metadata()
        for name in f.keys():  # noqa: SIM118  (safe_open has keys(), no __iter__)
            stored = f.get_tensor(name)
            # a weight stored by columns is kept as its bytes lie: the transpose, row-major
            transposed = not params[name].is_contiguous()
            assert torch.equal(stored.t() if transposed else stored, params[name]), name
        assert set(f.keys()) == set(params)
    assert prepared_file.METADATA_KEY in header


def test_a_stale_file_is_refused_and_prepared_again(
    gguf: Path, directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    _load(gguf, directory)
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the source changed
    _load(gguf, directory)
    _load(gguf, directory)
    assert _outcomes(caplog) == ["written", "refused", "written", "mapped"]
    assert "stale" in next(r.getMessage() for r in caplog.records if "refused" in r.getMessage())


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "garbage", "world-readable"])
def test_a_damaged_file_is_refused_and_prepared_again(
    damage: str, gguf: Path, directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    answer = _answer(_load(gguf, directory))
    file = _the_file(directory)
    data = bytearray(file.read_bytes())
    if damage == "flipped byte":
        data[-100] ^= 0x40  # inside a tensor: only the digest can tell
        file.write_bytes(data)
    elif damage == "truncated":
        file.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        file.write_bytes(b"\xff" * 64)
    else:
        file.chmod(0o644)
    again = _load(gguf, directory)
    assert _answer(again) == answer  # prepared from the GGUF again, not from the damage
    _load(gguf, directory)
    assert _outcomes(caplog) == ["written", "refused", "written", "mapped"]
    assert _the_file(directory).stat().st_mode & 0o777 == 0o600


def test_a_link_in_place_of_the_file_is_refused(
    gguf: Path, directory: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    _load(gguf, directory)
    file = _the_file(directory)
    elsewhere = tmp_path / "elsewhere.safetensors"
    file.rename(elsewhere)
    file.symlink_to(elsewhere)
    _load(gguf, directory)
    assert _outcomes(caplog) == ["written", "refused", "written"]
    assert not file.is_symlink()


def test_no_file_reads_as_none(directory: Path) -> None:
    assert prepared_file.read(directory / "absent.safetensors", {"format": 1}) is None


def test_the_run_directory_for_prepared_weights_is_private(tmp_path: Path) -> None:
    path = prepared_dir(tmp_path)
    assert path == tmp_path / "prepared" and path.stat().st_mode & 0o777 == 0o700
    path.chmod(0o755)  # opened to other users: not trusted
    assert prepared_dir(tmp_path) is None
