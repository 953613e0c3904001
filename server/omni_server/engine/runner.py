"""Turns a scheduled batch into tensors, runs the model and returns the logits of the tokens to
sample, one row per sampling request in batch order.

Three ways a step runs: eagerly (the CPU, or no graphs); its decode rows through a captured
CUDA graph (cuda_graphs.py); or, a step of decodes and prefill chunks, split: the decode rows'
graph replayed and the chunks eager beside it, so a prompt never turns running streams eager."""

from __future__ import annotations

import torch

from omni_server.engine.attention import DecodeGroup, ForwardBatch, PrefillChunk
from omni_server.engine.batcher import StepBatch
from omni_server.engine.config import EngineConfig
from omni_server.engine.cuda_graphs import DecodeGraphs
from omni_server.engine.head import StepModel
from omni_server.engine.kv_cache import KVCache, blocks_for
from omni_server.engine.paged_decode import use_paged
from omni_server.engine.sampling import greedy_tokens
from omni_server.engine.sequence import Sequence


class ModelRunner:
    def __init__(
        self, model: StepModel, cache: KVCache, config: EngineConfig, max_seq_len: int
    ) -> None:
        self.model = model
        self.head = model.head
        self.cache = cache
        self.device = next(model.parameters()).device
        self.forward = model.forward
        self.paged = use_paged(config.decode_attention, self.device)
        compiled = torch.compile(model.forward, dynamic=True) if config.compile else None
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graphs and self.device.type == "cuda":
            # Compiled code only inside the graphs: fixed shapes per bucket, one compile each;
            # prefill chunks (varying chunk lists) stay eager.
            self.graphs = DecodeGraphs(
                model, cache, config.max_batch_size, max_seq_len, self.paged, forward=compiled
            )
        elif compiled is not None:
            self.forward = compiled
        # Set by the engine when steps go in flight (overlap.py): an eager decode-only step then
        # returns its argmax too, and the next one takes its PENDING ids from it (the graphs
        # keep their own device feed)
        self.feeds_greedy = False
        self._feed: torch.Tensor | None = None
        # A step of decodes and prefill chunks: the decodes through their graph and the chunks
        # eagerly beside it (True), or every row eagerly in one forward (False: the old mixed
        # step, which omni-bench gpu-step --mode mixed measures against)
        self.split_mixed = True

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> tuple[torch.Tensor, list[Sequence], torch.Tensor | None]:
        """Logits [R, V] float32, the R requests they belong to (those that sample now: the
        decodes, then each prompt this step completes), and each row's greedy token [R] int64
        where a decode graph computed it (else None)."""
        decodes = batch.decodes
        if self.graphs is None or not decodes or (batch.prefills and not self.split_mixed):
            return self._eager(batch)
        # The decode rows replay their graph; a step's prefill chunks run eagerly beside it
        # (the split launch): the graph is launched first, so the GPU runs it while the host
        # launches the chunks' kernels. Requests of the two halves differ, so their K/V writes
        # go to disjoint slots and neither half reads what the other writes this step.
        out = self.graphs.run(*self.decode_rows(decodes), decodes)
        if not batch.prefills:
            return out.logits, list(decodes), out.greedy
        chunk_logits, prompts, _ = self._eager(StepBatch([], batch.prefills))
        if not prompts:  # no chunk completes its prompt: only the decodes sample
            return out.logits, list(decodes), out.greedy
        # Rows in batch order, decodes first (the graph's output is its static buffer: cat
        # copies it, so the next replay cannot overwrite what this step samples)
        logits = torch.cat([out.logits, chunk_logits])
        greedy = None
        if out.greedy is not None:
            greedy = torch.cat([out.greedy, greedy_tokens(chunk_logits)])
        return logits, [*decodes, *prompts], greedy

    def decode_rows(
        self, decodes: list[Sequence]
    ) -> tuple[list[int], list[int], list[int], list[list[int]], list[int]]:
        """The decode rows' token ids, positions, cache slots, block tables and context
        lengths (the arguments of DecodeGraphs.run), in batch order."""
        positions = [seq.num_computed for seq in decodes]
        ids = [seq.token_ids[pos] for seq, pos in zip(decodes, positions, strict=True)]
        context = [pos + 1 for pos in positions]
        tables = [seq.block_table for seq in decodes]
        slot_of = self.cache.slot_of
        slot_mapping = [slot_of(t, pos) for t, pos in zip(tables, positions, strict=True)]
        return ids, positions, slot_mapping, tables, context

    def _eager(self, batch: StepBatch) -> tuple[torch.Tensor, list[Sequence], torch.Tensor | None]:
        """`run` for a step without a graph: every row of `batch` in one eager forward."""
        decodes = batch.decodes
        ids, positions, slot_mapping, tables, context = self.decode_rows(decodes)
        sampled: list[Sequence] = list(decodes)
        logits_indices = list(range(len(decodes)))
        chunks: list[PrefillChunk] = []
        for work in batch.prefills:
            start, n = work.start, work.length
            table_slots = self.cache.slot_matrix([work.seq.block_table], start + n)[0]
            first = len(ids)
            ids.extend(work.seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slot_mapping.extend(table_slots[start:].tolist())
            chunks.append(PrefillChunk(first, n, table_slots.to(self.device)))
            if work.completes_prompt:
                sampled.append(work.seq)
                logits_indices.append(first + n - 1)

        dev = self.device
        decode = self._decode_group(tables, context) if decodes else None
        fwd = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            decode=decode,
            prefills=chunks,
            family_inputs=self.head.step_inputs(batch, dev),
        )
        if not (self.feeds_greedy and not batch.prefills):
            return self.forward(fwd, self.cache.k, self.cache.v), sampled, None
        if self._feed is not None and len(self._feed) == len(ids):  # PENDING (< 0): the feed
            fwd.input_ids = torch.where(fwd.input_ids < 0, self._feed, fwd.input_ids)
        logits = self.forward(fwd, self.cache.k, self.cache.v)
        self._feed = greedy_tokens(logits)
        return logits, sampled, self._feed

    def _decode_group(self, tables: list[list[int]], context: list[int]) -> DecodeGroup:
        """The decode rows' attention inputs: block tables for the paged kernel; on the CPU one
        request whose blocks are consecutive (the allocator hands a lone request 1, 2, 3, ...)
        as its span of slots; else the gathered slots of each context padded to the longest,
        with its mask."""
        dev, length = self.device, max(context)
        if self.paged:
            width = blocks_for(length, self.cache.block_size)
            table = self.cache.block_matrix(tables, width).to(dev)
            lens = torch.tensor(context, dtype=torch.int32).to(dev)
            return DecodeGroup(len(tables), block_tables=table, context_lens=lens,
                               block_size=self.cache.block_size)  # fmt: skip
        if len(tables) == 1 and self.device.type == "cpu":
            span = self.cache.slot_span(tables[0], length)
            if span is not None:  # one run of slots: attention reads the cache in place
                return DecodeGroup(1, kv_span=span)
        kv_slots = self.cache.slot_matrix(tables, length)
        mask = torch.arange(length).unsqueeze(0) < torch.tensor(context).unsqueeze(1)
        return DecodeGroup(len(tables), kv_slots.to(dev), mask[:, None, None, :].to(dev))
