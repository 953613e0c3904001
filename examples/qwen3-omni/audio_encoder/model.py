"""Audio encoder: the thinker's audio tower (models/qwen3_omni/audio_encoder.py) -> one
embedding per audio placeholder of the prompt.

A batch's clips, of every request in it, run through the tower in one call (its attention never
crosses clips, so a clip's embeddings are the same alone or batched); each request gets its
rows back. A request without audio passes through untouched.

In: the preprocessing payload. Out: {"chat", "prompt_ids", "audio_embeds" ([placeholders,
thinker hidden] float32 on the CPU, prompt order; None without audio)} to the thinker.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_server.backend import StageBackend, StageConfigError, StageContext
from omni_server.contracts import ChatInput
from omni_server.models.qwen3_omni.audio_encoder import AudioEncoder as AudioTower
from omni_server.models.qwen3_omni.audio_encoder import output_lengths
from omni_server.models.qwen3_omni.folder import CheckpointFolderError, checkpoint_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class AudioEncoder(StageBackend):
    def initialize(self, context: StageContext) -> None:
        name = context.parameters.get("dtype", "auto")
        if name == "auto":  # bf16 on a GPU, fp32 on the CPU (bf16 matmuls are slow there)
            name = "float32" if context.device == "cpu" else "bfloat16"
        if name not in DTYPES:
            raise StageConfigError(
                f"parameters.dtype must be auto, {', '.join(DTYPES)}; found {name!r}"
            )
        threads = context.parameters.get("intra_op_threads", 1)
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise StageConfigError(
                f"parameters.intra_op_threads must be an integer >= 1; found {threads!r}"
            )
        if context.device == "cpu":
            torch.set_num_threads(threads)
        try:
            folder = checkpoint_folder(context.repository_parameters)
            tower = AudioTower.from_checkpoint(folder, DTYPES[name])
        except (CheckpointFolderError, KeyError, ValueError) as err:
            raise StageConfigError(f"the audio tower: {err}") from err
        self.tower = tower.to(context.device)
        self.device = torch.device(context.device)
        self.n_window = tower.shape.n_window

    def execute(self, requests: list[Any]) -> list[dict[str, Any]]:
        heard = [r.inputs for r in requests if r.inputs["features"] is not None]
        embeds = iter(self.encode(heard)) if heard else iter(())
        out = []
        for request in requests:
            inputs = request.inputs
            audio = next(embeds) if inputs["features"] is not None else None
            out.append(
                {
                    ChatInput.KEY: inputs[ChatInput.KEY],
                    "prompt_ids": inputs["prompt_ids"],
                    "audio_embeds": audio,
                }
            )
        return out

    @torch.inference_mode()
    def encode(self, batch: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Every request's clips in one tower call -> each request's embeddings [n, hidden]."""
        features = torch.cat([inputs["features"] for inputs in batch], dim=1)
        lengths = [frames for inputs in batch for frames in inputs["frames"]]
        rows = self.tower(features.to(self.device), lengths).float().cpu()
        counts = output_lengths(torch.tensor(lengths), self.n_window)
        per_request = [int(counts[i : i + len(x["frames"])].sum()) for i, x in _starts(batch)]
        return list(rows.split(per_request))


def _starts(batch: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """Each request with the index of its first clip among the batch's clips."""
    out, start = [], 0
    for inputs in batch:
        out.append((start, inputs))
        start += len(inputs["frames"])
    return out
