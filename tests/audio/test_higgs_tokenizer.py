"""Our Higgs audio tokenizer (omni_server.audio.higgs_tokenizer) against transformers'
`HiggsAudioV2TokenizerModel`, the oracle, on tiny random checkpoints of two seeds (the writer's,
`omni-bench random-checkpoint higgs-audio-v2 --size tiny`):

- decode: the same codes (every code of the range drawn, 0 and the last among them) give
  audio >= 40 dB SNR against the reference's decode, each row of a batch;
- encode: clips (voices/joe.wav, and cuts of it whose length makes the reference pad the
  acoustic encoder's input or not: both branches are taken) give identical codes;
- the shapes our modules build from a config.json that states nothing but its model_type equal
  the tensors transformers builds from its defaults (the published sizes);
- bad folders are errors naming the file and the tensor or field; weight norm, as older saves
  carry it, folds to the same weights.

Stand-in, labelled: this machine has no torchaudio for its torch, and transformers will not
build the tokenizer without it; the reference runs in a child process that sees
`torchaudio_stand_in(..., resample_with_soxr=True)`, whose resample is soxr's. Our encoder's
resampler is made equal for the encode comparison (`semantic_resample` = the same soxr call);
its own resampler (torchaudio's algorithm) is compared with the real torchaudio on the H200
(tools/device/higgs_tokenizer_check.py) and checked here as a resampler against soxr.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soxr
import torch
from safetensors.torch import save_file

from omni_server.audio import decode
from omni_server.audio.higgs_tokenizer import (
    HiggsAudioTokenizer,
    TokenizerFolderError,
    load,
    read_config,
)
from omni_server.audio.higgs_tokenizer.resample import resample
from omni_server.audio.higgs_tokenizer.weights import fold_weight_norm
from tests.helpers.server import ROOT

SEEDS = (0, 1)
JOE = ROOT / "examples" / "higgs-audio-v2" / "voices" / "joe.wav"
CUTS = (None, 48480, 31234)  # joe whole (no padding), and two cuts the reference pads
MIN_SNR_DB = 40.0


def soxr_like_the_stand_in(audio: torch.Tensor, in_rate: int, out_rate: int) -> torch.Tensor:
    """The stand-in torchaudio's resample (random_checkpoint.torchaudio_stand_in): soxr's
    default quality, float64 in, cast back."""
    rows = audio.detach().cpu().double().numpy().reshape(-1, audio.shape[-1])
    out = np.stack([soxr.resample(row, in_rate, out_rate) for row in rows])
    return torch.from_numpy(out.reshape(*audio.shape[:-1], -1)).to(audio.dtype)


def joe_clips() -> list[np.ndarray]:
    samples, rate = decode(JOE.read_bytes())
    assert rate == 24000
    return [samples if cut is None else samples[:cut] for cut in CUTS]


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two checkpoints, the inputs, and the reference's outputs (one child process)."""
    pytest.importorskip("transformers")
    from omni_bench.random_checkpoint import (
        has_torchaudio,
        torchaudio_stand_in,
        write_higgs_audio_v2,
    )

    root = tmp_path_factory.mktemp("tokenizer")
    clips = joe_clips()
    jobs: dict[str, Any] = {"checkpoints": [], "default_shapes": str(root / "shapes.json")}
    for i, clip in enumerate(clips):
        np.save(root / f"clip{i}.npy", clip)
    for seed in SEEDS:
        folder = write_higgs_audio_v2(root / f"higgs{seed}", "tiny", seed=seed)
        size = read_config(folder / "audio_tokenizer").codebook_size
        rng = np.random.default_rng(seed)
        codes = rng.integers(0, size, (3, 8, 60))
        codes[0, :, 0], codes[0, :, 1] = 0, size - 1  # the ends of the range
        np.save(root / f"codes{seed}.npy", codes)
        jobs["checkpoints"].append(
            {
                "folder": str(folder / "audio_tokenizer"),
                "codes": str(root / f"codes{seed}.npy"),
                "clips": [str(root / f"clip{i}.npy") for i in range(len(clips))],
                "out": str(root / f"reference{seed}.npz"),
            }
        )
    (root / "jobs.json").write_text(json.dumps(jobs))
    paths = [] if has_torchaudio() else [str(torchaudio_stand_in(root / "ta", True))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, *sys.path])}
    script = Path(__file__).with_name("reference_higgs_tokenizer.py")
    run = subprocess.run(
        [sys.executable, str(script), str(root / "jobs.json")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return {"root": root, "jobs": jobs, "clips": clips, "real_torchaudio": not paths}


def snr_db(reference: np.ndarray, ours: np.ndarray) -> float:
    noise = float(np.sum((reference - ours) ** 2))
    return math.inf if noise == 0 else 10 * math.log10(float(np.sum(reference**2)) / noise)


@pytest.mark.slow
def test_decode_matches_transformers_at_40_db(compared: dict[str, Any]) -> None:
    for job in compared["jobs"]["checkpoints"]:
        tokenizer = load(Path(job["folder"]))
        codes = np.load(job["codes"])
        want = np.load(job["out"])["audio"]
        with torch.inference_mode():
            got = tokenizer.decode(torch.from_numpy(codes)).numpy()
        assert got.shape == want.shape == (3, 1, 60 * 960)
        for row in range(3):
            assert float(np.abs(want[row]).max()) > 0.01  # audio, not silence
            assert snr_db(want[row], got[row]) >= MIN_SNR_DB, (job["folder"], row)
        assert snr_db(want[0], got[1]) < 10  # other codes are other audio


@pytest.mark.slow
def test_encode_gives_the_reference_codes(compared: dict[str, Any]) -> None:
    if compared["real_torchaudio"]:
        pytest.skip("a real torchaudio: tools/device/higgs_tokenizer_check.py compares that")
    padded = set()
    for job in compared["jobs"]["checkpoints"]:
        tokenizer = load(Path(job["folder"]))
        tokenizer.semantic_resample = soxr_like_the_stand_in  # the reference's resampler
        want = np.load(job["out"])
        for i, clip in enumerate(compared["clips"]):
            audio = torch.from_numpy(clip).view(1, 1, -1)
            with torch.inference_mode():
                codes = tokenizer.encode(audio).numpy()
                hubert = tokenizer.semantic_features(audio).shape[1]
            assert codes.shape == want[f"codes_{i}"].shape == (1, 8, hubert)
            assert np.array_equal(codes, want[f"codes_{i}"]), (job["folder"], i)
            assert len(np.unique(codes)) > 20  # varied codes, not one code everywhere
            padded.add(tokenizer.acoustic_encoder.frames(len(clip)) != hubert)
    assert padded == {True, False}  # both of the acoustic encoder's paths were compared


@pytest.mark.slow
def test_default_sizes_build_the_tensors_transformers_builds(
    compared: dict[str, Any], tmp_path: Path
) -> None:
    theirs = json.loads(Path(compared["jobs"]["default_shapes"]).read_text())
    (tmp_path / "config.json").write_text('{"model_type": "higgs_audio_v2_tokenizer"}')
    with torch.device("meta"):
        ours = HiggsAudioTokenizer(read_config(tmp_path)).state_dict()
    unused = ("decoder_semantic.", "fc1.", "masked_spec_embed", "cluster_size", "embed_avg",
              "inited")  # fmt: skip
    with torch.device("meta"):  # their saved names, weight norm folded as load folds it
        saved = fold_weight_norm({name: torch.empty(shape) for name, shape in theirs.items()})
    want = {name: list(t.shape) for name, t in saved.items() if not any(u in name for u in unused)}
    assert {name: list(t.shape) for name, t in ours.items()} == want
    assert len(want) > 400


# ---- without transformers: a folder our own code writes -------------------------------------

TINY = {
    "model_type": "higgs_audio_v2_tokenizer",
    "codebook_size": 16, "codebook_dim": 4, "target_bandwidths": [0.8],  # 8 x 4 bits at 25/s
    "acoustic_model_config": {"encoder_hidden_size": 2, "downsampling_ratios": [8, 5, 4, 2, 3],
                              "decoder_hidden_size": 32, "upsampling_ratios": [8, 5, 4, 2, 3],
                              "hidden_size": 8},
    "semantic_model_config": {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                              "intermediate_size": 16, "conv_dim": [4] * 7,
                              "num_conv_pos_embeddings": 4, "num_conv_pos_embedding_groups": 2},
}  # fmt: skip


def write_folder(folder: Path, config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(seed)
    model = HiggsAudioTokenizer(read_config(folder))
    tensors = {name: torch.randn(t.shape) for name, t in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def test_a_folder_loads_and_round_trips_shapes(tmp_path: Path) -> None:
    write_folder(tmp_path, TINY)
    tokenizer = load(tmp_path)
    assert tokenizer.config.num_quantizers == 8 and tokenizer.config.hop_length == 960
    with torch.inference_mode():
        audio = tokenizer.decode(torch.randint(0, 16, (2, 8, 5)))
        codes = tokenizer.encode(torch.randn(1, 1, 24000))
    assert audio.shape == (2, 1, 5 * 960)
    assert codes.shape == (1, 8, 25) and int(codes.max()) < 16


def test_weight_norm_folds_to_the_same_weights(tmp_path: Path) -> None:
    """Both ways a save may carry weight norm: (weight_g, weight_v) and parametrizations."""
    tensors = write_folder(tmp_path, TINY)
    normed = dict(tensors)
    cases = (
        ("acoustic_decoder.conv1", (".weight_g", ".weight_v"), [1, 2]),
        (
            "acoustic_encoder.conv2",
            (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
            [1, 2],
        ),
        (
            "semantic_model.encoder.pos_conv_embed.conv",
            (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
            [0, 1],
        ),
    )  # fmt: skip  (the codec's convs keep dim 0, HuBERT's positional one dim 2)
    for stem, (scale, direction), dims in cases:
        weight = normed.pop(f"{stem}.weight")
        normed[stem + scale] = weight.norm(dim=dims, keepdim=True)
        normed[stem + direction] = 3.0 * weight  # any length: only the direction counts
    folded = fold_weight_norm(normed)
    assert set(folded) == set(tensors)
    for name, weight in tensors.items():
        torch.testing.assert_close(folded[name], weight, rtol=1e-5, atol=1e-6)


def test_bad_folders_name_the_file_and_what_is_wrong(tmp_path: Path) -> None:
    tensors = write_folder(tmp_path, TINY)
    path = tmp_path / "model.safetensors"
    save_file({k: v for k, v in tensors.items() if k != "fc2.bias"}, str(path))
    with pytest.raises(TokenizerFolderError, match=r"model\.safetensors: lacks fc2\.bias"):
        load(tmp_path)
    save_file({**tensors, "fc9.weight": torch.zeros(1)}, str(path))
    with pytest.raises(TokenizerFolderError, match=r"has unexpected fc9\.weight"):
        load(tmp_path)
    save_file({**tensors, "fc2.bias": torch.zeros(3)}, str(path))
    with pytest.raises(
        TokenizerFolderError, match=r"fc2\.bias \(3,\) \(config.json implies \(8,\)"
    ):
        load(tmp_path)
    save_file({**tensors, "decoder_semantic.conv1.weight": torch.zeros(1)}, str(path))
    load(tmp_path)  # the semantic decoder's tensors are the checkpoint's, never read
    config = {**TINY, "semantic_model_config": {**TINY["semantic_model_config"],
                                                "do_stable_layer_norm": True}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerFolderError, match=r"semantic_model_config\.do_stable_layer_norm"):
        load(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "dac"}')
    with pytest.raises(TokenizerFolderError, match="model_type is not 'higgs_audio_v2_tokenizer'"):
        load(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(TokenizerFolderError, match=r"no config\.json"):
        load(tmp_path)


def test_the_semantic_resampler_resamples() -> None:
    """24 -> 16 kHz of speech-band tones: the length torchaudio gives (ceil(2 n / 3)) and the
    samples soxr gives, away from the edges (each filter rings differently there)."""
    t = np.arange(24000 * 2) / 24000
    tones = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 3100 * t)).astype(
        np.float32
    )
    ours = resample(torch.from_numpy(tones).view(1, 1, -1), 24000, 16000).view(-1).numpy()
    assert len(ours) == math.ceil(2 * len(tones) / 3)
    want = soxr.resample(tones.astype(np.float64), 24000, 16000)
    middle = slice(200, len(want) - 200)
    assert float(np.abs(ours[middle] - want[middle]).max()) < 2e-3
    # odd lengths and a batch of rows: each row alone
    rows = torch.randn(3, 1, 24001)
    both = resample(rows, 24000, 16000)
    assert both.shape == (3, 1, 16001)
    torch.testing.assert_close(both[1], resample(rows[1:2], 24000, 16000)[0])
