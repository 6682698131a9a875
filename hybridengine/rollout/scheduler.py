"""The rollout scheduler: which sequences prefill or decode next (pure Python, no tensors).

Continuous batching over a fixed number of cache slots: a step is either a prefill of waiting
sequences (FIFO, as many as there are free slots and prompt tokens within max_prefill_tokens;
samples of one prompt share its prefill, so its tokens count once), or one decode step of every
running sequence. Prefill goes first whenever a waiting sequence fits, which keeps the slots
full; a finished sequence frees its slot at once (`finish`), so long responses never hold a
batch back. Decode rows are sorted by slot: the flash decode kernel reads the cache at
increasing offsets.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridengine.rollout.kv_cache import SlotAllocator


@dataclass
class Sequence:
    """One sample of one prompt. seq_id indexes the results (prompt_index · n + sample_index)."""

    seq_id: int
    prompt_index: int
    prompt: list[int]
    max_gen: int            # tokens it may generate (max_tokens capped by the cache row)
    key: int                # random key of its samples (sampling.sequence_key)
    slot: int = -1
    num_cached: int = 0     # tokens with K/V in the cache, counted by the host (an upper bound
                            # after the sequence finished on the device, one step ago at most)


class Scheduler:
    """max_running: the most sequences that held a slot at once; num_waited: the sequences
    that found every slot taken when their turn came (0: the batch fit the cache at once)."""

    def __init__(self, allocator: SlotAllocator, max_prefill_tokens: int):
        self.allocator = allocator
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}          # slot -> sequence
        self._rows: list[Sequence] | None = None
        self.max_running = self.num_waited = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule_prefill(self) -> list[Sequence]:
        """Admit waiting sequences into free slots; [] when none fits (then decode)."""
        batch: list[Sequence] = []
        prompts: set[int] = set()
        num_tokens = 0
        while self.waiting and self.allocator.can_allocate():
            seq = self.waiting[0]
            cost = 0 if seq.prompt_index in prompts else len(seq.prompt)
            if batch and num_tokens + cost > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            seq.slot = self.allocator.allocate()
            seq.num_cached = len(seq.prompt)
            self.running[seq.slot] = seq
            batch.append(seq)
            prompts.add(seq.prompt_index)
            num_tokens += cost
        if batch:
            self._rows = None
            self.max_running = max(self.max_running, len(self.running))
        if self.waiting and not self.allocator.can_allocate():
            # every sequence is added before the first step, so those still waiting the first
            # time the slots run out are all that will wait
            self.num_waited = max(self.num_waited, len(self.waiting))
        return batch

    def decode_rows(self) -> list[Sequence]:
        """Running sequences in slot order (cached until the running set changes)."""
        if self._rows is None:
            self._rows = [self.running[s] for s in sorted(self.running)]
        return self._rows

    def finish(self, slot: int) -> Sequence:
        seq = self.running.pop(slot)
        self.allocator.free(slot)
        self._rows = None
        return seq
