"""Qwen3-Omni (`model_type` qwen3_omni_moe) in plain torch, read from its published folder.

    thinker.py        the thinker's MoE text decoder (QK-norm, multimodal rotary, top-k experts)
    audio_encoder.py  the thinker's audio tower (conv downsampling + windowed transformer)
    mel.py            the 128-bin log-mel features at 16 kHz the audio tower reads
    talker.py         the talker (MoE decoder over codec frames) and its code predictor
    talker_input.py   the talker's prompt (from the whole run, or from a TalkerOpening)
    talker_batch.py   many speeches' talker steps at once (seeded sampling, waits for text)
    code2wav.py       the codec decoder: frames of codes -> 24 kHz audio
    layers.py         the pieces they share (RMSNorm, rotary, attention with a KV cache, MoE)
    handoff.py        what the thinker stage streams to the talker stage (typed)
    config.py         config.json -> the shapes and token ids these modules need
    weights.py        the safetensors files, by published tensor name

Each module is checked against transformers' `Qwen3OmniMoeForConditionalGeneration` on tiny
random checkpoints (tests/models/qwen3_omni/).
"""
