"""The qwen3_omni_talker family: Qwen3-Omni's talker on the engine (its module, model.py; its
checkpoint names, checkpoint.py; its head, head.py: a frame of G codes a step, code 0 by the
talker, the rest by the code predictor, the next input the frame's embeddings plus the text it
hears). A Qwen3-Omni checkpoint's config.json names `qwen3_omni_moe` (the thinker's family):
this one is opened by name, `open_talker(folder)`."""
