"""Child process of tests/examples/test_higgs_audio_v2.py: transformers' reference for the
served Higgs Audio v2 pipeline, run where a torchaudio stand-in may be on the path (transformers
will not build the audio tokenizer without one; tests/examples says which).

    python reference_higgs.py CHECKPOINT CASES.json OUT.json MAX_FRAMES

Each case {"conversation", "clip" (a wav path or null)} -> {"frames": generated frames as
`HiggsAudioV2ForConditionalGeneration.generate(do_sample=False, ras_win_len=None)` returns
them after the prompt, "audio": `HiggsAudioV2Processor.decode` of them (24 kHz floats),
"prompt": its token count, "prompt_frames": its reference clip's frames (0 without)}. The
prompt is the processor's own: its chat template rendered, then `processor(text, audio)`,
which encodes the clip with the audio tokenizer and expands the frame placeholders. The
template writes `<|begin_of_text|>` itself, so the text is tokenized without added special
tokens, as `processor.apply_chat_template(..., tokenize=True)` does for such a template
(transformers' processing_utils): the tokenizer's own BOS would make it the prompt's second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import HiggsAudioV2ForConditionalGeneration, HiggsAudioV2Processor

from omni_server.audio import decode


def main(folder: str, cases_path: str, out_path: str, max_frames: str) -> None:
    processor = HiggsAudioV2Processor.from_pretrained(folder)
    model = HiggsAudioV2ForConditionalGeneration.from_pretrained(folder).eval()
    results = []
    for case in json.loads(Path(cases_path).read_text()):
        text = processor.apply_chat_template(
            case["conversation"], add_generation_prompt=True, tokenize=False
        )
        audio = None
        if case["clip"] is not None:
            samples, rate = decode(Path(case["clip"]).read_bytes())
            assert rate == 24000, rate
            audio = [samples]
        inputs = processor(
            text=text, audio=audio, sampling_rate=24000, return_tensors="pt",
            add_special_tokens=False,
        )  # fmt: skip
        inputs.pop("token_type_ids", None)
        first, second = inputs["input_ids"][0, :2].tolist()
        bos = processor.tokenizer.bos_token_id
        assert first == bos and second != bos, "the prompt opens with one BOS"
        length = inputs["input_ids"].shape[1]
        with torch.inference_mode():
            out = model.generate(
                **inputs, max_new_tokens=int(max_frames), do_sample=False, ras_win_len=None
            )
        frames = out[0].tolist()
        prompt_frames = 0 if audio is None else inputs["audio_input_ids"].shape[1]
        generated = frames[prompt_frames:]
        with torch.inference_mode():
            wave = processor.decode(torch.tensor([generated]))
        results.append(
            {
                "frames": generated,
                "audio": wave.float().reshape(-1).tolist(),
                "prompt": length,
                "prompt_frames": prompt_frames,
            }
        )
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
