"""The model runner of the paged KV-cache layout (RolloutConfig.kv_layout="paged").

As ModelRunner, whose sampling, commit and collect it reuses, with the cache in blocks
(paged_cache.PagedKVCache) and the per-sequence state in rows (SlotState, one per
max_num_seqs): the scheduler (rollout/paged_scheduler.py) hands each step its rows' flat cache
slots and block tables. The attention runs through rollout/paged_context.py.

Eager only, for now: no CUDA graphs, no torch.compile, the torch reference attention (no
flash or Triton decode, no fused RoPE, no dense prefill), whatever the config says; the
runner gets the config with those settings forced (`eager_config`). A graph-captured paged
decode needs fixed-width block tables in static buffers and the Triton paged kernel
(kernels/paged_decode_attention.py).

Sizing: kv_cache_tokens // block_size blocks (one of them scratch), else on CUDA the memory
budget ModelRunner computes, else a block table of max_model_len for every row (the static
layout's footprint); at most that many, and at least one max_model_len sequence's worth.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch
from torch.profiler import record_function

from hybridengine.models.attention import PackedInput
from hybridengine.rollout.decode_graphs import DecodeGraphs
from hybridengine.rollout.kv_cache import kv_bytes_per_token
from hybridengine.rollout.model_runner import ModelRunner
from hybridengine.rollout.paged_cache import BlockAllocator, BlockTables, PagedKVCache
from hybridengine.rollout.paged_context import PagedDecodeContext, PagedPrefillContext
from hybridengine.rollout.paged_scheduler import PrefillGroup
from hybridengine.rollout.rollout_config import CompileMode, RolloutConfig
from hybridengine.rollout.slot_state import Pending, SlotState


def eager_config(config: RolloutConfig) -> RolloutConfig:
    """The settings the paged runner runs with: eager steps, torch attention."""
    return replace(config, enforce_eager=True, compile=CompileMode.EAGER,
                   compile_prefill=CompileMode.EAGER, attn_backend="sdpa",
                   prefill_attention="varlen",
                   kernels=replace(config.kernels, fused_rope=False))


def plan_num_blocks(max_num_seqs: int, max_model_len: int, block_size: int,
                    bytes_per_token: int, kv_cache_tokens: int | None = None,
                    budget_bytes: int | None = None) -> int:
    """Blocks that fit the budget (tokens, else bytes, else max_num_seqs full tables), capped at
    max_num_seqs full tables; (num_blocks + 1) are allocated, the extra one being scratch."""
    width = math.ceil(max_model_len / block_size)
    if kv_cache_tokens is not None:
        fit = kv_cache_tokens // block_size - 1
        what = f"kv_cache_tokens={kv_cache_tokens}"
    elif budget_bytes is not None:
        fit = budget_bytes // (bytes_per_token * block_size) - 1
        what = f"the KV-cache budget ({budget_bytes / 2**30:.2f} GiB)"
    else:
        return max_num_seqs * width
    if fit < width:
        raise ValueError(f"{what} holds {max(fit, 0)} blocks of block_size={block_size} (+1 "
                         f"scratch) < {width}, one sequence of max_model_len={max_model_len} "
                         f"tokens; raise the budget or lower max_model_len")
    return min(fit, max_num_seqs * width)


class PagedModelRunner(ModelRunner):
    def __init__(self, model, config: RolloutConfig, max_model_len: int):
        super().__init__(model, eager_config(config), max_model_len)
        self.block_size = config.block_size
        self.allocator: BlockAllocator | None = None

    @property
    def num_slots(self) -> int:
        """Rows: the sequences that run at once at most."""
        return self.state.active.shape[0] - 1

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def allocate(self) -> None:
        if self.cache is not None:
            return
        attn = self.model.layers[0].self_attn
        num_layers, c = len(self.model.layers), self.config
        bpt = kv_bytes_per_token(num_layers, attn.num_kv_heads, attn.head_dim, self.dtype)
        num_blocks = plan_num_blocks(c.max_num_seqs, self.max_model_len, self.block_size, bpt,
                                     c.kv_cache_tokens, self._cache_budget())
        self.cache = PagedKVCache(num_layers, num_blocks, self.block_size, attn.num_kv_heads,
                                  attn.head_dim, self.dtype, self.device)
        self.state = SlotState(c.max_num_seqs, self.max_model_len, self.device)
        self.graphs = DecodeGraphs(self.device)        # (none captured: free() clears it)
        self.allocator = BlockAllocator(num_blocks, self.block_size)

    def free(self) -> None:
        super().free()
        self.allocator = None

    def block_tables(self) -> BlockTables:
        """Empty block tables for one generate call. The prefix index is emptied: its K/V came
        from the weights of an earlier call, which the trainer may have updated since."""
        if self.allocator.num_free != self.allocator.num_blocks:
            # an interrupted generate left blocks held
            self.allocator = BlockAllocator(self.cache.num_blocks, self.block_size)
        self.allocator.reset_prefix_cache()
        return BlockTables(self.allocator)

    def generated(self, row: int, num: int) -> list[int]:
        """The first num tokens the row's sequence generated (reads the device)."""
        return self.state.out_tok[row, :num].tolist()

    def prefill(self, groups: list[PrefillGroup], tables: BlockTables) -> Pending:
        """Prefill each group's tokens past its cached prefix once, write their K/V into the
        group's blocks, sample each sequence's next token."""
        plan, max_len, any_cached = _prefill_plan(groups, tables, self.vocab_size)
        t = self._h2d_arrays(plan)
        packed = PackedInput(t["ids"], t["positions"], t["cu"].to(torch.int32), max_len)
        paged = None
        if any_cached:
            width = max(len(tables.tables[g.seqs[0].seq_id]) for g in groups)
            heads = [g.seqs[0].seq_id for g in groups]
            paged = (tables.block_table(heads, width).to(self.device), t["seq_lens"])
        ctx = PagedPrefillContext(self.cache, self.model.layer_start, packed, t["src"],
                                  t["dst"], paged)
        rows, state = t["rows"], self.state
        state.positions[rows] = t["last_pos"]
        state.keys[rows] = t["keys"]
        state.max_gen[rows] = t["max_gen"]
        state.counts[rows] = t["counts"]     # a preempted sequence goes on from its count
        state.active.index_fill_(0, rows, True)
        with torch.no_grad(), record_function("prefill"):
            h = self.model(packed, attn_ctx=ctx)                               # [T, H]
            h = h.index_select(0, t["last"]).index_select(0, t["row_group"])  # [seqs, H]
            fin = self._sample_and_commit(rows, t["last_pos"], h)
        return Pending([s.slot for g in groups for s in g.seqs], fin)

    def decode(self, rows: list[int], slot_mapping: list[int], block_tables: torch.Tensor,
               max_k: int) -> Pending:
        """One token for each row (sorted); slot_mapping: where each row's K/V go;
        block_tables [B, W] (host) with W·block_size >= max_k."""
        t = self._h2d_arrays({"rows": np.asarray(rows, dtype=np.int64),
                              "slots": np.asarray(slot_mapping, dtype=np.int64),
                              "tables": block_tables.numpy().astype(np.int64).reshape(-1)})
        r, state = t["rows"], self.state
        with torch.no_grad(), record_function("decode"):
            tok, pos = state.tokens[r], state.positions[r]
            cu_q = torch.arange(len(rows) + 1, dtype=torch.int32, device=self.device)
            ctx = PagedDecodeContext(self.cache, self.model.layer_start, t["slots"],
                                     t["tables"].view(block_tables.shape), pos, max_k)
            h = self.model(PackedInput(tok, pos, cu_q, 1), attn_ctx=ctx)
            fin = self._sample_and_commit(r, pos, h)
        return Pending(rows, fin)


