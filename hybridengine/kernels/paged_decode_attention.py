"""Split-KV decode attention through block tables (the paged KV cache), in Triton.

    paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale) -> [B, h_q, d]
    paged_decode_attention_rope(q, k_new, v_new, cos, sin, k_cache, v_cache, row_tables,
                                slot_mapping, rows, row_positions, max_k) -> [B, h_q, d]

q [B, h_q, d] holds one query token per row; row b attends to the first seq_lens[b] >= 1
tokens held by the blocks block_tables[b] ([B, W] int32) of the per-layer cache
[num_blocks + 1, block_size, h_kv, d] (rollout/paged_cache.py): key p at [table[p // bs],
p % bs]. Query head h reads K/V head h // (h_q / h_kv). Padding rows: seq_lens 1 over the
scratch block.

The kernel is decode_attention.py's split kernel with the key address taken through the
table: one program per (row, K/V head, split of the keys) computes the G query heads of that
K/V head as the rows of one tile (each K/V byte read once per step), and decode_attention's
merge kernel combines the splits. A tile of BLOCK_N keys loads the block id of each key, so
any block_size works and a tile may straddle blocks. The number of splits is a function of
(B, W) only (enough programs to fill the GPU twice), so a decode step that calls the kernel
can be captured in a CUDA graph; each row's keys are cut into that many equal runs of whole
tiles, so a row far longer than the others (the tail of a long-response batch) spreads over
all of them instead of running its length in one program.

The _rope form is decode_attention_rope's through a table: q and the new key rotated, the new
K/V stored at the row's flat slot slot_mapping[b] (block·block_size + offset; the scratch
block's for a padding row or one that finished on the device), and the new token counted
from registers: the key loop reads only the cached tokens through the table, so no program
reads what another writes. The row's length and block table come from the runner's state by
row id (row_positions[rows[b]] + 1 tokens, at most max_k; row_tables[rows[b]]), as
decode_attention_rope's by slot: state written before the decode step began, and no per-step
gather of the rows' tables. On Hopper and later the kernel is launched with
programmatic dependent launch: before the wait a program reads only that state (its length,
its split's bounds, the first tile's block ids) and asks L2 for the first keys of its split,
so the first K/V loads after the wait depend on no other load.

The key loop loads the block ids of the next tile while the current one computes, so a
tile's K/V loads wait on no table load.

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
    from hybridengine.kernels.decode_attention import prefetch_l2_lines, rope_new_token

    @triton.jit
    def _paged_split_kernel(Q, K, V, Tables, Rows, Lens, Out, Lse, KNew, VNew, Cos, Sin,
                            SlotMap, sm_scale, max_k, stride_qb, stride_qh,
                            stride_kb, stride_kt, stride_kh, stride_tb, stride_knb, stride_knh,
                            stride_vnb, stride_vnh, stride_cb, stride_sb,
                            GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                            NEW_TOKEN: tl.constexpr, PRECISION: tl.constexpr,
                            PDL: tl.constexpr, PREFETCH_KEYS: tl.constexpr):
        b = tl.program_id(0)
        j = tl.program_id(1)
        s = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, HEAD_DIM)
        heads = j * GROUP + g
        g_ok = g < GROUP
        # Everything down to the wait reads state written before the step began (the row ids,
        # the positions and tables by row id), so that under PDL it runs while the kernel
        # before drains and the key loop's first loads depend on no load made after the wait.
        if NEW_TOKEN:   # Lens: the position of each row's new token; Tables: by row id
            row_id = tl.load(Rows + b)
            seqlen = tl.minimum(tl.load(Lens + row_id) + 1, max_k).to(tl.int32)
        else:           # Lens: each row's number of cached tokens; Tables: by b
            row_id = b.to(tl.int64)
            seqlen = tl.load(Lens + b)
        table = Tables + row_id * stride_tb
        # this split's cached keys [start, stop): with NEW_TOKEN the last one is the new
        # token's, counted from registers below, never read through the table. The row's
        # keys are cut into NUM_SPLITS equal runs of whole tiles, so a long row spreads over
        # every split (a short one leaves the last splits empty).
        end = seqlen - 1 if NEW_TOKEN else seqlen
        split_len = tl.cdiv(tl.cdiv(end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = s * split_len
        stop = tl.minimum(start + split_len, end)
        # the block ids of the first tile; each iteration loads the next tile's before it
        # computes, so its K/V loads wait on no table load (masked keys read block 0: any
        # valid address, their scores are set to -inf)
        pos = start + tl.arange(0, BLOCK_N)
        blk = tl.load(table + pos // BLOCK_SIZE, mask=pos < stop, other=0).to(tl.int64)
        if PDL:
            # launched programmatically (see the module doc): the split's first keys are
            # asked into L2 before the wait (a key past the split's end asks for block 0's)
            if PREFETCH_KEYS > 0:
                first = start + tl.arange(0, PREFETCH_KEYS)
                ids = tl.load(table + first // BLOCK_SIZE, mask=first < stop,
                              other=0).to(tl.int64)
                ahead = ids * stride_kb + (first % BLOCK_SIZE).to(tl.int64) * stride_kt + \
                    j * stride_kh
                prefetch_l2_lines(K + ahead)
                prefetch_l2_lines(V + ahead)
            tl.extra.cuda.gdc_wait()
        q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh
        q = tl.load(q_ptr + dd[None, :], mask=g_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        if NEW_TOKEN:
            # As decode_attention's fused form: RoPE of q and the new key, the new K/V stored
            # at the row's flat slot (split 0), the new token counted from registers.
            cos = tl.load(Cos + b * stride_cb + dd).to(Q.dtype.element_ty).to(tl.float32)
            sin = tl.load(Sin + b * stride_sb + dd).to(Q.dtype.element_ty).to(tl.float32)
            q, k_new, v_new = rope_new_token(q, q_ptr, g_ok, dd, cos, sin,
                                             KNew + b * stride_knb + j * stride_knh,
                                             VNew + b * stride_vnb + j * stride_vnh, K, V,
                                             HEAD_DIM)
            if s == 0:
                slot = tl.load(SlotMap + b)
                at = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt + \
                    j * stride_kh
                tl.store(K + at + dd, k_new)
                tl.store(V + at + dd, v_new)
                m_i = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * sm_scale
                l_i = tl.full([BLOCK_G], 1.0, tl.float32)
                acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32) + v_new.to(tl.float32)[None, :]
        for n0 in range(start, stop, BLOCK_N):
            p_ok = pos < stop
            row = blk * stride_kb + (pos % BLOCK_SIZE).to(tl.int64) * stride_kt + j * stride_kh
            kv_off = row[:, None] + dd[None, :]
            pos = pos + BLOCK_N
            blk = tl.load(table + pos // BLOCK_SIZE, mask=pos < stop, other=0).to(tl.int64)
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
        # An empty split (start >= its end) leaves l_i = 0: output 0, log-sum-exp -inf.
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
        row_out = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + s   # [B, h_q, splits]
        tl.store(Out + row_out[:, None] * HEAD_DIM + dd[None, :], out.to(Out.dtype.element_ty),
                 mask=g_ok[:, None])
        tl.store(Lse + row_out, lse, mask=g_ok)


def _launch(q, k_cache, v_cache, block_tables, lens, scale, new=None, *, block_n: int,
            num_warps: int, num_stages: int, pdl: bool = False,
            prefetch_keys: int = _DEFAULT.decode_prefetch_keys) -> torch.Tensor:
    """The split kernel (+ merge). block_tables [B, W] and lens: seq_lens [B] int32; or, with
    new = (k_new, v_new, cos, sin, slot_mapping, rows, max_k) (paged_decode_attention_rope:
    RoPE, the cache write and the new token fused), both by row id: row b's table
    block_tables[rows[b]], its new token at lens[rows[b]]. Reads shapes and strides only
    (nothing synchronises). pdl (the fused form on Hopper+), prefetch_keys: as
    decode_attention's."""
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
    fused = new is not None
    if block_tables.shape[0] != B and not fused or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be [B, W] int32 (B={B}; the fused form's: a row "
                         f"per row id)")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if fused:
        *new, slot_mapping, rows, max_k = new
        if slot_mapping.shape != (B,) or slot_mapping.dtype != torch.int64 or \
                rows.shape != (B,) or rows.dtype != torch.int64 or lens.dtype != torch.int64:
            raise ValueError(f"slot_mapping and rows must be [B] int64 (B={B}) and positions "
                             f"int64")
        new, new_strides = _da._new_token_args(new, B, hkv, d)
        new = (*new, slot_mapping)
    else:
        if lens.shape != (B,) or lens.dtype != torch.int32:
            raise ValueError(f"seq_lens must be [B] int32 (B={B})")
        rows, max_k = lens, 0                                                   # unused
        new, new_strides = (q, q, q, q, lens), (0,) * 6                         # unused
    pdl = pdl and fused and _da.pdl_supported(q.device)
    max_len = W * bs
    splits = math.ceil(max_len / _da.split_len(B, hkv, max_len, _da._num_sms(q.device),
                                                block_n))
    result = torch.empty(B, hq, d, dtype=q.dtype, device=q.device)
    # one split (a large batch fills the GPU alone): the output is final, no merge
    out = result if splits == 1 else \
        torch.empty(B, hq, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, hq, splits, dtype=torch.float32, device=q.device)
    _paged_split_kernel[(B, hkv, splits)](
        q, k_cache, v_cache, block_tables, rows, lens, out, lse, *new, scale, max_k,
        _da.stride_or_zero(q, 0), _da.stride_or_zero(q, 1), k_cache.stride(0),
        k_cache.stride(1), _da.stride_or_zero(k_cache, 2), _da.stride_or_zero(block_tables, 0),
        *new_strides,
        GROUP=hq // hkv, BLOCK_G=max(_da.MIN_GROUP_ROWS, triton.next_power_of_2(hq // hkv)),
        HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_N=block_n, NUM_SPLITS=splits, NEW_TOKEN=fused,
        # fp32 caches get fp32 products (Triton's default for fp32 would be TF32)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl,
        PREFETCH_KEYS=prefetch_keys, num_warps=num_warps, num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}))
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


