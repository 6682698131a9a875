"""Split-KV decode attention through block tables (the paged KV cache), in Triton.

    paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale) -> [B, h_q, d]

q [B, h_q, d] holds one query token per row; row b attends to the first seq_lens[b] >= 1
tokens held by the blocks block_tables[b] ([B, W] int32) of the per-layer cache
[num_blocks + 1, block_size, h_kv, d] (rollout/paged_cache.py): key p at [table[p // bs],
p % bs]. Query head h reads K/V head h // (h_q / h_kv). Padding rows: seq_lens 1 over the
scratch block.

The kernel is decode_attention.py's split kernel with the key address taken through the
table: one program per (row, K/V head, split of the keys) computes the G query heads of that
K/V head as the rows of one tile (each K/V byte read once per step), and decode_attention's
merge kernel combines the splits. A tile of BLOCK_N keys loads the block id of each key, so
any block_size works and a tile may straddle blocks (not measured on a GPU yet). Splits are cut from W·block_size, a static shape, so the launch depends on (B, W)
only and a decode step that calls it can be captured in a CUDA graph.

Triton is optional: decode_attention.available() says whether it runs (CUDA, or the CPU
interpreter under TRITON_INTERPRET=1, set before the import: how the tests check it against
paged_cache.paged_decode_attention).
"""
from __future__ import annotations

import math

import torch

from hybridengine.kernels import decode_attention as _da
from hybridengine.kernels.settings import DEFAULT_KERNEL_SETTINGS as _DEFAULT

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:
    @triton.jit
    def _paged_split_kernel(Q, K, V, Tables, Lens, Out, Lse, sm_scale,
                            stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb,
                            GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr,
                            NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr):
        b = tl.program_id(0)
        j = tl.program_id(1)
        s = tl.program_id(2)
        seqlen = tl.load(Lens + b)
        g = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, HEAD_DIM)
        heads = j * GROUP + g
        g_ok = g < GROUP
        table = Tables + b.to(tl.int64) * stride_tb
        start = s * SPLIT_LEN
        stop = tl.minimum(start + SPLIT_LEN, seqlen)
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + dd[None, :],
                    mask=g_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for n0 in range(start, stop, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            p_ok = pos < stop
            # masked keys read block 0: any valid address, their scores are set to -inf
            blk = tl.load(table + pos // BLOCK_SIZE, mask=p_ok, other=0).to(tl.int64)
            row = blk * stride_kb + (pos % BLOCK_SIZE).to(tl.int64) * stride_kt + j * stride_kh
            kv_off = row[:, None] + dd[None, :]
            k = tl.load(K + kv_off, mask=p_ok[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * sm_scale
            qk = tl.where(p_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)            # m_new is finite: every tile has a valid key
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + kv_off, mask=p_ok[:, None], other=0.0)
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv.to(tl.float32)
            m_i = m_new
        # An empty split (start >= seqlen) leaves l_i = 0: output 0, log-sum-exp -inf.
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
        row_out = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + s   # [B, h_q, splits]
        tl.store(Out + row_out[:, None] * HEAD_DIM + dd[None, :], out.to(Out.dtype.element_ty),
                 mask=g_ok[:, None])
        tl.store(Lse + row_out, lse, mask=g_ok)


def _launch(q, k_cache, v_cache, block_tables, seq_lens, scale, *, block_n: int,
            num_warps: int, num_stages: int) -> torch.Tensor:
    """The split kernel (+ merge). Reads shapes and strides only (nothing synchronises)."""
    B, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    W = block_tables.shape[1]
    if not _da.supports(hq, hkv, d):
        raise ValueError(f"triton paged decode attention needs h_q % h_kv == 0 and a "
                         f"power-of-two head_dim >= 16 (h_q={hq}, h_kv={hkv}, head_dim={d})")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != d or \
            k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("triton paged decode attention needs K and V caches of one shape and "
                         "layout with a contiguous last dimension")
    if block_tables.shape[0] != B or seq_lens.shape != (B,) or \
            block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"block_tables must be [B, W] int32 and seq_lens [B] int32 (B={B})")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    max_len = W * bs
    length = _da.split_len(B, hkv, max_len, _da._num_sms(q.device), block_n)
    splits = math.ceil(max_len / length)
    result = torch.empty(B, hq, d, dtype=q.dtype, device=q.device)
    # one split (a large batch fills the GPU alone): the output is final, no merge
    out = result if splits == 1 else \
        torch.empty(B, hq, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, hq, splits, dtype=torch.float32, device=q.device)
    _paged_split_kernel[(B, hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, lse, scale,
        _da.stride_or_zero(q, 0), _da.stride_or_zero(q, 1), k_cache.stride(0),
        k_cache.stride(1), _da.stride_or_zero(k_cache, 2), _da.stride_or_zero(block_tables, 0),
        GROUP=hq // hkv, BLOCK_G=max(_da.MIN_GROUP_ROWS, triton.next_power_of_2(hq // hkv)),
        HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_N=block_n, SPLIT_LEN=length, NUM_SPLITS=splits,
        # fp32 caches get fp32 products (Triton's default for fp32 would be TF32)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        _da._merge_kernel[(B * hq,)](out, lse, result, NUM_SPLITS=splits,
                                    SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=d)
    return result


# A custom op, as decode_attention's: one opaque node under torch.compile.
@torch.library.custom_op("hybridengine::triton_paged_decode_attention", mutates_args=())
def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float | None = None,
                           block_n: int = _DEFAULT.decode_block_n,
                           num_warps: int = _DEFAULT.decode_num_warps,
                           num_stages: int = _DEFAULT.decode_num_stages) -> torch.Tensor:
    """Attention of q [B, h_q, d] over the first seq_lens[b] >= 1 (int32) tokens in the blocks
    block_tables[b] (int32); scale None: 1/sqrt(d). See the module doc."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _launch(q, k_cache, v_cache, block_tables, seq_lens, scale, block_n=block_n,
                   num_warps=num_warps, num_stages=num_stages)


@paged_decode_attention.register_fake
def _(q, *args, **kwargs):
    return q.new_empty(q.shape)
