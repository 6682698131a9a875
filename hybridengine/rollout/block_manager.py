"""The paged KV cache's block manager (pure Python, no tensors): fixed-size blocks lent to
sequences as they grow, their reference counts, block tables and prefix index. The device
tensors the tables index, and the layout of a token in them, are paged_cache.py's.

Sharing without copy-on-write. Only full blocks are shared, and a sequence only ever writes
into its own last, partial block, so a shared block is never written again and nothing is
copied: the n samples of a prompt share its full blocks; the prompt's partial last block is
allocated per sample, and the one prefill of the prompt writes those tail tokens into each
sample's block (`prefill_slots`), as kv_cache's prefill writes every sample's row.

Prefix index (vLLM's prefix caching, with exact keys). Full prompt blocks are registered under
(parent id, the block's block_size token ids), where parent id is the id given to the block
before it in the chain (-1 for the first). The dict compares keys exactly, so no hash
collision can alias two prefixes; ids come from a counter and are never reused, so a chain
whose parent was evicted is never matched again. A block whose last reference goes keeps its
key on the free list (least recently freed leaves first; a sequence frees its blocks last to
first, so a chain's tail is evicted before its head): a prompt admitted later still finds it,
and `allocate` evicts it. A hit covers at most the first len(prompt) - 1 tokens: the prefill
must run the last prompt token to get the logits of the first sampled token. Cached K/V belong
to the weights that computed them: `reset_prefix_cache` after every weight update.

Admission counts free blocks (a cached free block counts: a hit revives it, a miss evicts it).
When a decode step needs more blocks than are free, the youngest sequences (admitted last) are
preempted: their blocks go back and the runner recomputes them later (`num_preemptions`).
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict

import numpy as np
import torch

from hybridengine.rollout.rollout_config import DEFAULT_BLOCK_SIZE


class BlockAllocator:
    """num_blocks blocks of block_size tokens with reference counts, and the prefix index of
    full blocks. refs[b] = the number of block tables that hold b; b is on the free list iff
    refs[b] == 0 (cached or not); extra_refs = sum over blocks of max(refs - 1, 0), the
    table entries that sharing saved."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._index: dict[tuple[int, tuple[int, ...]], int] = {}     # key -> block
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}        # block -> its key
        self._id: dict[int, int] = {}          # block -> the parent id its children's keys name
        self._next_id = 0
        self.extra_refs = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return len(self._free) >= n

    def allocate(self) -> int:
        """A block with one reference (the least recently freed; its cached key is evicted)."""
        if not self._free:
            raise RuntimeError("no free KV-cache block (check can_allocate first)")
        block, _ = self._free.popitem(last=False)
        self._evict(block)
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One reference more; a cached block on the free list is revived."""
        if self.refs[block] == 0:
            if block not in self._key:
                raise RuntimeError(f"block {block} is free and holds no cached prefix")
            del self._free[block]
        else:
            self.extra_refs += 1
        self.refs[block] += 1

    def free(self, block: int) -> None:
        if self.refs[block] <= 0:
            raise RuntimeError(f"block {block} is not allocated")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free[block] = None
        else:
            self.extra_refs -= 1

    def lookup(self, parent: int, tokens) -> int | None:
        """The cached block holding `tokens` after the chain `parent`, or None."""
        return self._index.get((parent, tuple(tokens)))

    def block_id(self, block: int) -> int:
        """The id that names `block` as the parent of the next block of its chain."""
        return self._id[block]

    def allocate_chain(self, parent: int, runs: list[tuple], refs: int = 1
                       ) -> tuple[list[int], int]:
        """A free block for each full block's tokens in runs (a prompt's uncached blocks, in
        order), each with `refs` references, entered in the prefix index under (the id before
        it, its tokens), the chain starting from the id `parent`: (the blocks, the last one's
        id). One call for all of them, the loop inlined: a batch of 256 prompts of 512 tokens
        admits 8,192 blocks on the host before its first prefill (~60 -> ~30 ms on the CPU
        machine)."""
        if len(self._free) < len(runs):
            raise RuntimeError("no free KV-cache block (check can_allocate first)")
        free, index, key_of, ids, counts = self._free, self._index, self._key, self._id, \
            self.refs
        blocks = []
        for tokens in runs:
            block, _ = free.popitem(last=False)
            self._evict(block)
            counts[block] = refs
            key = (parent, tokens)
            found = index.get(key)
            if found is None:
                index[key], key_of[block], ids[block] = block, key, self._next_id
                self._next_id += 1
                parent = ids[block]
            else:
                # the key is cached already (a prompt whose last block was recomputed): the
                # cached block stays the one found and its id continues the chain
                parent = ids[found]
            blocks.append(block)
        self.extra_refs += (refs - 1) * len(runs)
        return blocks, parent

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (their K/V came from weights that changed)."""
        for block in list(self._key):
            self._evict(block)

    def _evict(self, block: int) -> None:
        key = self._key.pop(block, None)
        if key is not None:
            del self._index[key], self._id[block]

    def check(self, held: Counter) -> None:
        """Invariants, given held[b] = the number of block tables holding b."""
        for b in range(self.num_blocks):
            assert self.refs[b] == held[b], (b, self.refs[b], held[b])
            assert (b in self._free) == (self.refs[b] == 0), b
        assert set(held) <= set(range(self.num_blocks)), held
        assert self.extra_refs == sum(max(r - 1, 0) for r in self.refs)
        assert len(self._index) == len(self._key) == len(self._id)
        assert all(self._index[key] == b for b, key in self._key.items())


