"""The model runner of the paged KV-cache layout (RolloutConfig.kv_layout="paged").

As ModelRunner, whose sampling, commit, collect and compiled steps it reuses, with the cache in
blocks (paged_cache.PagedKVCache) and the per-sequence state in rows (SlotState, one per
max_num_seqs): the scheduler (rollout/paged_scheduler.py) hands each step its rows' flat cache
slots and block tables. The attention runs through rollout/paged_context.py.

Decode: the triton backend (kernels/paged_decode_attention.py; with kernels.fused_rope RoPE and
the cache write inside it) where Triton runs, else the torch reference (resolve_paged_backend).
As the static runner's, the step is graph-shaped under CUDA graphs (`static_shapes`; tests set
it on the CPU to run the same path without capture): its rows padded to a graph bucket with
the scratch row, whose flat slot is the scratch block's, the tables read at the fixed width
W = ceil(max_model_len / block_size), padded with the scratch block; its rows and slots in
static buffers (row_ids, slot_mapping) filled before each replay; one graph per (sampler mode,
bucket), captured on first use. Eager (enforce_eager), a step reads the tables at the width
the engine hands over and max_k keys.
Block tables live on the device, one row per sequence row (slot_tables [rows + 1, W]): a
prefill writes its sequences' whole tables, and a decode step, inside its graph, only the
block each row writes its token into (the block at position // block_size: a new one at a
block boundary), from the slots it is handed; the fused decode kernel reads the tables by row
id (the other backends gather the step's rows). A step uploads its slots, and its rows when
they changed: one host-to-device copy, where the step used to spend a copy and five small
kernels outside its graph gathering the rows' tables (and at 256 rows of 16k tokens, before
that, the host built and copied 2 MB of tables a step).
Compile: compile / compile_prefill as the static layout (rollout/compile_steps.py: the decode
forward with its rows marked dynamic, the sampler's bookkeeping, the prefill forward); the
cache's block count is marked dynamic. The prefill takes one of three forms (varlen or dense
without a cached prefix, as the static layout's; past one, padded_prefix_attention), each
compiled when first met.

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

from hybridengine.kernels import decode_attention as triton_decode
from hybridengine.models.attention import PackedInput
from hybridengine.rollout.decode_graphs import DecodeGraphs
from hybridengine.rollout.kv_cache import check_fits_device, kv_bytes_per_token
from hybridengine.rollout.model_runner import ModelRunner
from hybridengine.rollout.block_manager import BlockAllocator, BlockTables
from hybridengine.rollout.paged_cache import PagedKVCache
from hybridengine.rollout.paged_context import PagedDecodeContext, PagedPrefillContext
from hybridengine.rollout.paged_scheduler import PrefillGroup
from hybridengine.rollout.prefill_plan import add_prefix_index, paged_prefill_plan, plan_dense
from hybridengine.rollout.rollout_config import STATIC_ONLY_BACKENDS, RolloutConfig
from hybridengine.rollout.slot_state import Pending, SlotState, h2d_into


def resolve_paged_backend(requested: str, device: torch.device,
                          heads: tuple[int, int, int]) -> str:
    """The paged decode backend for a rank holding heads = (q heads, K/V heads, head_dim):
    triton (the paged kernel; auto: on CUDA where it supports the heads) or sdpa (the torch
    reference). The flash backends read the static layout's rows: ValueError."""
    runs = triton_decode.available(device) and triton_decode.supports(*heads)
    if requested == "triton" and not runs:
        raise ValueError(f"attn_backend='triton' needs triton (CUDA, or TRITON_INTERPRET=1), "
                         f"q heads divisible by K/V heads and a power-of-two head_dim >= 16 "
                         f"(device={device}, q, kv heads, head_dim = {heads})")
    if requested in STATIC_ONLY_BACKENDS:
        raise ValueError(f"attn_backend={requested!r} reads the static layout's cache rows: "
                         f"kv_layout=paged decodes with triton or sdpa")
    if requested == "auto":
        return "triton" if runs and device.type == "cuda" else "sdpa"
    return requested


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
        # ModelRunner resolves the static layout's decode backend, which reads cache rows (and
        # `auto` checks those kernels on the device for nothing): it gets sdpa, and the paged
        # backend is resolved here. Every other setting is honoured.
        super().__init__(model, replace(config, attn_backend="sdpa"), max_model_len)
        c = model.cfg
        heads = (c.num_heads // self.tp, c.num_kv_heads // self.tp, c.head_dim)
        self.backend = resolve_paged_backend(config.attn_backend, self.device, heads)
        self.block_size = config.block_size
        self.width = math.ceil(max_model_len / config.block_size)   # graph-shaped tables
        self.allocator: BlockAllocator | None = None

    @property
    def num_slots(self) -> int:
        """Rows: the sequences that run at once at most."""
        return self.state.active.shape[0] - 1

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def allocate(self) -> None:
        """As ModelRunner.allocate: the cache, the row state, the static decode buffers."""
        if self._allocated():
            return
        attn = self.model.layers[0].self_attn
        num_layers, c, dev = len(self.model.layers), self.config, self.device
        bpt = kv_bytes_per_token(num_layers, attn.num_kv_heads, attn.head_dim, self.dtype)
        num_blocks = plan_num_blocks(c.max_num_seqs, self.max_model_len, self.block_size, bpt,
                                     c.kv_cache_tokens, self._cache_budget())
        check_fits_device((num_blocks + 1) * self.block_size * bpt, c.kv_cache_tokens, dev)
        self.cache = PagedKVCache(num_layers, num_blocks, self.block_size, attn.num_kv_heads,
                                  attn.head_dim, self.dtype, dev)
        R = c.max_num_seqs
        self.state = SlotState(R, self.max_model_len, dev)
        self.allocator = BlockAllocator(num_blocks, self.block_size)
        # static decode inputs and outputs (CUDA graphs read / write these addresses);
        # padding: the scratch row (R), its slot in the scratch block
        self.scratch_slot = num_blocks * self.block_size
        self.row_ids = torch.full((R,), R, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((R,), self.scratch_slot, dtype=torch.long, device=dev)
        self._uploaded_rows = None
        self.slot_tables = torch.full((R + 1, self.width), num_blocks, dtype=torch.int32,
                                      device=dev)
        self.step_fin = torch.zeros(R, dtype=torch.bool, device=dev)
        self.buckets = self._graph_buckets(R)
        if self.compiled or self.prefill_compiled:
            # the block count follows the memory free at each allocation: the compiled steps
            # take any
            for t in (*self.cache.k, *self.cache.v):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        self.graphs = DecodeGraphs(dev)

    def free(self) -> None:
        super().free()
        self.allocator = None
        for name in ("row_ids", "slot_mapping", "slot_tables"):
            self.__dict__.pop(name, None)

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

    # --- prefill -----------------------------------------------------------------------------
    def prefill(self, groups: list[PrefillGroup], tables: BlockTables) -> Pending:
        """Prefill each group's tokens past its cached prefix once, write their K/V into the
        group's blocks, sample each sequence's next token."""
        compiled = self.compiled or self.prefill_compiled
        # compiled steps: a 1-token dummy group in the scratch row keeps every size >= 2
        pad_row = self.num_slots if compiled and len(groups) == 1 else None
        plan, max_len, any_cached = paged_prefill_plan(groups, tables, self.vocab_size, pad_row)
        num, prefix, width = len(plan["seq_lens"]), None, None
        if any_cached:
            longest = add_prefix_index(plan, groups, tables)
        else:
            width = plan_dense(plan, max_len, self.prefill_attention, self.prefill_compiled)
        ids = [s.seq_id for g in groups for s in g.seqs]
        whole = tables.block_table(ids, self.width).numpy().astype(np.int64).reshape(-1)
        t = self._h2d_arrays({**plan, "tables": whole})
        self.slot_tables.index_copy_(0, t["rows"][:len(ids)],
                                     t["tables"].view(len(ids), self.width).to(torch.int32))
        packed = PackedInput(t["ids"], t["positions"], t["cu"].to(torch.int32), max_len)
        if any_cached:
            prefix = (t["key_slots"], t["q_index"], num, longest)
        dense = (num, width, t.get("pad_index")) if width is not None else None
        ctx = PagedPrefillContext(self.cache, self.model.layer_start, packed, t["src"],
                                  t["dst"], prefix, dense, self.kernel_settings)
        rows, state = t["rows"], self.state
        state.positions[rows] = t["last_pos"]
        state.keys[rows] = t["keys"]
        state.max_gen[rows] = t["max_gen"]
        state.counts[rows] = t["counts"]     # a preempted sequence goes on from its count
        real = sum(len(g.seqs) for g in groups)
        state.active.index_fill_(0, rows[:real], True)          # (not the dummy's scratch row)
        with torch.no_grad(), record_function("prefill"):
            h = self._prefill_forward(packed, ctx)                             # [T, H]
            h = h.index_select(0, t["last"]).index_select(0, t["row_group"])  # [seqs, H]
            fin = self._sample_and_commit(rows, t["last_pos"], h)
        return Pending([s.slot for g in groups for s in g.seqs], fin[:real])

    # --- decode ------------------------------------------------------------------------------
    def decode(self, rows: list[int], slot_mapping: list[int], width: int,
               max_k: int) -> Pending:
        """One token for each row (sorted); slot_mapping: where each row's K/V go (a fresh
        block's first slot at a block boundary); width: the tables' blocks to read, with
        width·block_size >= max_k. Graph-shaped: the rows padded to a bucket, the tables to
        width W, max_model_len keys; else max_k keys."""
        B = len(rows)
        with torch.no_grad(), record_function("decode"):
            if self.static_shapes:
                n, width, max_k = next(b for b in self.buckets if b >= B), self.width, \
                    self.max_model_len
                graph = self._graph(n) if self.use_graphs else None
            else:
                # compiled: one scratch row with a lone sequence (size 1 would compile again)
                n = B + (self.compiled and B == 1 < self.num_slots)
                graph = None
            self._upload(rows, slot_mapping, n)
            if graph is not None:
                graph.replay()
            else:
                self._decode_step(n, width, max_k)
        return Pending(rows, self.step_fin[:B])

    def _upload(self, rows, slot_mapping, n: int) -> None:
        """The step's flat slots into the static buffer's first n entries, and its rows when
        they changed since the last step (padding rows: the scratch row and slot): one
        host-to-device copy a step, straight into the buffer the step reads."""
        pad = n - len(rows)
        rows = rows + [self.num_slots] * pad
        if rows != self._uploaded_rows:
            h2d_into(self.row_ids[:n], np.asarray(rows, np.int64))
            self._uploaded_rows = rows
        h2d_into(self.slot_mapping[:n],
                 np.asarray(slot_mapping + [self.scratch_slot] * pad, np.int64))

    def _decode_step(self, n: int, width: int, max_k: int) -> None:
        rows, slots = self.row_ids[:n], self.slot_mapping[:n]
        # the block each row writes its token into, in its table (a new one at a block
        # boundary; the scratch row: the scratch block). Part of the step, so a CUDA graph
        # replays it. A row that finished on the device a step ago (read one step late) no
        # longer moves its position: its entry lands in a stale column nothing reads again
        self.slot_tables[rows, self.state.positions[rows] // self.block_size] = \
            (slots // self.block_size).to(torch.int32)
        # the decode body's own views (as ModelRunner._decode_step): marked dynamic, so that
        # one compile serves every bucket
        body = (self.row_ids[:n], self.slot_mapping[:n])
        if self.compiled and n > 1:
            for x in body:
                torch._dynamo.mark_dynamic(x, 0)
        h = self._decode_body(*body, self.slot_tables[:, :width], max_k)
        # the forward only writes the cache: positions still hold this step's values
        self.step_fin[:n] = self._sample_and_commit(rows, self.state.positions[rows], h)

    def _decode_hidden(self, rows: torch.Tensor, slot_mapping: torch.Tensor,
                       tables: torch.Tensor, max_k: int) -> torch.Tensor:
        """rows [B] -> last hidden states [B, H] of the rows' current tokens (writes K/V at
        slot_mapping, reads through the tables of every row id, tables [rows + 1, w] int32)."""
        state = self.state
        tok, pos = state.tokens[rows], state.positions[rows]
        cu_q = torch.arange(rows.shape[0] + 1, dtype=torch.int32, device=rows.device)
        ctx = PagedDecodeContext(self.cache, self.model.layer_start, slot_mapping, tables, pos,
                                 max_k, rows, state.positions, self.backend,
                                 self.kernel_settings)
        return self.model(PackedInput(tok, pos, cu_q, 1), attn_ctx=ctx)

    def _graph(self, n: int):
        """The decode graph of (sampler mode, bucket n), captured on first use on padding rows
        only (so it can happen in the middle of a generation)."""
        key = (self.mode, n)
        graph = self.graphs.get(key)
        if graph is None:
            self.row_ids[:n].fill_(self.num_slots)
            self.slot_mapping[:n].fill_(self.scratch_slot)
            self._uploaded_rows = None
            graph = self.graphs.capture(
                key, lambda: self._decode_step(n, self.width, self.max_model_len))
        return graph