def _prefill_plan(groups: list[PrefillGroup], tables: BlockTables, vocab_size: int):
    """Host int64 arrays of a paged prefill (rows first: as prefill_plan, the per-sequence
    lists), the longest packed group, and whether a group starts past a cached prefix."""
    ids, positions, cu, src, dst, seq_lens = [], [], [0], [], [], []
    per_seq = {k: [] for k in ("rows", "last_pos", "keys", "max_gen", "counts", "row_group")}
    for gi, g in enumerate(groups):
        off, n = cu[-1], len(g.tokens)
        ids += g.tokens[g.start:]
        positions += range(g.start, n)
        s_src, s_dst = tables.prefill_slots(g.seqs[0].seq_id, len(g.seqs), g.start)
        src += [off + i for i in s_src]
        dst += s_dst
        cu.append(off + n - g.start)
        seq_lens.append(n)
        for s in g.seqs:
            for k, v in zip(per_seq, (s.slot, n - 1, s.key, s.max_gen, g.num_generated, gi)):
                per_seq[k].append(v)
    plan = {k: np.asarray(v, dtype=np.int64) for k, v in per_seq.items()}
    ids_np = np.asarray(ids, dtype=np.int64)
    bad = np.flatnonzero((ids_np < 0) | (ids_np >= vocab_size))
    if bad.size:
        g = groups[int(np.searchsorted(cu, bad[0], side="right")) - 1]
        raise ValueError(f"prompt {g.seqs[0].prompt_index} has token id {ids_np[bad[0]]} "
                         f"outside the vocabulary [0, {vocab_size})")
    cu_np = np.asarray(cu, dtype=np.int64)
    plan.update(ids=ids_np, positions=np.asarray(positions, dtype=np.int64), cu=cu_np,
                src=np.asarray(src, dtype=np.int64), dst=np.asarray(dst, dtype=np.int64),
                last=cu_np[1:] - 1, seq_lens=np.asarray(seq_lens, dtype=np.int64))
    return plan, int(np.diff(cu_np).max()), any(g.start for g in groups)
