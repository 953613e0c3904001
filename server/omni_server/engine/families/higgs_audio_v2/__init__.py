"""The Higgs Audio v2 family: its module (model.py), checkpoint names (checkpoint.py) and its
frame step (frames.py)."""
