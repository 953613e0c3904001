"""`omni-bench random-checkpoint`: write a checkpoint folder of random weights in the layout a
published one has, so the engine and transformers can both load it (no weights can be
downloaded here: every check and speed run starts from one of these).

    omni-bench random-checkpoint higgs-audio-v2 --size tiny --out DIR   # CPU tests, ~3 MB
    omni-bench random-checkpoint higgs-audio-v2 --size full --out DIR   # the real shapes (GPU)
    omni-bench random-checkpoint llama --size tiny --out DIR
    omni-bench random-checkpoint qwen3-omni --size tiny --out DIR     # see random_qwen3_omni.py
    omni-bench random-checkpoint higgs-audio-v2 --size tiny --audio-eos-scale 0.7 --out DIR

higgs-audio-v2 writes what `HiggsAudioV2ForConditionalGeneration.from_pretrained(DIR)` and
`HiggsAudioV2Processor.from_pretrained(DIR)` load: config.json, generation_config.json,
model.safetensors (or shards + model.safetensors.index.json), tokenizer.json /
tokenizer_config.json, chat_template.jinja, processor_config.json; and the audio tokenizer
(`HiggsAudioV2TokenizerModel`: config.json + model.safetensors) in DIR/audio_tokenizer, which
processor_config.json names by its absolute path (the published model names the separate
`bosonai/higgs-audio-v2-tokenizer` repository there; move the two folders together and re-run, or
edit that one path).

Weights: tensor names and shapes are transformers' own (read off the model built on the meta
device), values random: unit-variance embeddings, 1/sqrt(fan_in) matrices, norms at 1 (so every
layer moves the residual stream and greedy outputs depend on the context). The tokenizer is a
byte-level BPE trained on a few sentences (its merges matter to no test), padded with unreachable
entries to the base vocabulary size, followed by the 256 special tokens of Llama 3 at their
usual offsets, Higgs' audio tokens among them: <|audio_bos|> +11, <|audio_eos|> +12,
<|audio_out_bos|> +13, <|reserved_special_token_6|> (the delay token) +14, <|AUDIO|> +15,
<|AUDIO_OUT|> +16, which is where config.json's token ids point (128013 / 128014 / 128016 in
the full size). <|scene_desc_start|> / <|scene_desc_end|> at +17 / +18 are this writer's choice.

`--audio-eos-scale S` multiplies the audio head's stream-EOS rows (one a codebook) by S. At 1
the random model ends its audio after ~10-70 greedy frames (the end code is one of 130 in each
of 8 codebooks); at 0.7 most greedy generations run past 48 frames and some still end, so
equality tests compare long generations and the end of audio (docs/models.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

FAMILIES = ("higgs-audio-v2", "llama", "qwen3-omni")
SIZES = ("tiny", "full")
SHARD_BYTES = 4 << 30

CORPUS = (
    "The sun rises in the east and sets in the west. This simple fact has been observed by "
    "humans for thousands of years. It was the night before my birthday. Hooray! It's almost "
    "here! It may not be a holiday, but it's the best day of the year. Generate audio following "
    "instruction. Audio is recorded from a quiet room. Hello, how are you today? 0123456789"
)

# Llama 3's special tokens by offset from the base vocabulary, with Higgs Audio v2's renames.
SPECIAL_NAMES = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    4: "<|finetune_right_pad_id|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: "<|eot_id|>",
    10: "<|python_tag|>",
    11: "<|audio_bos|>",
    12: "<|audio_eos|>",
    13: "<|audio_out_bos|>",
    15: "<|AUDIO|>",
    16: "<|AUDIO_OUT|>",
    17: "<|scene_desc_start|>",
    18: "<|scene_desc_end|>",
}
BOS, EOS_TEXT, EOT, AUDIO_BOS, DELAY, AUDIO_OUT = 0, 1, 9, 13, 14, 16

# Higgs Audio v2's prompt format, as the reference processor's template renders it (system
# message required; a "scene" message right after it goes inside the system turn; assistant
# turns are audio; the generation prompt opens an audio stream).
HIGGS_CHAT_TEMPLATE = """{{- bos_token -}}
{%- macro text_of(content) -%}
  {%- if content is string -%}{{- content | trim -}}
  {%- else -%}
    {%- for item in content if item['type'] == 'text' -%}{{- item['text'] | trim -}}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- if not messages or messages[0]['role'] != 'system' -%}
  {{- raise_exception("A system message is required but not provided!") -}}
{%- endif -%}
{%- set first = messages[0]['content'] -%}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' -}}
{{- (first | trim) if first is string else (first[0]['text'] | trim) -}}
{%- set rest = messages[1:] -%}
{%- if rest and rest[0]['role'] == 'scene' -%}
  {{- '\\n\\n<|scene_desc_start|>\\n' -}}
  {%- set scene = rest[0]['content'] -%}
  {%- if scene is string -%}{{- scene | trim -}}
  {%- else -%}
    {%- for item in scene -%}
      {%- if item['type'] == 'text' -%}
        {{- item['text'] | trim -}}
        {%- if loop.first and not loop.last -%}{{- '\\n\\n' -}}
        {%- elif not loop.first and not loop.last and scene[loop.index]['type'] != 'audio' -%}
          {{- '\\n' -}}
        {%- endif -%}
      {%- elif item['type'] == 'audio' -%}
        {{- ' <|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>' -}}{{- '' if loop.last else '\\n' -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  {{- '\\n<|scene_desc_end|>' -}}
  {%- set rest = rest[1:] -%}
{%- endif -%}
{{- '<|eot_id|>' -}}
{%- for message in rest -%}
  {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}
  {%- if message['role'] == 'assistant' -%}
    {%- if message['content'] is string or message['content'][0]['type'] != 'audio' -%}
      {{- raise_exception("Assistant messages must contain audio content only!") -}}
    {%- endif -%}
    {{- '<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>' -}}
  {%- else -%}{{- text_of(message['content']) -}}
  {%- endif -%}
  {{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|audio_out_bos|>' -}}
{%- endif -%}"""

# A Llama 3 style chat template for the plain llama checkpoint.
LLAMA_CHAT_TEMPLATE = """{{- bos_token -}}
{%- for message in messages -%}
  {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}
  {%- if message['content'] is string -%}{{- message['content'] | trim -}}
  {%- else -%}
    {%- for item in message['content'] if item['type'] == 'text' -%}
      {{- item['text'] | trim -}}
    {%- endfor -%}
  {%- endif -%}
  {{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{%- endif -%}"""


def backbone_shape(size: str) -> dict[str, Any]:
    """Llama-3.2-3B's decoder (Higgs Audio v2's backbone) or a tiny one of the same kind."""
    if size == "full":
        return {
            "vocab_size": 128256,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 28,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "head_dim": 128,
        }
    return {
        "vocab_size": 384 + 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        # llama3 scaling that bites at this head_dim (the full size keeps the class defaults)
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }


def special_token_ids(vocab_size: int) -> dict[str, Any]:
    """The config's special token ids: the last 256 ids of the vocabulary are the special
    tokens, at the offsets above."""
    base = vocab_size - 256
    return {
        "bos_token_id": base + BOS,
        "pad_token_id": base + EOS_TEXT,
        "eos_token_id": base + EOT,
        "audio_bos_token_id": base + AUDIO_BOS,
        "audio_delay_token_id": base + DELAY,
        "audio_token_id": base + AUDIO_OUT,
    }


def write_tokenizer(out: Path, vocab_size: int, chat_template: str) -> Any:
    """A byte-level BPE of `vocab_size - 256` entries + Llama 3's 256 special tokens; saved with
    transformers (tokenizer.json, tokenizer_config.json, chat_template.jinja). Returns it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    base = vocab_size - 256
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=base,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([CORPUS] * 4, trainer=trainer)
    state = json.loads(bpe.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    for i in range(len(vocab), base):  # unreachable entries: no merge produces them
        vocab[f"<unused_{i}>"] = i
    state["model"]["vocab"] = vocab
    tok = Tokenizer.from_str(json.dumps(state))
    names = [SPECIAL_NAMES.get(j, f"<|reserved_special_token_{_reserved(j)}|>") for j in range(256)]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    bos = SPECIAL_NAMES[BOS]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, base + BOS)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=SPECIAL_NAMES[EOT],
        pad_token=SPECIAL_NAMES[EOS_TEXT],
    )
    fast.chat_template = chat_template
    fast.save_pretrained(out)
    return fast


def _reserved(offset: int) -> int:
    """Llama 3.1's numbering of the reserved special tokens at an offset."""
    return {2: 0, 3: 1, 5: 2}.get(offset, offset - 8)


def write_random_weights(
    model_class: Any,
    config: Any,
    out: Path,
    dtype: str,
    seed: int,
    draw_on: str = "cpu",
    adjust: Callable[[str, Any], None] | None = None,
) -> int:
    """Random tensors of the model's names and shapes into safetensors (sharded past 4 GiB).
    `draw_on` "cuda": drawn on the GPU (seconds instead of minutes for the full size; other
    values than the CPU's for the same seed). `adjust(name, tensor)` may change a drawn tensor
    in place before it is written."""
    import torch

    with torch.device("meta"):
        model = model_class(config)
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device=draw_on).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, meta in model.state_dict().items():
        if name.endswith("norm.weight") or "layernorm" in name:
            value = torch.ones(meta.shape, dtype=torch_dtype)
        elif meta.dim() == 2:
            std = 1.0 if "embed" in name else meta.shape[1] ** -0.5
            value = (
                torch.randn(meta.shape, generator=gen, device=draw_on)
                .mul_(std)
                .to(torch_dtype)
                .cpu()
            )
            if adjust is not None:
                adjust(name, value)
        else:
            value = torch.zeros(
                meta.shape, dtype=meta.dtype if not meta.is_floating_point() else torch_dtype
            )
        tensors[name] = value.contiguous()
    return save_sharded(tensors, out)


def save_sharded(tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], out: Path) -> int:
    """`tensors` into out/model.safetensors, or shards of at most 4 GiB + the index past that
    (the published layout). Streams: a shard is written as soon as it is full, so an iterable
    that draws its tensors lazily holds one shard in memory. Returns the bytes written."""
    from safetensors.torch import save_file

    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, Any] = {}
    size = total = 0

    def flush() -> None:
        path = out / f".shard-{len(written) + 1}.safetensors.partial"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard)))

    for name, value in items:
        nbytes = value.numel() * value.element_size()
        if size and size + nbytes > SHARD_BYTES:
            flush()
            shard, size = {}, 0
        shard[name] = value
        size += nbytes
        total += nbytes
    flush()
    if len(written) == 1:
        written[0][0].rename(out / "model.safetensors")
        return total
    weight_map = {}
    for i, (path, names) in enumerate(written, 1):
        file = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        path.rename(out / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def write_llama(
    out: Path, size: str, dtype: str = "float32", seed: int = 0, draw_on: str = "cpu"
) -> Path:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    shape = backbone_shape(size)
    if size == "full":  # Llama-3.2-1B's shape
        shape.update(
            hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )  # fmt: skip
    ids = special_token_ids(shape["vocab_size"])
    config = LlamaConfig(
        **shape, tie_word_embeddings=False, rms_norm_eps=1e-5,
        bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
    )  # fmt: skip
    config.save_pretrained(out)
    GenerationConfig(
        bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
    ).save_pretrained(out)  # fmt: skip
    write_random_weights(LlamaForCausalLM, config, out, dtype, seed, draw_on)
    write_tokenizer(out, shape["vocab_size"], LLAMA_CHAT_TEMPLATE)
    return out


def write_audio_tokenizer(out: Path, size: str, codebook_size: int, seed: int) -> Any:
    """HiggsAudioV2TokenizerModel with transformers' own random init: 8 quantizers at 25 frames a
    second of 24 kHz (hop 960), the published sub-models' sizes in `full`, small ones in `tiny`."""
    import torch
    from transformers import HiggsAudioV2TokenizerConfig, HiggsAudioV2TokenizerModel

    bits = (codebook_size - 1).bit_length()
    bandwidth = 8 * 25 * bits / 1000  # num_quantizers = 1000 * bandwidth // (25 * bits) = 8
    acoustic: dict[str, Any] = {
        "downsampling_ratios": [8, 5, 4, 2, 3],
        "upsampling_ratios": [8, 5, 4, 2, 3],
    }
    semantic: dict[str, Any] = {}
    if size == "tiny":
        acoustic.update(
            encoder_hidden_size=4, decoder_hidden_size=64, hidden_size=16
        )  # 64 >> 5 stages
        semantic.update(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            conv_dim=[8] * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        )  # fmt: skip
    config = HiggsAudioV2TokenizerConfig(
        target_bandwidths=[bandwidth / 4, bandwidth / 2, bandwidth],
        codebook_size=codebook_size,
        codebook_dim=64 if size == "full" else 8,
        acoustic_model_config=acoustic,
        semantic_model_config=semantic,
    )
    assert config.num_quantizers == 8 and config.frame_rate == 25, (
        config.num_quantizers,
        config.frame_rate,
    )
    torch.manual_seed(seed)
    model = HiggsAudioV2TokenizerModel(config)
    # transformers initializes the codebooks to zeros (a trained model fills them): every code
    # would decode alike and every clip encode to code 0. Unit-variance codebooks instead, so
    # audio depends on its codes and clips encode to varied codes.
    with torch.no_grad():
        for quantizer in model.quantizer.quantizers:
            quantizer.codebook.embed.normal_()
            quantizer.codebook.embed_avg.copy_(quantizer.codebook.embed)
            quantizer.codebook.cluster_size.fill_(1.0)
        _scale_decoder(model)
    model.save_pretrained(out)
    return model


def _scale_decoder(model: Any) -> None:
    """transformers' init (std 0.02) leaves the decoder's output almost the same whatever the
    codes (a test comparing audio would compare nothing). `1/sqrt(fan_in)` weights from the
    codes to the waveform instead, zero biases, and the last layer scaled so random codes decode
    to audio of RMS 0.1 (no clipping in 16-bit formats)."""
    import torch

    layers = [
        m
        for m in model.acoustic_decoder.modules()
        if isinstance(m, torch.nn.Conv1d | torch.nn.ConvTranspose1d)
    ]
    for projection in [model.fc2, *(q.project_out for q in model.quantizer.quantizers)]:
        projection.weight.normal_(0, projection.weight.shape[1] ** -0.5)
    for layer in layers:
        fan_in = layer.in_channels * layer.kernel_size[0]
        if isinstance(layer, torch.nn.ConvTranspose1d):
            fan_in //= layer.stride[0]
        layer.weight.normal_(0, fan_in**-0.5)
        if layer.bias is not None:
            layer.bias.zero_()
    codes = torch.randint(0, model.config.codebook_size, (1, model.config.num_quantizers, 50),
                          generator=torch.Generator().manual_seed(0))  # fmt: skip
    rms = model.decode(codes).audio_values.pow(2).mean().sqrt()
    layers[-1].weight.mul_(0.1 / float(rms))


def torchaudio_stand_in(
    folder: Path, resample_with_soxr: bool = False, resample_like_torchaudio: bool = False
) -> Path:
    """A stand-in `torchaudio` package under `folder` (returned: put it on PYTHONPATH), for a
    machine without a working torchaudio (this one: no wheel for torch 2.13), where transformers
    runs as the tests' reference: serving needs no torchaudio (our own tokenizer).

    transformers refuses to build `HiggsAudioV2TokenizerModel` without torchaudio, which it uses
    only to resample audio it *encodes* (reference voices, 24 kHz -> its semantic model's 16
    kHz). Writing random weights and decoding codes never call it; by default the stand-in's
    resample raises, so nothing can silently use it. `resample_with_soxr`: its resample is
    soxr's instead (a different filter than torchaudio's, so codes of a clip differ from
    those a real torchaudio gives). `resample_like_torchaudio`: its resample is
    omni_server.audio.higgs_tokenizer.resample, torchaudio's algorithm as the served tokenizer
    runs it (so a reference on this machine encodes a clip as the server does; that function
    against the real torchaudio: tools/device/higgs_tokenizer_check.py)."""
    package = folder / "torchaudio"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        '"""Stand-in (omni_bench.random_checkpoint): no audio I/O."""\n'
        "from . import functional\n__version__ = '2.11.0'\n"
    )
    if resample_like_torchaudio:
        (package / "functional.py").write_text(
            '"""Stand-in: torchaudio\'s resample algorithm, as our tokenizer runs it."""\n'
            "from omni_server.audio.higgs_tokenizer.resample import resample as _resample\n"
            "def resample(waveform, orig_freq, new_freq, **kwargs):\n"
            "    assert not kwargs, kwargs  # the defaults only\n"
            "    return _resample(waveform, int(orig_freq), int(new_freq))\n"
        )
    elif resample_with_soxr:
        (package / "functional.py").write_text(
            '"""Stand-in: resample with soxr, NOT torchaudio\'s sinc filter."""\n'
            "import numpy as np, soxr, torch\n"
            "def resample(waveform, orig_freq, new_freq, **kwargs):\n"
            "    x = waveform.detach().cpu().double().numpy()\n"
            "    rows = x.reshape(-1, x.shape[-1])\n"
            "    out = np.stack([soxr.resample(r, orig_freq, new_freq) for r in rows])\n"
            "    out = torch.from_numpy(out.reshape(*x.shape[:-1], out.shape[-1]))\n"
            "    return out.to(waveform.dtype).to(waveform.device)\n"
        )
    else:
        (package / "functional.py").write_text(
            "def resample(*args, **kwargs):\n"
            "    raise NotImplementedError('torchaudio stand-in: install torchaudio to encode "
            "audio')\n"
        )
    meta = folder / "torchaudio-2.11.0.dist-info"
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torchaudio\nVersion: 2.11.0\n")
    return folder


