"""The paged KV cache's device tensors, indexed by the block tables of block_manager.py
(which lends the blocks), with torch reference attention through block tables.

Layout: per layer

    k, v  [num_blocks + 1, block_size, h_kv, d]

Token t of a sequence whose block table is `table` lives at [table[t // block_size],
t % block_size], i.e. at flat slot table[t // block_size]·block_size + t % block_size of the
layer's [(num_blocks + 1)·block_size, h_kv, d] view. The last block is scratch: padding rows of
a CUDA-graph bucket and the unused tail of every block table point there, so a decode step
reads fixed-shape [B, W] tables (W = ceil(max_model_len / block_size)) and stays capturable.
[block, offset] has the shape of kv_cache.py's [slot, position]: kv_cache.write_rows and the
Triton prefill write (kernels/kv_write.py) take (block, offset) for (slot, position) unchanged.

The block manager: rollout/block_manager.py (sharing, the prefix index, admission,
preemption).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridengine.rollout.kv_cache import layer_tensors, write_rows


class PagedKVCache:
    """Device tensors of the paged cache, one K and one V tensor per layer (as KVCache)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks
        self.k, self.v = layer_tensors(num_layers, (num_blocks + 1, block_size, num_kv_heads,
                                                    head_dim), dtype, device)

    @property
    def num_bytes(self) -> int:
        return 2 * sum(t.numel() * t.element_size() for t in self.k)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """slot_mapping [N] int64 flat slots (block·block_size + offset); k, v [N, h_kv, d]."""
        block, offset = slot_mapping // self.block_size, slot_mapping % self.block_size
        write_rows(self.k[layer], self.v[layer], block, offset, k, v)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks + 1, bs, h_kv, d], block_tables [B, W] -> [B, h_kv, W·bs, d] (a copy)."""
    B, W = block_tables.shape
    rows = cache.index_select(0, block_tables.reshape(-1).long())        # [B·W, bs, h_kv, d]
    return rows.view(B, W * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """q [B, h_q, d] (one token per row) over the first seq_lens[b] tokens of row b's blocks
    -> [B, h_q, d]; query head h reads K/V head h // (h_q / h_kv); scale None: 1/sqrt(d). The
    reference: the blocks gathered to [B, h_kv, W·bs, d] under a length mask, SDPA with q
    grouped per K/V head (as rollout.attention.grouped_sdpa, so W·bs = max_k gives its bits)."""
    B, hq, d = q.shape
    k, v = gather_blocks(k_cache, block_tables), gather_blocks(v_cache, block_tables)
    hkv, L = k.shape[1], k.shape[2]
    mask = (torch.arange(L, device=q.device) < seq_lens.unsqueeze(1))[:, None, None, :]
    qg = q.reshape(B, hkv, hq // hkv, d)                                  # [B, h_kv, G, d]
    o = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                       scale=scale)
    return o.reshape(B, hq, d)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Packed new tokens q [T, h_q, d] of S sequences (cu_seqlens_q [S + 1]) whose K/V are in
    the cache already (written before this call); sequence s has seq_lens[s] tokens in all,
    its new ones last, and each new token attends to the cached prefix and the new tokens up
    to itself -> [T, h_q, d]. The reference: one masked SDPA per sequence."""
    out = torch.empty_like(q)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s, L in enumerate(lens):
        n = cu[s + 1] - cu[s]
        if n == 0:
            continue
        k = gather_blocks(k_cache, block_tables[s:s + 1])[0, :, :L]      # [h_kv, L, d]
        v = gather_blocks(v_cache, block_tables[s:s + 1])[0, :, :L]
        qs = q[cu[s]:cu[s + 1]].transpose(0, 1)                           # [h_q, n, d]
        q_pos = torch.arange(L - n, L, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= q_pos[:, None]   # [n, L]
        o = F.scaled_dot_product_attention(qs, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           scale=scale, enable_gqa=k.shape[0] != q.shape[1])
        out[cu[s]:cu[s + 1]] = o.transpose(0, 1)
    return out
