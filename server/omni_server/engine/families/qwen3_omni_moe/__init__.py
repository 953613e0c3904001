"""The qwen3_omni_moe family: Qwen3-Omni's thinker (text in, text out) on the engine: its
module (model.py) and its checkpoint names (checkpoint.py)."""