def has_torchaudio() -> bool:
    try:
        import torchaudio  # noqa: F401
    except (ImportError, OSError):  # OSError: a wheel built against another torch
        return False
    return True


def write_higgs_audio_v2(
    out: Path,
    size: str,
    dtype: str = "float32",
    seed: int = 0,
    draw_on: str = "cpu",
    audio_eos_scale: float = 1.0,
) -> Path:
    """The model folder at `out`, its audio tokenizer at out/audio_tokenizer. Without a working
    torchaudio the audio tokenizer and processor are written by a child process that sees the
    stand-in (torchaudio_stand_in). `audio_eos_scale` < 1: the end of audio rarer (the
    module's docstring)."""
    out = out.resolve()
    if not has_torchaudio():
        import os
        import subprocess
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(torchaudio_stand_in(Path(tmp))), *sys.path]
            )}  # fmt: skip
            args = [sys.executable, "-m", "omni_bench.random_checkpoint", "higgs-audio-v2",
                    "--size", size, "--out", str(out), "--dtype", dtype,
                    "--seed", str(seed), "--draw-on", draw_on,
                    "--audio-eos-scale", repr(audio_eos_scale)]  # fmt: skip
            subprocess.run(args, env=env, check=True, stdout=subprocess.DEVNULL)
        return out
    return _write_higgs_audio_v2(out, size, dtype, seed, draw_on, audio_eos_scale)


