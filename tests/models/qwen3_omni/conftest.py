"""Tiny random Qwen3-Omni checkpoints (`omni-bench random-checkpoint qwen3-omni --size tiny`),
two seeds, each written once per session with transformers' model loaded from it as the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

SEEDS = (0, 1)


@dataclass
class Checkpoint:
    folder: Path
    seed: int
    reference: Any  # transformers' Qwen3OmniMoeForConditionalGeneration, eval, fp32
    tokenizer: Any


@pytest.fixture(scope="session", params=SEEDS, ids=[f"seed{s}" for s in SEEDS])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Checkpoint:
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from omni_bench.random_qwen3_omni import write_qwen3_omni

    folder = write_qwen3_omni(
        tmp_path_factory.mktemp("qwen3omni") / "ckpt", "tiny", seed=request.param
    )
    reference = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).eval()
    return Checkpoint(folder, request.param, reference, AutoTokenizer.from_pretrained(folder))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():  # type: ignore[no-untyped-def]
    """One intra-op thread (the shared 2-core machine; see tests/engine/conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