@torch.library.custom_op("hybridengine::triton_paged_decode_attention_rope",
                         mutates_args=("k_cache", "v_cache"))
def paged_decode_attention_rope(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                                cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, row_tables: torch.Tensor,
                                slot_mapping: torch.Tensor, rows: torch.Tensor,
                                row_positions: torch.Tensor, max_k: int,
                                block_n: int = _DEFAULT.decode_block_n,
                                num_warps: int = _DEFAULT.decode_num_warps,
                                num_stages: int = _DEFAULT.decode_num_stages,
                                pdl: bool = _DEFAULT.pdl,
                                prefetch_keys: int = _DEFAULT.decode_prefetch_keys
                                ) -> torch.Tensor:
    """One decode step's attention from the unrotated q [B, h_q, d], k_new / v_new [B, h_kv, d]
    (views of the fused qkv projection) and the fp32 RoPE tables cos, signed sin [B, d]: q and
    k_new rotated, k_new / v_new written at flat slot slot_mapping[b] (int64), attention over
    the cached tokens and the new token, in one launch; scale 1/sqrt(d). Row b is the runner's
    row rows[b] (int64): its new token sits at position row_positions[rows[b]] (int64), so it
    holds min(that + 1, max_k) tokens, the last one the new token's, in the blocks
    row_tables[rows[b]] (int32, a table per row id). pdl: programmatic dependent launch where
    the device has it (Hopper+), with prefetch_keys keys of each split asked into L2 before
    the wait. See the module doc."""
    return _launch(q, k_cache, v_cache, row_tables, row_positions,
                   1.0 / math.sqrt(q.shape[-1]),
                   (k_new, v_new, cos, sin, slot_mapping, rows, max_k), block_n=block_n,
                   num_warps=num_warps, num_stages=num_stages, pdl=pdl,
                   prefetch_keys=prefetch_keys)


@paged_decode_attention_rope.register_fake
def _(q, *args, **kwargs):
    return q.new_empty(q.shape)