def _write_higgs_audio_v2(
    out: Path, size: str, dtype: str, seed: int, draw_on: str, audio_eos_scale: float
) -> Path:
    from transformers import (
        DacFeatureExtractor,
        GenerationConfig,
        HiggsAudioV2Config,
        HiggsAudioV2Processor,
        HiggsAudioV2TokenizerModel,
    )

    out.mkdir(parents=True, exist_ok=True)
    shape = backbone_shape(size)
    codes = 1024 if size == "full" else 128  # real codes a codebook; +2 for the stream BOS / EOS
    ids = special_token_ids(shape["vocab_size"])
    config = HiggsAudioV2Config(
        **shape, num_codebooks=8, codebook_size=codes + 2,
        audio_stream_bos_id=codes, audio_stream_eos_id=codes + 1, **ids,
    )  # fmt: skip
    config.save_pretrained(out)
    GenerationConfig(  # the published checkpoint's (its conversion sets these)
        bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"], ras_win_len=7, ras_win_max_num_repeat=2,
        use_text_head=True,
    ).save_pretrained(out)  # fmt: skip
    write_higgs_model_weights(config, out, dtype, seed, draw_on, audio_eos_scale)
    tokenizer = write_tokenizer(out, shape["vocab_size"], HIGGS_CHAT_TEMPLATE)
    audio_dir = out / "audio_tokenizer"
    write_audio_tokenizer(audio_dir, size, codes, seed)
    processor = HiggsAudioV2Processor(
        feature_extractor=DacFeatureExtractor(
            feature_size=1, hop_length=1, padding_side="right", padding_value=0.0,
            sampling_rate=24000, return_attention_mask=True,
        ),
        tokenizer=tokenizer,
        audio_tokenizer=HiggsAudioV2TokenizerModel.from_pretrained(audio_dir),
        chat_template=HIGGS_CHAT_TEMPLATE,
        audio_stream_bos_id=codes,
        audio_stream_eos_id=codes + 1,
    )  # fmt: skip
    processor.save_pretrained(out)
    return out


