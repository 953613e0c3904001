"""`omni-bench random-checkpoint qwen3-omni`: a Qwen3-Omni checkpoint folder of random weights
in the published layout (`Qwen/Qwen3-Omni-30B-A3B-Instruct`), which
`Qwen3OmniMoeForConditionalGeneration.from_pretrained(DIR)` and
`Qwen3OmniMoeProcessor.from_pretrained(DIR)` load.

Written: config.json (model_type `qwen3_omni_moe`: thinker with its audio and vision encoders,
talker with its code predictor, code2wav), generation_config.json, model.safetensors (shards +
index past 4 GiB), tokenizer.json / tokenizer_config.json / chat_template.jinja, and
preprocessor_config.json (the Whisper-style 128-bin log-mel feature extractor at 16 kHz, and the
image processor). The video processor needs torchvision, which this machine lacks: it is not
written, so the processor loads without one (audio and text prompts only).

`full` is the published shape as far as this writer knows it (thinker 48 MoE layers of 128
experts top-8, hidden 2048; talker 20 MoE layers with a shared expert; 16 code groups; code2wav
at 12.5 frames a second of 24 kHz); `tiny` keeps every kind of part small enough for CPU tests.

Token ids: the tokenizer is a byte-level BPE trained on a few sentences, padded with unreachable
entries up to the base vocabulary, followed by Qwen's special tokens at their published offsets
from that base (<|endoftext|> +0 = 151643 in the full size, <|im_start|> +1, <|im_end|> +2,
<|vision_start|> +9, <|image_pad|> +12, <|video_pad|> +13, <|audio_start|> +26,
<|audio_end|> +27, <tts_pad> +28, <tts_text_bos> +29, <tts_text_eod> +30, <|audio_pad|> +32).
`system`, `user` and `assistant` are single BPE tokens; config.json names their ids (the
reference finds the user's and the assistant's turns through them). The talker's codec
vocabulary keeps the published layout: codes first, then 1024 ids the reference suppresses
except codec EOS (pad, bos, eos, think markers, speakers at their published offsets).

Weights: names and shapes are transformers' own (read off the model built on the meta device);
values random: unit-variance embeddings, 1/sqrt(fan_in) matrices, experts and convolutions,
norms at 1, biases 0, code2wav's layer scales at 0.5 and its last convolution scaled so random
codes decode to audio of RMS ~0.1 (tiny; no clipping at the output's +-1 clamp).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

CORPUS = (
    "The sun rises in the east and sets in the west. This simple fact has been observed by "
    "humans for thousands of years. Hello, how are you today? What is in this audio clip? "
    "system user assistant system user assistant You are a helpful assistant. 0123456789 "
)

# Qwen's special tokens by offset from the base vocabulary (151643 in the published tokenizer).
SPECIAL_NAMES = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
]
SPECIAL = {name: offset for offset, name in enumerate(SPECIAL_NAMES)}
SPECIAL_SLOTS = 64  # ids reserved past the base for special tokens (the tail is unused)

# A ChatML template with Qwen3-Omni's audio / image placeholders (what the processor expands).
CHAT_TEMPLATE = """{%- for message in messages -%}
  {{- '<|im_start|>' + message['role'] + '\\n' -}}
  {%- if message['content'] is string -%}{{- message['content'] -}}
  {%- else -%}
    {%- for item in message['content'] -%}
      {%- if item['type'] == 'text' -%}{{- item['text'] -}}
      {%- elif item['type'] == 'audio' or 'audio' in item -%}
        {{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}
      {%- elif item['type'] == 'image' or 'image' in item -%}
        {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  {{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""

# The talker's codec vocabulary past the codebook, by offset from the codebook size (2048
# published): pad +100, bos +101, eos +102, no-think +107, think bos / eos +108 / +109,
# speakers from +253. The last 1024 ids of the vocabulary are specials.
CODEC_SPECIAL = {
    "pad": 100,
    "bos": 101,
    "eos": 102,
    "nothink": 107,
    "think_bos": 108,
    "think_eos": 109,
}
SPEAKERS = {"chelsie": 253, "ethan": 254, "aiden": 255}


def shapes(size: str) -> dict[str, Any]:
    """The sub-configs' shape fields for `size` (tiny | full)."""
    if size == "full":
        text_vocab = 151643 + 421  # 152064
        thinker_hidden, codebook, groups = 2048, 2048, 16
        mrope = [24, 20, 20]
        text = dict(
            hidden_size=thinker_hidden,
            intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            max_position_embeddings=65536,
        )
        audio = dict(
            d_model=1280,
            encoder_layers=32,
            encoder_attention_heads=20,
            encoder_ffn_dim=5120,
            downsample_hidden_size=480,
            n_window_infer=800,
        )
        vision = dict(
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            deepstack_visual_indexes=[8, 16, 24],
        )
        talker = dict(
            hidden_size=1024,
            intermediate_size=2048,
            num_hidden_layers=20,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=128,
            moe_intermediate_size=384,
            shared_expert_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=6,
        )
        predictor = dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=5,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
        )
        code2wav = dict(
            hidden_size=1024,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=16,
            intermediate_size=3072,
            sliding_window=72,
            decoder_dim=1536,
        )
        accept_layer = 24
    else:
        text_vocab = 448 + SPECIAL_SLOTS
        thinker_hidden, codebook, groups = 64, 128, 8
        mrope = [4, 2, 2]
        text = dict(
            hidden_size=thinker_hidden,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=16,
            num_experts_per_tok=4,
            max_position_embeddings=2048,
        )
        # n_window_infer 200: attention windows of 26 encoder frames (2 s), so a few-second clip
        # crosses one
        audio = dict(
            d_model=32,
            encoder_layers=2,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            downsample_hidden_size=8,
            n_window_infer=200,
        )
        vision = dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, deepstack_visual_indexes=[0]
        )
        talker = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
        )
        predictor = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
        code2wav = dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=64,
            sliding_window=8,
            decoder_dim=32,
        )
        accept_layer = 1
    rope = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": mrope,
        "interleaved": True,
        "mrope_interleaved": True,
    }
    return {
        "text_vocab": text_vocab,
        "thinker_hidden": thinker_hidden,
        "codebook": codebook,
        "groups": groups,
        "rope": rope,
        "text": text,
        "audio": audio,
        "vision": vision,
        "talker": talker,
        "predictor": predictor,
        "code2wav": code2wav,
        "accept_layer": accept_layer,
    }


