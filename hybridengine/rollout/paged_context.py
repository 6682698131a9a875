"""Attention through block tables: the paged layout's contexts for `attn_ctx.attend(layer, q, k,
v)`, the protocol of rollout.attention's DecodeContext and PrefillContext.

Both write the step's new K/V at flat slots (block·block_size + offset, PagedKVCache.write)
before any attention of the layer reads the cache, so a prompt whose cached prefix is written
by another prompt of the same prefill (equal prompts admitted together) reads it already.

PagedDecodeContext: one token per row; the rows' blocks gathered and cut to max_k keys, then
masked grouped SDPA as DecodeContext's sdpa backend (same key length, same bits).
PagedPrefillContext: without a cached prefix, causal attention over the fresh packed K/V as
PrefillContext (same bits as the static layout); with one, each sequence's new tokens attend
to its blocks (paged_cache.paged_prefill_attention).

Torch reference attention only: the eager path (CPU, or CUDA without graphs); the Triton
paged decode kernel (kernels/paged_decode_attention.py) is not wired in yet.
"""
from __future__ import annotations

import torch

from hybridengine.models.attention import PackedCausalAttention, PackedInput
from hybridengine.rollout.attention import grouped_sdpa
from hybridengine.rollout.paged_cache import (PagedKVCache, gather_blocks,
                                              paged_prefill_attention)


class PagedDecodeContext:
    """slot_mapping [B] int64 flat slots of this step's tokens (the scratch block's for rows
    that finished on the device); block_tables [B, W] with W·block_size >= max_k; positions
    [B] int64 of this step's tokens; max_k: keys read per row."""

    def __init__(self, cache: PagedKVCache, layer_start: int, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, positions: torch.Tensor, max_k: int):
        self.cache, self.layer_start = cache, layer_start
        self.slot_mapping, self.block_tables, self.max_k = slot_mapping, block_tables, max_k
        seqlens = (positions + 1).clamp(max=max_k)                               # [B]
        cols = torch.arange(max_k, device=positions.device)
        self.mask = (cols < seqlens.unsqueeze(1))[:, None, None, :]            # [B, 1, 1, max_k]

    def attend(self, layer_idx: int, q, k, v, spec=None) -> torch.Tensor:
        """q [B, h_q, d], k/v [B, h_kv, d] -> [B, h_q, d]."""
        _plain_only(spec)
        layer = layer_idx - self.layer_start
        self.cache.write(layer, self.slot_mapping, k, v)
        kc = gather_blocks(self.cache.k[layer], self.block_tables)[:, :, :self.max_k]
        vc = gather_blocks(self.cache.v[layer], self.block_tables)[:, :, :self.max_k]
        return grouped_sdpa(q, kc, vc, self.mask)


class PagedPrefillContext:
    """Packed new tokens of S prefill groups: write K/V of packed token src[i] to flat slot
    dst[i] (each shared block once, each sample's tail block per sample), then attend. paged
    = (block_tables [S, W], seq_lens [S]) when some group has a cached prefix (its packed
    tokens start past position 0), else None: causal attention over the packed tokens."""

    def __init__(self, cache: PagedKVCache, layer_start: int, packed: PackedInput,
                 src: torch.Tensor, dst: torch.Tensor, paged: tuple | None = None):
        self.cache, self.layer_start = cache, layer_start
        self.src, self.dst, self.paged = src, dst, paged
        self.cu = packed.cu_seqlens
        self.inner = PackedCausalAttention(packed)

    def attend(self, layer_idx: int, q, k, v, spec=None) -> torch.Tensor:
        _plain_only(spec)
        layer = layer_idx - self.layer_start
        self.cache.write(layer, self.dst, k.index_select(0, self.src),
                         v.index_select(0, self.src))
        if self.paged is None:
            return self.inner.attend(layer_idx, q, k, v)
        block_tables, seq_lens = self.paged
        return paged_prefill_attention(q, self.cache.k[layer], self.cache.v[layer],
                                       block_tables, self.cu, seq_lens)


def _plain_only(spec) -> None:
    """A layer with a window, a soft-cap or its own scale (models.features: Mistral, Gemma)
    passes a spec; the paged contexts attend plainly only."""
    if spec is not None:
        raise ValueError("kv_layout=paged does not support sliding-window or soft-capped "
                         "attention yet (Mistral, Gemma): use kv_layout=static")
