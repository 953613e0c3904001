"""Higgs Audio v2's audio tokenizer in plain torch (24 kHz audio <-> 8 codes a frame, 25 frames
a second), loaded from the folder transformers saves (`config.json` + `model.safetensors`,
`model_type = "higgs_audio_v2_tokenizer"`); serving needs neither transformers nor torchaudio.
transformers' `HiggsAudioV2TokenizerModel` is the oracle (tests/audio/test_higgs_tokenizer.py).

config     config.json -> TokenizerConfig (transformers' defaults for what the file leaves out)
acoustic   the DAC encoder and Higgs' DAC decoder
semantic   HuBERT and the semantic conv stack of the encoder
resample   the 24 -> 16 kHz windowed-sinc resampling in front of HuBERT (torchaudio's algorithm)
model      HiggsAudioTokenizer: encode (RVQ) and decode (a folded table, then the decoder)
weights    load(folder, device): the safetensors in, weight norm folded, names checked
"""

from omni_server.audio.higgs_tokenizer.config import (
    TokenizerConfig,
    TokenizerFolderError,
    read_config,
)
from omni_server.audio.higgs_tokenizer.model import HiggsAudioTokenizer
from omni_server.audio.higgs_tokenizer.weights import load

__all__ = ["HiggsAudioTokenizer", "TokenizerConfig", "TokenizerFolderError", "load", "read_config"]