def build_config(size: str, word_ids: dict[str, int]) -> Any:
    """The `Qwen3OmniMoeConfig` for `size`; `word_ids`: the tokenizer's ids of system / user /
    assistant."""
    from transformers import Qwen3OmniMoeConfig

    s = shapes(size)
    base = s["text_vocab"] - SPECIAL_SLOTS
    ids = {name: base + offset for name, offset in SPECIAL.items()}
    codec_vocab = s["codebook"] + 1024
    codec = {k: s["codebook"] + v for k, v in CODEC_SPECIAL.items()}
    text = dict(
        s["text"],
        vocab_size=s["text_vocab"],
        rope_parameters=s["rope"],
        rms_norm_eps=1e-6,
        norm_topk_prob=True,
    )
    thinker = dict(
        text_config=text,
        audio_config=dict(
            s["audio"],
            num_mel_bins=128,
            output_dim=s["thinker_hidden"],
            n_window=50,
            max_source_positions=1500,
        ),
        vision_config=dict(
            s["vision"],
            out_hidden_size=s["thinker_hidden"],
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        audio_token_id=ids["<|audio_pad|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        audio_start_token_id=ids["<|audio_start|>"],
        audio_end_token_id=ids["<|audio_end|>"],
        user_token_id=word_ids["user"],
        position_id_per_seconds=13,
    )
    talker = dict(
        text_config=dict(
            s["talker"], vocab_size=codec_vocab, rope_parameters=s["rope"], norm_topk_prob=False
        ),
        code_predictor_config=dict(
            s["predictor"], vocab_size=s["codebook"], num_code_groups=s["groups"]
        ),
        num_code_groups=s["groups"],
        thinker_hidden_size=s["thinker_hidden"],
        accept_hidden_layer=s["accept_layer"],
        spatial_merge_size=2,
        codec_pad_id=codec["pad"],
        codec_bos_id=codec["bos"],
        codec_eos_token_id=codec["eos"],
        codec_nothink_id=codec["nothink"],
        codec_think_bos_id=codec["think_bos"],
        codec_think_eos_id=codec["think_eos"],
        speaker_id={k: s["codebook"] + v for k, v in SPEAKERS.items()},
        audio_token_id=ids["<|audio_pad|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        audio_start_token_id=ids["<|audio_start|>"],
        position_id_per_seconds=13,
    )
    code2wav = dict(
        s["code2wav"],
        codebook_size=s["codebook"],
        num_quantizers=s["groups"],
        upsample_rates=[8, 5, 4, 3],
        upsampling_ratios=[2, 2],
    )
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"],
        system_token_id=word_ids["system"],
        user_token_id=word_ids["user"],
        assistant_token_id=word_ids["assistant"],
    )


def write_tokenizer(out: Path, vocab_size: int) -> tuple[Any, dict[str, int]]:
    """A byte-level BPE + Qwen's special tokens (module docstring), saved with transformers.
    Returns it and the ids of the words `system`, `user`, `assistant`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from transformers import Qwen2TokenizerFast

    base = vocab_size - SPECIAL_SLOTS
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=base, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    # the role words first (merged early): the reference finds turns by their single ids
    bpe.train_from_iterator([CORPUS] * 8 + ["system", "user", "assistant"] * 64, trainer=trainer)
    state = json.loads(bpe.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    for i in range(len(vocab), base):  # unreachable entries: no merge produces them
        vocab[f"<unused_{i}>"] = i
    tok = Tokenizer.from_str(json.dumps(state))
    names = SPECIAL_NAMES + [f"<|extra_{i}|>" for i in range(len(SPECIAL_NAMES), SPECIAL_SLOTS)]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    words = {w: tok.encode(w).ids for w in ("system", "user", "assistant")}
    assert all(len(v) == 1 for v in words.values()), f"role words must be one token: {words}"
    fast = Qwen2TokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "audio_token": "<|audio_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast, {w: v[0] for w, v in words.items()}


def _fan_in(module: Any, shape: tuple[int, ...]) -> int:
    """Inputs feeding one output of `module`'s weight of `shape`."""
    import torch

    if isinstance(module, torch.nn.ConvTranspose1d):  # [in, out, k], stride s: in * k / s
        return max(1, shape[0] * shape[2] // module.stride[0])
    if isinstance(module, torch.nn.Conv1d | torch.nn.Conv2d):  # [out, in / groups, *k]
        return math.prod(shape[1:])
    return shape[-1]  # Linear [out, in]; stacked experts [E, out, in]


def draw_weights(
    model: Any, seed: int, dtype: Any, draw_on: str = "cpu"
) -> Iterator[tuple[str, Any]]:
    """(name, random tensor) for every entry of `model`'s (meta) state dict, drawn one at a
    time (module docstring)."""
    import torch

    gen = torch.Generator(device=draw_on).manual_seed(seed)
    owners = {}
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            owners[f"{mname}.{pname}" if mname else pname] = module
    for name, meta in model.state_dict().items():
        module = owners.get(name)
        leaf = name.rsplit(".", 1)[-1]
        shape = tuple(meta.shape)
        if not meta.is_floating_point():
            value = torch.zeros(shape, dtype=meta.dtype)
        elif isinstance(module, torch.nn.Embedding) or (leaf == "weight" and "embed" in name):
            value = torch.randn(shape, generator=gen, device=draw_on)
        elif leaf in ("scale", "gamma"):  # code2wav's layer scales: let every layer count
            value = torch.full(shape, 0.5)
        elif leaf == "bias" or leaf in ("alpha", "beta"):  # snake: exp(0) = 1
            value = torch.zeros(shape)
        elif len(shape) == 1:  # RMS / layer norms
            value = torch.ones(shape)
        else:  # matrices, stacked experts [E, out, in], convolutions
            fan_in = _fan_in(module, shape)
            value = torch.randn(shape, generator=gen, device=draw_on).mul_(fan_in**-0.5)
        yield name, value.to(dtype).cpu().contiguous()


def scale_code2wav_output(tensors: dict[str, Any], config: Any, target_rms: float = 0.1) -> None:
    """Scale code2wav's last convolution so random codes decode to RMS `target_rms` (tiny only:
    it runs the reference decoder once)."""
    import torch
    from transformers import Qwen3OmniMoeCode2Wav

    prefix = "code2wav."
    model = Qwen3OmniMoeCode2Wav(config.code2wav_config)
    own = {k[len(prefix) :]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
    model.load_state_dict(own, strict=False)
    groups, book = config.code2wav_config.num_quantizers, config.code2wav_config.codebook_size
    codes = torch.randint(0, book, (1, groups, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the last layer is linear: scaling it scales the output
        model.decoder[-1].conv.weight.div_(1000.0)  # measured below the +-1 clamp
        rms = 1000.0 * float(model(codes).pow(2).mean().sqrt())
    key = f"{prefix}decoder.{len(model.decoder) - 1}.conv.weight"
    tensors[key] = (tensors[key].float() * (target_rms / max(rms, 1e-9))).to(tensors[key].dtype)


def write_qwen3_omni(
    out: Path, size: str, dtype: str = "float32", seed: int = 0, draw_on: str = "cpu"
) -> Path:
    import torch
    from transformers import (
        GenerationConfig,
        Qwen3OmniMoeForConditionalGeneration,
    )

    from omni_bench.random_checkpoint import save_sharded

    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    s = shapes(size)
    _, word_ids = write_tokenizer(out, s["text_vocab"])
    config = build_config(size, word_ids)
    config.save_pretrained(out)
    im_end = config.im_end_token_id
    GenerationConfig(
        eos_token_id=[im_end, config.im_start_token_id - 1],
        pad_token_id=config.im_start_token_id - 1,
    ).save_pretrained(out)
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(config)
    tensors = draw_weights(model, seed, getattr(torch, dtype), draw_on)
    if size == "tiny":  # all in memory (3 MB) to measure code2wav's output
        drawn = dict(tensors)
        scale_code2wav_output(drawn, config)
        tensors = iter(drawn.items())
    save_sharded(published_names(tensors), out)  # full: one 4 GiB shard in memory at a time
    write_preprocessor_config(out)
    return out


def write_preprocessor_config(out: Path) -> None:
    """preprocessor_config.json as published: the feature extractor's fields and the image
    processor's in one file. Written field by field rather than through
    `Qwen3OmniMoeProcessor.save_pretrained`: building that processor needs a video processor,
    which needs torchvision (absent here)."""
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    features = WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=30,
        n_fft=400,
        padding_value=0.0,
        return_attention_mask=True,
        dither=0.0,
    )
    images = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2)
    fields = {**images.to_dict(), **features.to_dict()}
    fields.pop("mel_filters", None)  # recomputed from the sizes on load
    fields["image_processor_type"] = "Qwen2VLImageProcessor"
    fields["feature_extractor_type"] = "WhisperFeatureExtractor"
    fields["processor_class"] = "Qwen3OmniMoeProcessor"
    (out / "preprocessor_config.json").write_text(json.dumps(fields, indent=2, default=str))


def published_names(tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """transformers' in-memory names -> the published checkpoint's (what its loader converts
    back): the thinker's text model directly under `thinker.model`, its towers under `thinker`,
    and every expert its own three matrices (`mlp.experts.{e}.gate_proj.weight`, `up_proj`,
    `down_proj`) instead of the stacked `gate_up_proj` / `down_proj`."""
    import re

    for name, value in tensors:
        name = re.sub(r"^thinker\.model\.language_model\.", "thinker.model.", name)
        name = re.sub(r"^thinker\.model\.(audio_tower|visual)\.", r"thinker.\1.", name)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            stem, half = name[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                yield f"{stem}{e}.gate_proj.weight", value[e, :half].contiguous()
                yield f"{stem}{e}.up_proj.weight", value[e, half:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            stem = name[: -len("down_proj")]
            for e in range(value.shape[0]):
                yield f"{stem}{e}.down_proj.weight", value[e].contiguous()
        else:
            yield name, value


def torchvision_stand_in(folder: Path) -> Path:
    """A stand-in `torchvision` package under `folder` (returned: put it on PYTHONPATH), for a
    machine without torchvision (this one: no wheel for its torch).

    `Qwen3OmniMoeProcessor` cannot even be built without torchvision: its video processor needs
    it, and transformers' video utilities import `torchvision.io` when it is installed. For
    text and audio nothing of torchvision is called; every image or video call through the
    stand-in fails (its functions raise), so nothing can silently use it."""
    root = folder / "torchvision"
    for sub in ("", "io", "transforms", "transforms/v2"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    refuse = (
        "def __getattr__(name):\n"
        "    raise AttributeError(f'torchvision stand-in (omni_bench): no {name}')\n"
    )
    (root / "__init__.py").write_text(
        '"""Stand-in (omni_bench.random_qwen3_omni): no image or video ops."""\n'
        "from . import io, transforms\n__version__ = '0.28.0'\n"
    )
    (root / "io" / "__init__.py").write_text(refuse)
    (root / "transforms" / "__init__.py").write_text(
        "import enum\nfrom . import functional, v2\n"
        "class InterpolationMode(enum.Enum):\n"
        "    NEAREST = 'nearest'\n    NEAREST_EXACT = 'nearest-exact'\n"
        "    BILINEAR = 'bilinear'\n    BICUBIC = 'bicubic'\n    BOX = 'box'\n"
        "    HAMMING = 'hamming'\n    LANCZOS = 'lanczos'\n"
    )
    (root / "transforms" / "functional.py").write_text(
        "def pil_to_tensor(*args, **kwargs):\n"
        "    raise NotImplementedError('torchvision stand-in (omni_bench)')\n" + refuse
    )
    (root / "transforms" / "v2" / "__init__.py").write_text("from . import functional\n")
    (root / "transforms" / "v2" / "functional.py").write_text(refuse)
    meta = folder / "torchvision-0.28.0.dist-info"
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    return folder
