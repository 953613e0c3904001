"""The autoregressive engine: a KV cache allocated once, continuous batching, per-request
sampling, CUDA graphs on GPU. Model-agnostic at its seams (a model is a module whose forward takes
a ForwardBatch and the cache); Llama is the model it ships. See docs/engine.md.

One compute thread drives it:

    engine = Engine.from_gguf(EngineConfig(max_total_tokens=8192))
    engine.add(GenerationRequest("r1", engine.tokenizer.encode_chat(messages), SamplingParams()))
    while engine.has_work():
        for event in engine.step(): ...   # TokenEvent(request_id, token_ids, text, finished, ...)

This package's exports are its public API (the modules inside may change): besides the above,
`SHAPES` (the named Llama shapes for random-weight runs), `TensorParallel` (a rank's place in
its tensor-parallel group, handed to `Engine.from_random(..., tp=)`) and `MemoryBudgetError`
(a GPU memory fraction the engine cannot honour).
"""

from omni_server.engine.config import LLAMA_1B, SHAPES, SMOLLM2_135M, EngineConfig, LlamaShape
from omni_server.engine.engine import Engine
from omni_server.engine.errors import ContextLengthExceeded
from omni_server.engine.gguf_weights import load_gguf, smollm2_gguf_path
from omni_server.engine.memory import MemoryBudgetError
from omni_server.engine.parallel import TensorParallel
from omni_server.engine.sampling import SamplingParams
from omni_server.engine.sequence import FinishReason, GenerationRequest, TokenEvent
from omni_server.engine.tokenizer import ChatTemplateError, GGUFTokenizer, IncrementalDetokenizer

__all__ = [
    "LLAMA_1B",
    "SHAPES",
    "SMOLLM2_135M",
    "ChatTemplateError",
    "ContextLengthExceeded",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "GGUFTokenizer",
    "GenerationRequest",
    "IncrementalDetokenizer",
    "LlamaShape",
    "MemoryBudgetError",
    "SamplingParams",
    "TensorParallel",
    "TokenEvent",
    "load_gguf",
    "smollm2_gguf_path",
]
