"""The paged layout's scheduler: which sequences prefill or decode next, admitted by free KV
blocks (block_manager.BlockTables) rather than by cache rows (pure Python, no tensors).

Rows and blocks are separate. A row indexes the runner's per-sequence state (SlotState: last
token, position, counters, key, outputs so far; `Sequence.slot`); a sequence takes a row at its
first admission and keeps it until it finishes, through preemptions, so its outputs so far stay
where they are. Its K/V live in blocks, which preemption gives back.

Admission: the waiting queue in order; the fresh samples of one prompt that follow each other
enter as one group (one BlockTables.admit: they share the prompt's full blocks, one prefill),
as many of them as there are free rows and blocks, keeping free the blocks the running
sequences' next decode step takes (otherwise a sequence admitted now would be preempted at
once). The oldest running sequence always grows (a cache holds one max_model_len sequence at
least), so every sequence finishes.

Preemption (recompute, as vLLM's default): when a decode step needs more blocks than are free,
the youngest sequences give theirs back and wait at the head of the queue, oldest first, with
their generated tokens (`requeue`); re-admitted, they prefill prompt + generated tokens (the
prompt's blocks that siblings still hold, or that stay cached, are hits) and sample their next
token at the same position with the same key, so their tokens are those of an uninterrupted
run up to the floating-point rounding of prefill against decode.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridengine.rollout.kv_cache import SlotAllocator
from hybridengine.rollout.block_manager import BlockTables
from hybridengine.rollout.scheduler import Sequence


@dataclass
class PrefillGroup:
    """Samples admitted together (consecutive seq ids): one prefill of tokens[start:]."""

    seqs: list[Sequence]
    tokens: list[int]           # the prompt, + the generated tokens of a preempted sequence
    start: int                  # leading tokens whose K/V are cached already
    num_generated: int          # tokens generated before a preemption (0: a fresh prompt)


class PagedScheduler:
    """As rollout.scheduler.Scheduler (max_running, num_waited; `running` maps row ->
    sequence), with num_preemptions and num_prefix_cached_tokens (prompt tokens a prefill
    skipped: prefix-cache hits)."""

    def __init__(self, tables: BlockTables, num_rows: int, max_prefill_tokens: int):
        self.tables = tables
        self.rows = SlotAllocator(num_rows)
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}          # row -> sequence
        self.resume: dict[int, list[int]] = {}          # seq_id -> tokens generated so far
        self._rows: list[Sequence] | None = None
        self.max_running = self.num_waited = self.num_prefix_cached_tokens = 0

    @property
    def num_preemptions(self) -> int:
        return self.tables.num_preemptions

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule_prefill(self) -> list[PrefillGroup]:
        """Admit waiting groups while rows, blocks and the prefill budget allow; [] when the
        head does not fit (then decode)."""
        batch: list[PrefillGroup] = []
        num_tokens = 0
        # blocks the running sequences' next decode step takes (kept up to date below: one
        # pass over `running` per call, not per admission)
        reserve = self.tables.blocks_to_append(s.seq_id for s in self.running.values())
        while self.waiting:
            head = self.waiting[0]
            tokens = head.prompt + self.resume.get(head.seq_id, [])
            # the prefill's budget counts every token (cache hits are known only once admitted)
            if batch and num_tokens + len(tokens) > self.max_prefill_tokens:
                break
            m = self._admissible(head, tokens, reserve)
            if m == 0:
                self.num_waited = max(self.num_waited, len(self.waiting))
                break
            seqs = [self.waiting.popleft() for _ in range(m)]
            start = self.tables.admit(head.seq_id, tokens, m)
            generated = self.resume.pop(head.seq_id, [])
            for s in seqs:
                if s.slot < 0:
                    s.slot = self.rows.allocate()
                s.num_cached = len(tokens)
                self.running[s.slot] = s
            batch.append(PrefillGroup(seqs, tokens, start, len(generated)))
            self.num_prefix_cached_tokens += start
            num_tokens += len(tokens)
            if len(tokens) % self.tables.block_size == 0:
                reserve += m
        if batch:
            self._rows = None
            self.max_running = max(self.max_running, len(self.running))
        return batch

    def _admissible(self, head: Sequence, tokens: list[int], reserve: int) -> int:
        """How many waiting sequences from the head enter as one group (0: none fits), keeping
        `reserve` blocks free."""
        if head.seq_id in self.resume:      # a preempted sequence holds its row
            m = 1
        else:
            m = 1
            while (m < len(self.waiting) and self.waiting[m].seq_id == head.seq_id + m
                   and self.waiting[m].prompt_index == head.prompt_index):
                m += 1
            m = min(m, self.rows.num_free)
        return self.tables.max_admissible(tokens, m, reserve) if m else 0

    def decode_rows(self) -> list[Sequence]:
        """Running sequences in row order (cached until the running set changes)."""
        if self._rows is None:
            self._rows = [self.running[r] for r in sorted(self.running)]
        return self._rows

    def must_preempt(self) -> bool:
        """Whether the next decode step needs more blocks than are free."""
        growing = [s.seq_id for s in self.decode_rows() if not _done_on_device(s)]
        return self.tables.blocks_to_append(growing) > self.tables.allocator.num_free

    def preempt(self) -> list[Sequence]:
        """Free the youngest sequences' blocks until the next decode step fits; returns them,
        youngest first, out of `running` (each keeps its row: requeue them)."""
        growing = [s.seq_id for s in self.decode_rows() if not _done_on_device(s)]
        by_id = {s.seq_id: s for s in self.running.values()}
        out = [by_id[i] for i in self.tables.preempt_for_decode(growing)]
        for s in out:
            del self.running[s.slot]
        if out:
            self._rows = None
        return out

    def requeue(self, seqs: list[Sequence], generated: list[list[int]]) -> None:
        """Preempted sequences (youngest first) back at the head of the queue, oldest first,
        with the tokens each generated."""
        for s, tokens in zip(seqs, generated):
            self.resume[s.seq_id] = tokens
            self.waiting.appendleft(s)

    def append_slots(self, rows: list[Sequence]) -> list[int]:
        """The flat cache slot of each row's token in the next decode step; a row that has
        finished on the device (the host reads finished flags a step late) writes to the
        scratch block and takes none."""
        bs, out = self.tables.block_size, []
        for s in rows:
            if _done_on_device(s):
                out.append(self.tables.pad_block * bs)
            else:
                block, offset = self.tables.append_slot(s.seq_id)
                out.append(block * bs + offset)
        return out

    def finish(self, row: int) -> Sequence:
        seq = self.running.pop(row)
        self.tables.finish(seq.seq_id)
        self.rows.free(row)
        self._rows = None
        return seq


def _done_on_device(s: Sequence) -> bool:
    """Whether s has generated max_gen tokens in the steps launched so far (as
    engine._out_of_tokens, for one row)."""
    return s.num_cached - len(s.prompt) + 1 >= s.max_gen
