"""Qwen3-Omni's talker decoder on the engine: the thinker's module (QK-norm attention, the
routed experts; SparseMoE adds the talker's shared expert and its sigmoid gate) over given
input embeddings, every row's (a talker position is never a token id's embedding: the prompt
is the projected conversation plus codec embeddings, a frame's input is its G code embeddings
plus the text it hears; head.py builds them). Its forward returns, a sampled row, the codec
logits [V] and the final normed hidden state [C] side by side ([R, V + C] float32): code 0
comes from the first, the code predictor starts from the second.

The talker's rotary is multimodal, but every talker position carries the same position on all
three axes (transformers' talker positions are the prompt's, then one more a frame), which is
the plain rotary the engine's RoPE table holds (as for the thinker, qwen3_omni_moe/model.py).

Beside the decoder the module carries what the head and the stage need of the checkpoint: the
code predictor (models/qwen3_omni/talker.py, plain torch: its KV is per frame, G positions),
the text and hidden projections (the thinker's width -> the talker's), and the thinker's input
embedding table (the talker hears the thinker's tokens through it).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from omni_server.engine.attention import ForwardBatch
from omni_server.engine.config import LlamaShape
from omni_server.engine.families.qwen3_omni_moe.model import Qwen3OmniThinker
from omni_server.engine.families.qwen3_omni_talker.head import TalkerHead, TalkerRows
from omni_server.engine.parallel import SINGLE, TensorParallel
from omni_server.models.qwen3_omni.config import Qwen3OmniConfig
from omni_server.models.qwen3_omni.layers import inverse_frequencies
from omni_server.models.qwen3_omni.talker import CodePredictor, Projection


class Qwen3OmniTalker(Qwen3OmniThinker):
    def __init__(
        self,
        shape: LlamaShape,
        config: Qwen3OmniConfig,
        max_positions: int,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(shape, config.talker, max_positions, tp)
        self.config = config
        thinker = config.thinker
        projection = (config.thinker_hidden_size, config.talker.intermediate_size,
                      shape.hidden_size)  # fmt: skip
        self.text_projection = Projection(*projection)
        self.hidden_projection = Projection(*projection)
        self.text_embed = nn.Embedding(thinker.vocab_size, config.thinker_hidden_size)
        self.code_predictor = CodePredictor(
            config.code_predictor, config.talker_ids.num_code_groups
        )
        for p in self.parameters():
            p.requires_grad_(False)
        self.head = TalkerHead(self)

    @property
    def codec_embedding(self) -> nn.Embedding:
        """The codec ids' input embedding (code 0 of a frame, the prompt's codec side)."""
        return self.embed

    def forward(
        self,
        batch: ForwardBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:  # [R, V + C] float32: codec logits, then the normed hidden state
        given = batch.family_inputs
        assert isinstance(given, TalkerRows), "every talker row's input is given (head.py)"
        h = given.values.to(self.embed.weight.dtype)  # [T, C]
        rope = self.rope_rows(batch.positions)
        h = self.final_hidden(h, rope, batch, k_caches, v_caches)  # [R, C]
        assert self.lm_head is not None
        logits = self.kernels.linear(h, self.lm_head.weight, torch.float32)
        return torch.cat([logits, h.float()], dim=-1)

    def place(
        self, device: torch.device | str, dtype: torch.dtype, cpu_weight_order: str = "rows"
    ) -> Qwen3OmniTalker:
        super().place(device, dtype, cpu_weight_order)
        self._predictor_rotary(device)
        return self

    def adopt(
        self, weights: Mapping[str, torch.Tensor], device: torch.device | str
    ) -> Qwen3OmniTalker:
        super().adopt(weights, device)
        self._predictor_rotary(device)
        return self

    def _predictor_rotary(self, device: torch.device | str) -> None:
        # place() moves parameters only, and the buffer was built on the meta device
        decoder = self.code_predictor.model
        shape = decoder.shape
        decoder.inv_freq = inverse_frequencies(shape.head_dim, shape.rope_theta).to(device)

    @torch.no_grad()
    def hear(self, token_ids: list[int]) -> torch.Tensor:
        """Thinker tokens as the talker hears them [n, C] (text_projection of their input
        embeddings)."""
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.embed.weight.device)
        out: torch.Tensor = self.text_projection(self.text_embed(ids))
        return out

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """The thinker's engine names (embed: the codec embedding, lm_head: the codec head),
        per sparse layer shared_gate / shared_w_gate / shared_w_up / shared_w_down, and the
        extras under their module names (`code_predictor.*`, `text_projection.*`,
        `hidden_projection.*`, `text_embed.weight`)."""
        super().load_weights(weights)
        put = self.weight_copier()
        with torch.no_grad():
            for i in range(self.shape.num_layers):
                if not self.moe.is_moe(i) or not self.moe.shared_expert_size:
                    continue
                w, m = f"layers.{i}.", f"layers.{i}.mlp.moe."
                put(m + "shared_expert_gate.weight", weights[w + "shared_gate"])
                put(m + "shared_expert.gate_proj.weight", weights[w + "shared_w_gate"])
                put(m + "shared_expert.up_proj.weight", weights[w + "shared_w_up"])
                put(m + "shared_expert.down_proj.weight", weights[w + "shared_w_down"])
            for prefix in ("code_predictor.", "text_projection.", "hidden_projection."):
                for name, _ in self.named_parameters():
                    if name.startswith(prefix):
                        put(name, weights[name])
            put("text_embed.weight", weights["text_embed.weight"])