class BlockTables:
    """The block table of every admitted sequence. Sequence ids follow the scheduler's
    (prompt_index·n + sample_index): admit(seq_id, prompt, n) admits seq_id .. seq_id + n - 1.
    Dict order is admission order, the youngest last (preemption takes it first).
    peak_blocks: the most blocks held at once (refs > 0), and tokens_at_peak the distinct token
    positions they held then (a shared block's counted once): the KV memory used against the
    tokens it holds, whose ratio is the tail blocks' slack."""

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.tables: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}       # tokens with a slot reserved (K/V written
                                                   # or about to be)
        self.num_preemptions = 0
        self._sum_tokens = 0                       # sum of num_tokens
        self.peak_blocks = self.tokens_at_peak = 0

    def _note_peak(self) -> None:
        a = self.allocator
        held = a.num_blocks - a.num_free
        if held > self.peak_blocks:
            # each extra reference is a full shared block counted in one more sequence
            self.peak_blocks = held
            self.tokens_at_peak = self._sum_tokens - a.extra_refs * self.block_size

    @property
    def pad_block(self) -> int:
        """The scratch block (PagedKVCache.scratch_block): table padding, graph padding rows."""
        return self.allocator.num_blocks

    def _cache_hits(self, prompt: list[int]) -> tuple[list[int], int]:
        """The cached blocks of the prompt's longest cached prefix within its first
        len(prompt) - 1 tokens, and the id of the last (-1 when none)."""
        bs, hits, parent = self.block_size, [], -1
        for i in range((len(prompt) - 1) // bs):
            block = self.allocator.lookup(parent, prompt[i * bs:(i + 1) * bs])
            if block is None:
                break
            hits.append(block)
            parent = self.allocator.block_id(block)
        return hits, parent

    def _admission(self, prompt: list[int]) -> tuple[list[int], int, int, int]:
        """(the cached hits, the last hit's id, the free blocks the samples' shared part takes:
        the uncached full blocks and the cached hits that sit on the free list, the free
        blocks each sample takes: its tail block)."""
        hits, parent = self._cache_hits(prompt)
        full, tail = divmod(len(prompt), self.block_size)
        revived = sum(1 for b in hits if self.allocator.refs[b] == 0)
        return hits, parent, full - len(hits) + revived, 1 if tail else 0

    def blocks_to_admit(self, prompt: list[int], n: int = 1) -> int:
        """Free blocks that admit(…, prompt, n) takes: the uncached full blocks once, a tail
        block per sample, and the cached hits that sit on the free list."""
        _, _, shared, per_sample = self._admission(prompt)
        return shared + n * per_sample

    def can_admit(self, prompt: list[int], n: int = 1, reserve: int = 0) -> bool:
        """Whether the prompt's n samples fit with `reserve` blocks left free (headroom for
        the running sequences' next blocks)."""
        return self.blocks_to_admit(prompt, n) + reserve <= self.allocator.num_free

    def max_admissible(self, prompt: list[int], n: int, reserve: int = 0) -> int:
        """The most samples of the prompt, up to n, that can_admit admits (one prefix lookup,
        where a loop over can_admit takes one per count)."""
        _, _, shared, per_sample = self._admission(prompt)
        room = self.allocator.num_free - reserve - shared
        if room < 0:
            return 0
        return n if per_sample == 0 else min(n, room // per_sample)

    def admit(self, seq_id: int, prompt: list[int], n: int = 1) -> int:
        """Block tables for the n samples seq_id .. seq_id + n - 1 of the prompt (its full
        blocks shared, cached ones found in the prefix index; a tail block each). Returns the
        number of leading prompt tokens whose K/V are cached: the prefill computes the rest
        once (prefill_slots)."""
        ids = range(seq_id, seq_id + n)
        if not prompt or n < 1 or any(s in self.tables for s in ids):
            raise ValueError(f"cannot admit sequences {list(ids)} with {len(prompt)} tokens")
        shared, parent, need, per_sample = self._admission(prompt)
        if need + n * per_sample > self.allocator.num_free:
            raise RuntimeError("not enough free KV-cache blocks (check can_admit first)")
        a, bs = self.allocator, self.block_size
        num_cached = len(shared) * bs
        for block in shared:
            for _ in ids:
                a.share(block)
        fresh, parent = a.allocate_chain(
            parent, [tuple(prompt[i * bs:(i + 1) * bs])
                     for i in range(len(shared), len(prompt) // bs)], n)
        shared += fresh
        for s in ids:
            tail = [a.allocate()] if len(prompt) % bs else []
            self.tables[s] = shared + tail
            self.num_tokens[s] = len(prompt)
        self._sum_tokens += n * len(prompt)
        self._note_peak()
        return num_cached

    def prefill_slots(self, seq_id: int, n: int, start: int) -> tuple[np.ndarray, np.ndarray]:
        """Where the prefill of prompt tokens start.. of samples seq_id .. seq_id + n - 1
        (admitted together: equal lengths) writes: int64 arrays (src, dst) with src[i] the
        token's index in the packed prefill (position - start) and dst[i] its flat slot; a
        shared block's slot appears once, a tail token once per sample (sample-major, the
        first occurrence of each slot)."""
        bs, length = self.block_size, self.num_tokens[seq_id]
        pos = np.arange(start, length, dtype=np.int64)
        slots = []
        for s in range(seq_id, seq_id + n):
            if self.num_tokens[s] != length:
                raise ValueError(f"sequences {seq_id}..{seq_id + n - 1} differ in length")
            table = np.asarray(self.tables[s], dtype=np.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
        flat = np.concatenate(slots)
        if n == 1:
            return pos - start, flat
        # numpy, not a loop over tokens (a 16k-token prefill's loop took ~9 ms of host time)
        _, first = np.unique(flat, return_index=True)
        first.sort()
        return first % len(pos), flat[first]

    def blocks_to_append(self, seq_ids) -> int:
        """Blocks that one append_slot of each of seq_ids (those admitted) takes."""
        return sum(1 for s in seq_ids
                   if s in self.tables and self.num_tokens[s] % self.block_size == 0)

    def append_slot(self, seq_id: int) -> tuple[int, int]:
        """Reserve the next token's slot: (block, offset) of position num_tokens, a new block
        at a block boundary."""
        t, table = self.num_tokens[seq_id], self.tables[seq_id]
        self.num_tokens[seq_id] = t + 1
        self._sum_tokens += 1
        if t == len(table) * self.block_size:
            table.append(self.allocator.allocate())
            self._note_peak()
        return table[t // self.block_size], t % self.block_size

    def finish(self, seq_id: int) -> None:
        """Give the sequence's blocks back, last to first (a cached chain's tail is evicted
        before the blocks it extends)."""
        for block in reversed(self.tables.pop(seq_id)):
            self.allocator.free(block)
        self._sum_tokens -= self.num_tokens.pop(seq_id)

    def preempt_youngest(self, num_blocks: int = 1) -> list[int]:
        """Preempt the youngest sequences until num_blocks blocks are free (or none is left);
        returns them, youngest first. A sample whose siblings still run frees only its own
        blocks: the shared prompt blocks stay (and are cache hits when it comes back)."""
        preempted = []
        while self.allocator.num_free < num_blocks and self.tables:
            preempted.append(self._preempt())
        return preempted

    def preempt_for_decode(self, seq_ids) -> list[int]:
        """Preempt the youngest sequences until every sequence of seq_ids still admitted can
        append one slot (one at a time: a preempted sequence of seq_ids needs no block)."""
        preempted = []
        while self.tables and self.blocks_to_append(seq_ids) > self.allocator.num_free:
            preempted.append(self._preempt())
        return preempted

    def _preempt(self) -> int:
        seq_id = next(reversed(self.tables))
        self.finish(seq_id)
        self.num_preemptions += 1
        return seq_id

    def block_table(self, seq_ids, width: int) -> torch.Tensor:
        """[len(seq_ids), width] int32 (host) tables padded with the scratch block; a seq id
        of -1 is a padding row (all scratch)."""
        # numpy rows: a decode step builds its batch's tables on the host (torch's per-row
        # tensors cost ~10 µs a row)
        out = np.full((len(seq_ids), width), self.pad_block, dtype=np.int32)
        for row, s in enumerate(seq_ids):
            table = self.tables[s] if s >= 0 else []
            if len(table) > width:
                raise ValueError(f"sequence {s} holds {len(table)} blocks > width {width}")
            out[row, :len(table)] = table
        return torch.from_numpy(out)

    def check(self) -> None:
        """Invariants: no block twice in a table; a table covers its tokens exactly; a
        partial last block is private; every block is free or held, and its reference count
        is the number of tables holding it."""
        held = Counter()
        for s, table in self.tables.items():
            assert len(set(table)) == len(table), (s, table)
            assert len(table) == math.ceil(self.num_tokens[s] / self.block_size), s
            if self.num_tokens[s] % self.block_size:
                assert self.allocator.refs[table[-1]] == 1, (s, table[-1])
            held.update(table)
        self.allocator.check(held)
        assert self._sum_tokens == sum(self.num_tokens.values())
