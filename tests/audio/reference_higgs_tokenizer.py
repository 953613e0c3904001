"""Child process of tests/audio/test_higgs_tokenizer.py: transformers' HiggsAudioV2TokenizerModel
(the oracle) on the same inputs as our tokenizer, run where the torchaudio stand-in (soxr's
resample) or a real torchaudio is on the path: transformers will not build the model without one.

    python reference_higgs_tokenizer.py JOBS.json

JOBS.json: {"checkpoints": [{"folder", "codes": .npy [B, K, L], "clips": [.npy [S] 24 kHz],
"out": .npz}], "default_shapes": .json}. Each checkpoint's out.npz holds "audio" (decode of
the codes, [B, 1, L * hop]) and "codes_<i>" (encode of clip i, [1, K, n]); default_shapes gets
the name -> shape of every tensor of the tokenizer transformers builds from a config.json that
says nothing but its model_type (its defaults), on the meta device.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import HiggsAudioV2TokenizerConfig, HiggsAudioV2TokenizerModel


def main(jobs_path: str) -> None:
    jobs = json.loads(Path(jobs_path).read_text())
    for job in jobs["checkpoints"]:
        model = HiggsAudioV2TokenizerModel.from_pretrained(job["folder"]).eval()
        out = {}
        with torch.inference_mode():
            codes = torch.from_numpy(np.load(job["codes"]))
            out["audio"] = model.decode(codes, return_dict=False).numpy()
            for i, clip in enumerate(job["clips"]):
                values = torch.from_numpy(np.load(clip)).view(1, 1, -1)
                out[f"codes_{i}"] = model.encode(values, return_dict=False).numpy()
        np.savez(job["out"], **out)
    with torch.device("meta"):
        model = HiggsAudioV2TokenizerModel(HiggsAudioV2TokenizerConfig())
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    Path(jobs["default_shapes"]).write_text(json.dumps(shapes))


if __name__ == "__main__":
    main(sys.argv[1])
