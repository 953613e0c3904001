"""One step's work: the decodes and prefill chunks the batcher chose for the next forward."""

from __future__ import annotations

from dataclasses import dataclass

from omni_server.engine.sequence import Sequence


@dataclass
class PrefillWork:
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed)
    length: int

    @property
    def completes_prompt(self) -> bool:
        """After this chunk every token is computed: sample the next one."""
        return self.start + self.length == self.seq.num_tokens


@dataclass
class StepBatch:
    decodes: list[Sequence]  # one token each, at position seq.num_computed
    prefills: list[PrefillWork]

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(p.length for p in self.prefills)
