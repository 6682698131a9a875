"""Attention through block tables: the paged layout's contexts for `attn_ctx.attend(layer, q, k,
v)`, the protocol of rollout.attention's DecodeContext and PrefillContext.

Both write the step's new K/V at flat slots (block·block_size + offset, PagedKVCache.write)
before any attention of the layer reads the cache, so a prompt whose cached prefix is written
by another prompt of the same prefill (equal prompts admitted together) reads it already.

PagedDecodeContext: one token per row, by one of two backends:
  triton  the split-KV kernel through the tables (kernels/paged_decode_attention.py); with
          fused_rope the decoder hands q and k unrotated (`applies_rope`) and RoPE, the cache
          write and attention run in one launch (`attend_rope`), else the write in torch
          before the kernel.
  sdpa    the rows' blocks gathered and cut to max_k keys, then masked grouped SDPA as
          DecodeContext's sdpa backend (same key length, same bits): the reference, the CPU
          path.
Every shape depends on (rows, table width, max_k) only: a graph-shaped step (fixed-width
tables, max_k = max_model_len) can be captured in a CUDA graph.
PagedPrefillContext: without a cached prefix, causal attention over the fresh packed K/V as
PrefillContext, varlen or dense (same bits as the static layout); with one, each group's keys
gathered from its blocks into a right-padded [S, N] layout and its new queries placed at their
positions: one causal SDPA over the padded groups (`padded_prefix_attention`; no host sync,
so it compiles).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridengine.kernels import paged_decode_attention as triton_paged
from hybridengine.kernels.settings import DEFAULT_KERNEL_SETTINGS, RolloutKernelSettings
from hybridengine.models.attention import PackedCausalAttention, PackedInput
from hybridengine.rollout.attention import grouped_sdpa
from hybridengine.rollout.dense_prefill import padded_causal_attention, write_prefill_kv
from hybridengine.rollout.kv_cache import write_rows
from hybridengine.rollout.paged_cache import PagedKVCache, gather_blocks


class PagedDecodeContext:
    """slot_mapping [B] int64 flat slots of this step's tokens (the scratch block's for padding
    rows and rows that finished on the device); row_tables [rows + 1, W] int32 the block table
    of every runner row, W·block_size >= max_k; positions [B] int64 of this step's tokens;
    max_k: keys read per row (max_model_len in a graph-shaped step); rows [B] int64 the step's
    runner rows and row_positions the runner's position state by row (positions =
    row_positions[rows]); backend: triton | sdpa; settings: the kernel's tile and launch, and
    fused_rope. The fused triton form reads the tables, lengths and positions by row id
    itself (state written before the step: its launch reads them before the PDL wait); the
    other forms take the rows' tables gathered here."""

    def __init__(self, cache: PagedKVCache, layer_start: int, slot_mapping: torch.Tensor,
                 row_tables: torch.Tensor, positions: torch.Tensor, max_k: int,
                 rows: torch.Tensor, row_positions: torch.Tensor, backend: str = "sdpa",
                 settings: RolloutKernelSettings | None = None):
        self.cache, self.layer_start = cache, layer_start
        self.slot_mapping, self.row_tables, self.max_k = slot_mapping, row_tables, max_k
        self.rows, self.row_positions = rows, row_positions
        self.backend = backend
        # (no settings object as a default argument: dynamo builds this class inside the
        # compiled step; see DecodeContext)
        s = DEFAULT_KERNEL_SETTINGS if settings is None else settings
        self.launch = dict(block_n=s.decode_block_n, num_warps=s.decode_num_warps,
                           num_stages=s.decode_num_stages)
        self.launch_rope = dict(self.launch, pdl=s.pdl, prefetch_keys=s.decode_prefetch_keys)
        self.applies_rope = backend == "triton" and s.fused_rope
        if self.applies_rope:          # the fused kernel reads all it needs by row id
            return
        self.block_tables = row_tables.index_select(0, rows)                      # [B, W]
        # the write's (block, offset), once for every layer
        bs = cache.block_size
        self.block, self.offset = slot_mapping // bs, slot_mapping % bs
        # a row that finished on the device may sit one past the last position: it writes to
        # the scratch block and reads max_k keys, all discarded
        seqlens = (positions + 1).clamp(max=max_k)                               # [B]
        if backend == "triton":
            self.seq_lens = seqlens.to(torch.int32)
        else:
            cols = torch.arange(max_k, device=positions.device)
            self.mask = (cols < seqlens.unsqueeze(1))[:, None, None, :]        # [B, 1, 1, max_k]

    def attend(self, layer_idx: int, q, k, v, spec=None) -> torch.Tensor:
        """q [B, h_q, d], k/v [B, h_kv, d] -> [B, h_q, d]."""
        _plain_only(spec)
        layer = layer_idx - self.layer_start
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        write_rows(kc, vc, self.block, self.offset, k, v)
        if self.backend == "triton":
            return triton_paged.paged_decode_attention(q, kc, vc, self.block_tables,
                                                       self.seq_lens, None, **self.launch)
        kc = gather_blocks(kc, self.block_tables)[:, :, :self.max_k]
        vc = gather_blocks(vc, self.block_tables)[:, :, :self.max_k]
        return grouped_sdpa(q, kc, vc, self.mask)

    def attend_rope(self, layer_idx: int, q, k, v, cos, sin) -> torch.Tensor:
        """attend() from the unrotated q, k (fp32 RoPE tables cos, signed sin [B, d]), in one
        kernel (triton backend with fused_rope)."""
        layer = layer_idx - self.layer_start
        return triton_paged.paged_decode_attention_rope(
            q, k, v, cos, sin, self.cache.k[layer], self.cache.v[layer], self.row_tables,
            self.slot_mapping, self.rows, self.row_positions, self.max_k,
            **self.launch_rope)


