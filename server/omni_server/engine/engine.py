"""The engine: add / abort / step, driven by one compute thread.

    engine = Engine.from_gguf(EngineConfig())           # or Engine.from_random(shape, config)
    engine.add(GenerationRequest("r1", ids, SamplingParams(temperature=0, max_tokens=64)))
    while engine.has_work():
        for event in engine.step(): ...                 # TokenEvent per request that advanced

`step()` is schedule -> run -> sample -> postprocess. Requests join (`add`) and leave (`abort`,
finishing) between steps. `clock` (time.monotonic unless a test injects one) dates a media
request's output for the playback-aware order (deadline_order.py). Not thread-safe by design:
the stage's scheduler loop calls all three from its one compute thread. `abort` frees the
request's KV blocks at once; its final event (finish_reason "abort") comes out of the next
`step()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from omni_server.engine import deadline_order, overlap
from omni_server.engine.batcher import Batcher, StepBatch
from omni_server.engine.config import EngineConfig, LlamaShape
from omni_server.engine.errors import ContextLengthExceeded
from omni_server.engine.head import StepModel
from omni_server.engine.kv_cache import KVCache
from omni_server.engine.loading import (
    ModelSource,
    RandomWeights,
    SharedWeights,
    load_model,
    open_model,
)
from omni_server.engine.parallel import SINGLE, TensorParallel
from omni_server.engine.runner import ModelRunner
from omni_server.engine.sampling import SamplingParams
from omni_server.engine.sequence import (
    FinishReason,
    GenerationRequest,
    Sequence,
    Status,
    TokenEvent,
)
from omni_server.engine.step_cost import StepCost, keys_per_token
from omni_server.engine.tokenizer import TextTokenizer
from omni_server.engine.workspace import plan_kv_cache


class Engine:
    def __init__(
        self,
        model: StepModel,
        config: EngineConfig,
        tokenizer: TextTokenizer | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.model = model
        self.shape = model.shape
        self.tokenizer = tokenizer
        device = next(model.parameters()).device
        self._device = device
        limit = config.max_seq_len or model.shape.max_position_embeddings
        # On a GPU with a memory fraction the budget sizes (or checks) the cache: workspace.py
        max_total_tokens, self.memory = plan_kv_cache(
            model, config, min(limit, model.shape.max_position_embeddings)
        )
        # TP ranks must schedule alike (same admissions, same preemptions): the group's
        # smallest cache, when the ranks' free memory sized theirs differently
        max_total_tokens = model.tp.smallest(max_total_tokens, device)
        self.cache = KVCache(  # tensor parallel: this rank's KV heads only
            model.local_shape, max_total_tokens, config.block_size, config.torch_dtype, device
        )
        # One request alone must always fit the cache, or preemption could never make progress.
        self.max_seq_len = min(
            limit, model.shape.max_position_embeddings, self.cache.capacity_tokens
        )
        device_type = device.type
        keys = config.attention_keys_per_token or keys_per_token(model.shape, device_type)
        beside = config.max_prefill_beside_decodes or (
            min(32, config.max_step_tokens) if device_type == "cpu" else config.max_step_tokens
        )
        self.batcher = Batcher(config, self.cache.allocator, StepCost(keys), beside)
        self.runner = ModelRunner(model, self.cache, config, self.max_seq_len)
        # what a step emits for a request and how it is sampled: the model's family's (head.py)
        self.head = model.head
        ready = getattr(self.head, "ready", None)  # optional (head.py): default, always ready
        if ready is not None:
            self.batcher.ready = ready
        if self.runner.graphs is not None:  # the draws after a decode graph: graphs too
            self.head.capture_draws(config.max_batch_size, device, None)
        self._sequences: dict[str, Sequence] = {}
        self._pending: list[TokenEvent] = []  # abort events, handed out by the next step()
        self._arrivals = 0
        # Decode steps launched before their tokens are read (overlap.py)
        self._overlap = overlap.enabled(
            config, self.runner.graphs is not None, self.head.argmax_is_draw, model.tp.size
        )
        self.runner.feeds_greedy = self._overlap
        self._readback = overlap.Readback(config.max_batch_size, device)
        self._in_flight: overlap.InFlight | None = None

    @classmethod
    def from_checkpoint(
        cls,
        path: Path | str,
        config: EngineConfig | None = None,
        tp: TensorParallel = SINGLE,
        weights: SharedWeights | None = None,
        prepared: Path | None = None,
    ) -> Engine:
        """A model as published: a Hugging Face checkpoint folder (config.json's `model_type`
        picks the family (families/), the safetensors its weights, its tokenizer.json
        and chat template the tokenizer; none without tokenizer.json) or a GGUF file (its
        `general.architecture` picks the family; the tokenizer from its header).

        CheckpointError (a ValueError naming the folder) when config.json is missing, the
        model_type unknown, or a weight's name or shape disagrees with the config; nothing is
        placed on the device before those checks pass. With `tp`, this rank keeps its slice
        of the weights (parallel.py; ValueError when tp.size does not divide the heads). With
        `weights` (a stage's `context.shared_weights`), the placed weights come through it: a
        sharing follower reads only the header and aliases its leader's tensors. With
        `prepared` (a stage's `context.prepared_dir`), a GGUF's placed weights are written
        there once and the processes after this one map them (prepared_gguf.py)."""
        config = config or EngineConfig()
        return cls._load(open_model(path, prepared, config, tp), config, tp, weights)

    @classmethod
    def from_gguf(
        cls,
        config: EngineConfig | None = None,
        path: Path | str | None = None,
        tp: TensorParallel = SINGLE,
        weights: SharedWeights | None = None,
        prepared: Path | None = None,
    ) -> Engine:
        """`from_checkpoint` of a GGUF file (default: the embedded SmolLM2-135M)."""
        config = config or EngineConfig()
        return cls._load(open_model(path, prepared, config, tp), config, tp, weights)

    @classmethod
    def from_random(
        cls,
        shape: LlamaShape,
        config: EngineConfig,
        seed: int = 0,
        tp: TensorParallel = SINGLE,
        weights: SharedWeights | None = None,
    ) -> Engine:
        """Random weights of a given shape, no tokenizer (token ids only): speed benchmarks.

        The weights are drawn on the engine's device (an 8B shape in seconds on a GPU), the same
        for every `tp` (each rank keeps its slice). `weights`: as in from_checkpoint."""
        return cls._load(RandomWeights(shape, seed), config, tp, weights)

    @classmethod
    def _load(
        cls,
        source: ModelSource,
        config: EngineConfig,
        tp: TensorParallel,
        weights: SharedWeights | None,
    ) -> Engine:
        """The one load path (loading.py) for every source."""
        tokenizer = source.tokenizer()
        return cls(load_model(source, config, tp, weights), config, tokenizer)

    # --- requests -------------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> None:
        """Queue a request. Raises ContextLengthExceeded if it can never fit (nothing is queued)."""
        if request.request_id in self._sequences:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError("the prompt has no tokens")
        vocab = self.shape.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if request.params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        self.head.check(request)
        deadline_order.check_playback_seconds(request.playback_seconds)
        asked = request.params.max_tokens
        if len(prompt) + (asked or 1) > self.max_seq_len:
            raise ContextLengthExceeded(len(prompt), asked, self.max_seq_len)
        max_tokens = asked if asked is not None else self.max_seq_len - len(prompt)
        seq = Sequence(request, max_tokens, self.tokenizer, self._arrivals)
        seq.state = self.head.start(request, seq.token_ids)
        self._arrivals += 1
        self._sequences[request.request_id] = seq
        self.batcher.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or already done."""
        self._settle_in_flight()
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return False
        self.batcher.finish(seq)
        seq.finish_reason = FinishReason.ABORT
        self._pending.append(seq.event([], ""))
        return True

    def finish(self, request_id: str) -> bool:
        """End a request now as its max_tokens would (finish_reason "length"), with the text
        it has (held-back stop-string lookahead included); its KV blocks are freed at once
        and its final event comes out of the next `step()`. False if unknown or done."""
        self._settle_in_flight()
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return False
        self.batcher.finish(seq)
        seq.finish_reason = FinishReason.LENGTH
        if seq.detokenizer is not None:
            seq.text += seq.detokenizer.flush()
        self._pending.append(seq.event([], seq.take_text(final=True)))
        return True

    def has_work(self) -> bool:
        return self.batcher.has_work() or bool(self._pending) or self._in_flight is not None

    @property
    def overlaps_decode(self) -> bool:
        """Decode steps go in flight ahead of their tokens (overlap.py)."""
        return self._overlap

    @property
    def step_in_flight(self) -> bool:
        """A launched step's tokens are still to be read (by the next step(), or an abort)."""
        return self._in_flight is not None

    @property
    def num_waiting(self) -> int:
        return len(self.batcher.waiting)

    @property
    def num_running(self) -> int:
        return len(self.batcher.running)

    # --- the step -------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        events, self._pending = self._pending, []
        # A step in flight (overlap.py): launch the next one ahead of its tokens if its batch
        # is the same rows; else read them first, and schedule as usual.
        flight, self._in_flight = self._in_flight, None
        if flight is not None and not overlap.can_launch_ahead(self.batcher, flight):
            events += self._settle(flight)
            flight = None
        media = self.batcher.plays_media()  # the same on every TP rank: so are the clock reads
        start = self._now() if media else 0.0
        batch = self.batcher.next_batch(start)
        if batch is None:
            return events
        logits, sampled, greedy = self.runner.run(batch)
        if self._overlap and overlap.goes_in_flight(batch, greedy, media):
            assert greedy is not None
            assert flight is None or all(
                a is b for a, b in zip(batch.decodes, flight.seqs, strict=True)
            ), "a step launched ahead has its predecessor's rows (the device feed is by row)"
            tokens = overlap.feed(greedy, self.head.draw(logits, sampled, greedy))
            self._in_flight = self._readback.launch(sampled, tokens)
            overlap.launched(batch)
            if flight is not None:  # the previous step's tokens, read while this one runs
                events += self._settle(flight)
            return events
        assert flight is None, "a step launched ahead always goes in flight"
        events += self._sample(batch, logits, sampled, greedy)
        if media:
            done = self._now()
            self.batcher.record_step(done - start, batch)
            for seq in sampled:  # each produced one step of media: its listener's lead
                if seq.playback is not None and seq.playback_seconds is not None:
                    seq.playback.produced(seq.playback_seconds, done)
        return events

    def _settle(self, flight: overlap.InFlight) -> list[TokenEvent]:
        """Read a step's tokens and do their bookkeeping (the synchronous step's, per row). A
        row whose request finished meanwhile (stopped a step earlier, aborted) is dropped."""
        events: list[TokenEvent] = []
        for seq, token in zip(flight.seqs, flight.read(), strict=True):
            if seq.status is Status.FINISHED:
                continue
            ahead = overlap.take_pending(seq) - 1  # steps launched after this one: 0 or 1
            events.append(self._append(seq, token))
            if seq.finish_reason is None:
                seq.token_ids.extend([overlap.PENDING] * ahead)
        return events

    def _settle_in_flight(self) -> None:
        """Settle the step in flight now (its events come out of the next step())."""
        if self._in_flight is not None:
            flight, self._in_flight = self._in_flight, None
            self._pending += self._settle(flight)

    def _now(self) -> float:
        """The clock, rank 0's on every TP rank (their batches must not differ)."""
        return self.model.tp.first(self.clock(), self._device)

    def _sample(
        self,
        batch: StepBatch,
        logits: torch.Tensor,
        sampled: list[Sequence],
        greedy: torch.Tensor | None,  # [R] each row's argmax, where the decode graph took it
    ) -> list[TokenEvent]:
        draws = self.head.sample(logits, sampled, greedy)
        self._advance(batch)
        return [self._append(seq, draw) for seq, draw in zip(sampled, draws, strict=True)]

    def _advance(self, batch: StepBatch) -> None:
        for seq in batch.decodes:
            seq.num_computed += 1
        for work in batch.prefills:
            work.seq.num_computed += work.length

    def _append(self, seq: Sequence, draw: object) -> TokenEvent:
        """Record a request's draw (its head's bookkeeping); a request that ends leaves the
        batcher, its KV blocks freed at once."""
        event = self.head.append(seq, draw)
        if seq.finish_reason is not None:
            self.batcher.finish(seq)
            del self._sequences[seq.request_id]
        return event

    # --- convenience ------------------------------------------------------------------------

    def generate(self, requests: Iterable[GenerationRequest]) -> dict[str, list[TokenEvent]]:
        """Run `requests` to completion (tests, benchmarks); events per request id."""
        out: dict[str, list[TokenEvent]] = {}
        for request in requests:
            self.add(request)
            out[request.request_id] = []
        while self.has_work():
            for event in self.step():
                out.setdefault(event.request_id, []).append(event)
        return out

    def warmup(self, capture_all_graphs: bool = True) -> None:
        """One short request through prefill and decode (allocations, kernels, graphs).

        With `capture_all_graphs`, every decode-graph bucket is captured now instead of on its
        first use (no capture pause while serving), and so is each bucket of the head's draw.
        """
        self.generate([GenerationRequest("__warmup__", [0, 1, 2], _warmup_params())])
        if capture_all_graphs and self.runner.graphs is not None:
            self.runner.graphs.capture_all()
            width = next(iter(self.runner.graphs.graphs.values())).logits.shape[-1]
            self.head.capture_draws(self.config.max_batch_size, self._device, width)

    def capture_graphs(self, context_tokens: int) -> list[int]:
        """Capture the decode graphs of every batch bucket at the context buckets up to
        `context_tokens` now, not on first use while serving: a capture pauses every running
        request, so a first wave of c requests would otherwise meet its bucket uncaptured
        (seconds of first-token time, docs/models.md). Unlike `warmup`'s capture_all, the
        contexts a stage's requests reach, not every bucket up to max_seq_len. Returns the
        contexts captured ([] without graphs)."""
        graphs = self.runner.graphs
        if graphs is None or context_tokens <= 0:
            return []
        smallest = graphs.context_buckets[0]
        lengths = [n for n in graphs.context_buckets if n <= max(context_tokens, smallest)]
        for length in lengths:
            for b in graphs.batch_buckets:
                graphs.graph_for(b, length)
        return lengths


def _warmup_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