def write_higgs_model_weights(
    config: Any, out: Path, dtype: str, seed: int, draw_on: str, audio_eos_scale: float
) -> None:
    """The model's random weights (model.safetensors) for a `HiggsAudioV2Config`, the audio
    head's stream-EOS rows times `audio_eos_scale`."""
    from transformers import HiggsAudioV2ForConditionalGeneration

    def rarer_end(name: str, value: Any) -> None:
        if name == "audio_lm_head.weight":  # [K * C, hidden]: codebook k's logits at rows k*C..
            value[config.audio_stream_eos_id :: config.codebook_size] *= audio_eos_scale

    write_random_weights(
        HiggsAudioV2ForConditionalGeneration, config, out, dtype, seed, draw_on, rarer_end
    )


def redraw_higgs_audio_v2(
    folder: Path, seed: int, audio_eos_scale: float = 1.0, dtype: str = "float32"
) -> Path:
    """A written folder's model weights drawn anew for another seed, in this process (the model
    needs no torchaudio; its tokenizers and audio tokenizer stay as they are): tests that
    compare the model alone over several seeds without writing a whole folder for each."""
    from transformers import HiggsAudioV2Config

    write_higgs_model_weights(
        HiggsAudioV2Config.from_pretrained(folder), folder, dtype, seed, "cpu", audio_eos_scale
    )
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="omni-bench random-checkpoint",
        description="write a random-weight checkpoint folder that transformers and the engine load",
    )
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (created)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="weights' dtype (default: float32 tiny, bfloat16 full)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--draw-on",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the random values are drawn (cuda: fast for --size full; other values)",
    )
    parser.add_argument(
        "--audio-eos-scale",
        type=float,
        default=1.0,
        help="higgs-audio-v2: the audio head's stream-EOS rows times this (below 1: the end of "
        "audio rarer, greedy generations longer)",
    )
    args = parser.parse_args(argv)
    if args.audio_eos_scale != 1.0 and args.family != "higgs-audio-v2":
        parser.error("--audio-eos-scale is for higgs-audio-v2")
    dtype = args.dtype or ("float32" if args.size == "tiny" else "bfloat16")
    if args.family == "higgs-audio-v2":
        out = write_higgs_audio_v2(
            args.out, args.size, dtype, args.seed, args.draw_on, args.audio_eos_scale
        )
    elif args.family == "qwen3-omni":
        from omni_bench.random_qwen3_omni import write_qwen3_omni

        out = write_qwen3_omni(args.out, args.size, dtype, args.seed, args.draw_on)
    else:
        out = write_llama(args.out, args.size, dtype, args.seed, args.draw_on)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    print(
        f"wrote {args.family} ({args.size}, {dtype}) to {out}: "
        f"{len(files)} files, {total / 1e6:.1f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
