"""Our Higgs audio tokenizer (omni_server.audio.higgs_tokenizer) against transformers'
`HiggsAudioV2TokenizerModel` where a REAL torchaudio imports (the H200 machine: torch 2.11,
transformers 5.17): what the CPU tests cannot check, since there the reference resamples with a
stand-in.

    python3 tools/device/higgs_tokenizer_check.py [--out DIR] [--seeds 0,1] [--devices cpu,cuda]
        [--no-full]

For tiny random checkpoints of each seed (`random-checkpoint higgs-audio-v2 --size tiny`, written
to DIR) and, unless --no-full, a full-size random tokenizer (the published sizes: HuBERT base,
DAC 64 / 1024, 8 x 1024 codes), on each device:

- resample: our 24 -> 16 kHz against `torchaudio.functional.resample` (largest difference);
- encode: voices/joe.wav whole and two cuts (the acoustic encoder's padded and unpadded
  paths), with each side's own resampler: the codes must be identical;
- decode: random codes, our audio against the reference's (SNR, >= 40 dB required);
- on CUDA, the decoder replayed from CUDA graphs (audio/decode_graphs.py, as the vocoder serves
  it) against our eager decode.

Prints one JSON line per (checkpoint, device) and writes DIR/higgs_tokenizer_check.json; exit 1
when a code differs or an SNR is under 40 dB, 2 when there is no real torchaudio.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
JOE = ROOT / "examples" / "higgs-audio-v2" / "voices" / "joe.wav"
CUTS = (None, 48480, 31234)  # as tests/audio/test_higgs_tokenizer.py: both padding paths
MIN_SNR_DB = 40.0


def joe_clips() -> list[np.ndarray]:
    with wave.open(str(JOE)) as f:  # 16-bit mono 24 kHz
        assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (24000, 1, 2)
        samples = np.frombuffer(f.readframes(f.getnframes()), "<i2").astype(np.float32) / 32768
    return [samples if cut is None else samples[:cut] for cut in CUTS]


def snr_db(reference: torch.Tensor, ours: torch.Tensor) -> float:
    noise = float((reference - ours).double().pow(2).sum())
    signal = float(reference.double().pow(2).sum())
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def compare(folder: Path, device: str) -> dict[str, Any]:
    import torchaudio
    from transformers import HiggsAudioV2TokenizerModel

    from omni_server.audio import higgs_tokenizer
    from omni_server.audio.higgs_tokenizer.resample import resample

    reference = HiggsAudioV2TokenizerModel.from_pretrained(folder).eval().to(device)
    ours = higgs_tokenizer.load(folder, device)
    config = ours.config
    row: dict[str, Any] = {"folder": str(folder), "device": device}
    clips = [torch.from_numpy(c).view(1, 1, -1).to(device) for c in joe_clips()]
    with torch.inference_mode():
        diffs = [
            float((resample(c, 24000, 16000) - torchaudio.functional.resample(c, 24000, 16000))
                  .abs().max())
            for c in clips
        ]  # fmt: skip
        row["resample_max_abs_diff"] = max(diffs)
        differing, total, padded = [], 0, []
        for clip in clips:
            want = reference.encode(clip, return_dict=False)
            got = ours.encode(clip)
            assert got.shape == want.shape, (got.shape, want.shape)
            differing.append(int((got != want).sum()))
            total += want.numel()
            frames = ours.semantic_features(clip).shape[1]
            padded.append(ours.acoustic_encoder.frames(clip.shape[-1]) != frames)
        row["encode_codes_differing"] = differing  # one count a clip
        row["encode_codes"] = total
        row["encode_padded_paths"] = padded
        generator = torch.Generator().manual_seed(0)
        codes = torch.randint(0, config.codebook_size, (4, config.num_quantizers, 64),
                              generator=generator).to(device)  # fmt: skip
        want_audio = reference.decode(codes, return_dict=False)
        got_audio = ours.decode(codes)
        row["decode_snr_db"] = min(snr_db(want_audio[i], got_audio[i]) for i in range(4))
    if device.startswith("cuda"):
        from omni_server.audio.decode_graphs import GraphedDecoder

        graphs = GraphedDecoder(ours.decode, config.num_quantizers, device, (1, 4))
        graphs.warm([38])
        host = codes[:, :, :38].cpu().numpy()
        with torch.inference_mode():
            eager = ours.decode(codes[:, :, :38]).float().cpu().numpy()[:, 0]
        replayed = graphs.decode(host)
        row["graphs_max_abs_diff"] = float(np.abs(replayed - eager).max())
        row["graphs_replays"] = graphs.replays
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/higgs-tokenizer-check"))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--devices", default="cpu,cuda")
    parser.add_argument("--no-full", action="store_true", help="skip the full-size tokenizer")
    args = parser.parse_args(argv)
    from omni_bench.random_checkpoint import has_torchaudio, write_audio_tokenizer

    if not has_torchaudio():
        print("no real torchaudio here: this check is for a machine that has one")
        return 2
    import torchaudio
    import transformers

    print(f"# torch {torch.__version__}, torchaudio {torchaudio.__version__}, "
          f"transformers {transformers.__version__}", flush=True)  # fmt: skip
    devices = [d for d in args.devices.split(",") if d != "cuda" or torch.cuda.is_available()]
    folders = []
    for seed in (int(s) for s in args.seeds.split(",")):
        folder = args.out / f"tiny{seed}"
        write_audio_tokenizer(folder, "tiny", 128, seed)  # the writer's tiny tokenizer
        folders.append(folder)
    if not args.no_full:
        write_audio_tokenizer(args.out / "full", "full", 1024, 0)
        folders.append(args.out / "full")
    rows = []
    for folder in folders:
        for device in devices:
            row = compare(folder, device)
            print(json.dumps(row), flush=True)
            rows.append(row)
    (args.out / "higgs_tokenizer_check.json").write_text(json.dumps(rows, indent=2) + "\n")
    failed = [
        r for r in rows if any(r["encode_codes_differing"]) or r["decode_snr_db"] < MIN_SNR_DB
    ]
    print(f"# {len(rows) - len(failed)} of {len(rows)} passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
