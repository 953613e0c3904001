"""The autoregressive engine: a KV cache allocated once, continuous batching, per-request
sampling, CUDA graphs on GPU. Model-agnostic: a model family (engine/families, one folder each)
builds the module and says what its step emits (`engine.head`, head.py: a text token, a frame of
codes); the step, runner and graphs name no family. See docs/engine.md.

One compute thread drives it:

    engine = Engine.from_gguf(EngineConfig(max_total_tokens=8192))
    engine.add(GenerationRequest("r1", engine.tokenizer.encode_chat(messages), SamplingParams()))
    while engine.has_work():
        for event in engine.step(): ...   # TokenEvent(request_id, token_ids, text, finished, ...)

Every model loads through one path (loading.py): `Engine.from_checkpoint(path, config)` takes a
Hugging Face checkpoint folder (config.json's `model_type` picks the family: llama,
higgs_audio_v2) or a GGUF file (its `general.architecture` does); `from_gguf` defaults to the
embedded SmolLM2; `from_random` draws a Llama's weights. A folder it cannot load raises
`CheckpointError` (a ValueError naming the folder). An audio-frame model (`engine.model.audio`,
an `AudioSpec`) emits one frame of codes a step in `TokenEvent.audio_frames`.

This package's exports are its public API (the modules inside may change): besides the above,
`SHAPES` (the named Llama shapes for random-weight runs), `TensorParallel` (a rank's place in
its tensor-parallel group, handed to `Engine.from_random(..., tp=)`) and `MemoryBudgetError`
(a GPU memory fraction the engine cannot honour); for benchmarks that build a reference step
beside the engine's, the model `Llama`, its `apply_rope`, and `bucket_for` (the CUDA graph
batch bucket a batch size replays).
"""

from omni_server.engine.config import (
    LLAMA_1B,
    LLAMA_3B,
    SHAPES,
    SMOLLM2_135M,
    EngineConfig,
    LlamaShape,
)
from omni_server.engine.cuda_graphs import bucket_for
from omni_server.engine.engine import Engine
from omni_server.engine.errors import CheckpointError, ContextLengthExceeded
from omni_server.engine.families.higgs_audio_v2.frames import AudioSpec
from omni_server.engine.families.llama.gguf import load_gguf, smollm2_gguf_path
from omni_server.engine.families.llama.model import Llama
from omni_server.engine.hf_tokenizer import HFTokenizer
from omni_server.engine.kernels import apply_rope
from omni_server.engine.memory import MemoryBudgetError
from omni_server.engine.parallel import TensorParallel
from omni_server.engine.sampling import SamplingParams
from omni_server.engine.sequence import (
    FinishReason,
    GenerationRequest,
    PromptEmbeddings,
    TokenEvent,
)
from omni_server.engine.tokenizer import ChatTemplateError, GGUFTokenizer, IncrementalDetokenizer

__all__ = [
    "LLAMA_1B",
    "LLAMA_3B",
    "SHAPES",
    "SMOLLM2_135M",
    "AudioSpec",
    "ChatTemplateError",
    "CheckpointError",
    "ContextLengthExceeded",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "GGUFTokenizer",
    "GenerationRequest",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Llama",
    "LlamaShape",
    "MemoryBudgetError",
    "PromptEmbeddings",
    "SamplingParams",
    "TensorParallel",
    "TokenEvent",
    "apply_rope",
    "bucket_for",
    "load_gguf",
    "smollm2_gguf_path",
]