class PagedPrefillContext:
    """Packed new tokens of S prefill groups: write K/V of packed token src[i] to flat slot
    dst[i] (each shared block once, each sample's tail block per sample), then attend. prefix
    = (key_slots [S·N], q_index [T], S, N) when some group has a cached prefix (its packed
    tokens start past position 0; see padded_prefix_attention), else None: causal attention
    over the packed tokens, varlen, or with dense = (S, max_len, pad_index) as
    PrefillContext's dense form."""

    def __init__(self, cache: PagedKVCache, layer_start: int, packed: PackedInput,
                 src: torch.Tensor, dst: torch.Tensor, prefix: tuple | None = None,
                 dense: tuple | None = None,
                 settings: RolloutKernelSettings = DEFAULT_KERNEL_SETTINGS):
        self.cache, self.layer_start = cache, layer_start
        self.src, self.prefix, self.dense = src, prefix, dense
        self.block, self.offset = dst // cache.block_size, dst % cache.block_size
        self.triton_kv_write = settings.triton_kv_write
        self.inner = PackedCausalAttention(packed)

    def attend(self, layer_idx: int, q, k, v, spec=None) -> torch.Tensor:
        _plain_only(spec)
        layer = layer_idx - self.layer_start
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if self.dense is None and self.prefix is None:
            write_rows(kc, vc, self.block, self.offset, k.index_select(0, self.src),
                       v.index_select(0, self.src))
            return self.inner.attend(layer_idx, q, k, v)
        # an opaque write (as the static dense prefill's): it runs where the layer computes
        # it, before the attention that reads the cache
        write_prefill_kv(kc, vc, self.block, self.offset, k, v, self.src, self.triton_kv_write)
        if self.prefix is None:
            return padded_causal_attention(q, k, v, *self.dense)
        return padded_prefix_attention(q, kc, vc, *self.prefix)


def padded_prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            key_slots: torch.Tensor, q_index: torch.Tensor, num_seqs: int,
                            max_len: int) -> torch.Tensor:
    """Packed new tokens q [T, h_q, d] of S = num_seqs sequences whose K/V are all in the cache
    (written before this call), N = max_len: key_slots [S·N] the flat slot of each sequence's
    position 0..N-1 (padding: any slot, the scratch block's), q_index [T] = s·N + position of
    each new token -> [T, h_q, d]. Right padding needs no mask (as padded_causal_attention): a
    query at position p sees keys 0..p, all its sequence's; padded query rows (the cached
    prefix's, the tail's) are zeros, computed and dropped."""
    T, hq, d = q.shape
    hkv = k_cache.shape[2]

    def keys(cache):
        flat = cache.view(-1, hkv, d).index_select(0, key_slots)              # [S·N, h_kv, d]
        return flat.view(num_seqs, max_len, hkv, d).transpose(1, 2).to(q.dtype)
    qd = q.new_zeros(num_seqs * max_len, hq, d).index_copy_(0, q_index, q)
    qd = qd.view(num_seqs, max_len, hq, d).transpose(1, 2)                   # [S, h_q, N, d]
    # (enable_gqa a constant: under torch.compile hkv != hq is symbolic, which SDPA refuses;
    # with equal head counts it changes nothing)
    o = F.scaled_dot_product_attention(qd, keys(k_cache), keys(v_cache), is_causal=True,
                                       enable_gqa=True)
    return o.transpose(1, 2).reshape(num_seqs * max_len, hq, d).index_select(0, q_index)


def _plain_only(spec) -> None:
    """A layer with a window, a soft-cap or its own scale (models.features: Mistral, Gemma)
    passes a spec; the paged contexts attend plainly only."""
    if spec is not None:
        raise ValueError("kv_layout=paged does not support sliding-window or soft-capped "
                         "attention yet (Mistral, Gemma): use kv_layout=static")
