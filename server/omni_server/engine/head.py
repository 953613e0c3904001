"""The seam between the engine's step and a model family: what one step emits for a request.

The engine's step (engine.py), runner, decode graphs and workspace probe are the same for every
family: a flat batch of token rows through `model.forward`, one row of logits per request that
samples. What those logits mean is the family's: a text token (token_head.py), a frame of codes
(families/higgs_audio_v2/head.py), later hidden states for another stage. The family's model
carries that answer as `model.head`, a `Head`; the engine calls it at five points of a request's
life and nowhere else:

    add        check(request); start(request, token_ids) -> the request's own state (seq.state)
    run        step_inputs(batch) -> ForwardBatch.family_inputs (eager steps)
               graph_inputs(rows) once per captured graph, fill_graph_inputs(...) every replay
    sample     sample(logits, seqs, greedy) -> one draw a row (the step's output);
               draw(logits, seqs, greedy): the same left on the device (a step in flight)
    record     append(seq, draw) -> the TokenEvent (the token appended, the finish decided)
    size       profile_inputs / profile_sample: the heaviest step, for the KV budget
    graphs     capture_draws(max_rows, device, width): draws replayed from CUDA graphs

A head may also define `ready(seq) -> bool` (optional; without it every row is ready): a
running request whose next decode row's input is not in yet (a talker awaiting the thinker's
next text) sits the step out, keeping its KV blocks, and a waiting one (preempted: its recompute
ends on that row) is not admitted yet (batcher.py). A head that needs no inputs besides
token ids returns None from the input methods. Whatever a head keeps per request lives in
`seq.state` and survives preemption (a recomputed prompt never re-derives it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from omni_server.engine.attention import ForwardBatch
    from omni_server.engine.config import LlamaShape
    from omni_server.engine.parallel import TensorParallel
    from omni_server.engine.sequence import GenerationRequest, Sequence, TokenEvent
    from omni_server.engine.step_batch import StepBatch

Draw = TypeVar("Draw")


class Head(Protocol[Draw]):
    """What one step of a model emits for each request it samples, and how it is drawn.

    Invariants: `sample` returns one draw per row of `logits`, in row order; `append` appends
    exactly one token to `seq.token_ids` (the next position the model embeds) and sets
    `seq.finish_reason` when the request ends; it never touches the batcher or the cache."""

    # The greedy draw is each logits row's argmax (a text token): a decode graph computes it in
    # the graph, feeds it to the next step on the device, and greedy steps may go in flight
    # (overlap.py). False: the decode graph returns logits only, every step is synchronous.
    argmax_is_draw: bool

    def check(self, request: GenerationRequest) -> None:
        """ValueError saying why this output cannot serve `request` (nothing is queued)."""
        ...

    def start(self, request: GenerationRequest, token_ids: list[int]) -> Any:
        """The request's own state (Sequence.state), None where the head keeps none."""
        ...

    def step_inputs(self, batch: StepBatch, device: torch.device) -> Any:
        """The model's inputs besides token ids for an eager step (ForwardBatch.family_inputs),
        rows in the batch's flat order (decodes, then each chunk); None: token ids only."""
        ...

    def graph_inputs(self, rows: int, device: torch.device) -> Any:
        """Static input buffers of a decode graph of `rows` rows (None: token ids only)."""
        ...

    def fill_graph_inputs(self, static: Any, decodes: list[Sequence]) -> None:
        """Copy the decode rows' inputs into a graph's static buffers (rows past them padded)."""
        ...

    def profile_inputs(self, decodes: int, rows: int, device: torch.device) -> Any:
        """The inputs of the heaviest step of `decodes` decode rows then prompt rows, `rows` in
        all (workspace.py measures it); None: token ids only."""
        ...

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None
    ) -> list[Draw]:
        """One draw per row of `logits` [R, ...] (the requests `seqs`, in order). `greedy` [R]:
        each row's argmax, where a decode graph computed it (argmax_is_draw heads only)."""
        ...

    def draw(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None
    ) -> torch.Tensor:
        """`sample`'s draws as a device tensor [R, ...], not read back (no sync): what a step in
        flight feeds its successor and copies out behind it (overlap.py)."""
        ...

    def capture_draws(self, max_rows: int, device: torch.device, width: int | None) -> None:
        """From now on draw rows of up to `max_rows` from CUDA graphs (draw_graphs.py) on
        `device` (the engine asks where its decode steps replay graphs). `width`: the logits'
        width, to capture every rows bucket of the served variants now (the engine's warm-up:
        no capture while serving, when another thread of the process may use the GPU); None:
        each on first use."""
        ...

    def profile_sample(self, logits: torch.Tensor) -> None:
        """Sample every row with the costliest settings (workspace.py measures the peak)."""
        ...

    def append(self, seq: Sequence, draw: Draw) -> TokenEvent:
        """Record one draw: append its token, decide the finish, return the event."""
        ...


class StepModel(Protocol):
    """What the engine's generic parts read of a family's module: a decoder over a flat batch
    of token rows and a paged KV cache, whose forward returns the logits `head` samples."""

    shape: LlamaShape  # the whole model's: vocabulary, context, layers
    local_shape: LlamaShape  # this rank's share of the heads: what its KV cache holds
    tp: TensorParallel
    head: Head[Any]

    def forward(
        self, batch: ForwardBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
    ) -> torch.Tensor:  # [R, ...] float32 logits of batch.logits_indices
        ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...
