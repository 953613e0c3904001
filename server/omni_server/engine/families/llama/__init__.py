"""The llama family: its module (model.py), transformers checkpoint names (checkpoint.py) and
the GGUF reader (gguf.py)."""
