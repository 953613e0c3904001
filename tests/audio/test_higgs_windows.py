"""The Higgs vocoder's decode windows (audio/higgs_codec.py: next_window) and its decoder replayed
from CUDA graphs (audio/decode_graphs.py) against the same decoder run eagerly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from omni_server.audio.decode_graphs import GraphedDecoder
from omni_server.audio.higgs_codec import Window, next_window

SIZES = {"chunk": 16, "context": 12, "lookahead": 10}


def test_a_chunk_waits_for_its_lookahead_and_keeps_its_own_columns() -> None:
    assert next_window(28, 53, False, **SIZES) is None  # 28 + 16 + 10 = 54 needed
    assert next_window(28, 54, False, **SIZES) == Window(16, 54, 28, 16)
    assert next_window(0, 14, False, chunk=4, context=12, lookahead=10) == Window(0, 14, 0, 4)


def test_the_last_window_takes_more_context_up_to_the_steady_length() -> None:
    # 5 columns left after 60: at least 12 before them, and up to a window of 38 columns
    assert next_window(60, 65, True, **SIZES, span=38) == Window(27, 65, 60, 5)
    assert next_window(60, 65, True, **SIZES) == Window(48, 65, 60, 5)  # no span: context only
    # a short stream: whatever it has, from column 0
    assert next_window(4, 9, True, **SIZES, span=38) == Window(0, 9, 4, 5)
    # never less context than asked, nor a window longer than the steady one
    assert next_window(60, 85, True, **SIZES, span=38) == Window(47, 85, 60, 25)
    assert next_window(60, 60, True, **SIZES, span=38) is None


def test_a_stream_whose_decode_fell_behind_still_ends_a_chunk_at_a_time() -> None:
    """30 columns left at its end (more than a chunk and its lookahead): a steady window, then
    the rest at the steady length; no window of a new length (a CUDA graph per length)."""
    assert next_window(60, 90, True, **SIZES, span=38) == Window(48, 86, 60, 16)
    assert next_window(76, 90, True, **SIZES, span=38) == Window(52, 90, 76, 14)


def test_graphs_need_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        GraphedDecoder(lambda codes: codes, 8, "cpu")


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")  # the checkpoint writer's
    from omni_bench.random_checkpoint import write_higgs_audio_v2
    from omni_server.audio.higgs_codec import load_audio_tokenizer, open_checkpoint

    folder: Path = write_higgs_audio_v2(tmp_path_factory.mktemp("ckpt") / "higgs", "tiny")
    return load_audio_tokenizer(open_checkpoint({"checkpoint": str(folder)}), "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphed_decode_equals_eager_for_any_batch_and_length(codec) -> None:  # type: ignore[no-untyped-def]
    k, real = int(codec.config.num_quantizers), int(codec.config.codebook_size)

    def eager(codes: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            values = codec.decode(torch.from_numpy(codes).cuda())
        return values[:, 0].float().cpu().numpy()

    graphs = GraphedDecoder(codec.decode, k, "cuda", (1, 4))
    graphs.warm([14])
    assert graphs.num_graphs == 2
    rng = np.random.default_rng(3)
    for rows, length in ((1, 14), (3, 14), (4, 38), (2, 17), (6, 14)):  # 6: past the buckets
        codes = rng.integers(0, real, (rows, k, length))
        want = eager(codes)
        got = graphs.decode(codes)
        assert got.shape == want.shape == (rows, length * int(codec.config.hop_length))
        scale = float(np.abs(want).max())
        assert scale > 0 and float(np.abs(got - want).max()) <= 5e-3 * scale  # TF32 convolutions
        # the answer is the caller's: a later replay of the same graph leaves it as it was
        kept = got.copy()
        graphs.decode(rng.integers(0, real, (rows, k, length)))
        assert np.array_equal(got, kept)
    assert graphs.eager_calls == 2  # the 6-row call, twice
    assert graphs.num_graphs == 4  # (1, 14), (4, 14), (4, 38), (4, 17)
    # capture_on_use off: what was not warmed runs eagerly, equal, and nothing is captured
    frozen = GraphedDecoder(codec.decode, k, "cuda", (1, 4), capture_on_use=False)
    frozen.warm([14])
    for rows, length in ((1, 14), (2, 17)):
        codes = rng.integers(0, real, (rows, k, length))
        want, got = eager(codes), frozen.decode(codes)
        assert float(np.abs(got - want).max()) <= 5e-3 * float(np.abs(want).max())
    assert (frozen.num_graphs, frozen.replays, frozen.eager_calls) == (2, 1, 1)
