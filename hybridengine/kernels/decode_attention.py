"""Split-KV decode attention over the rollout's KV cache, in Triton (flash-decoding with GQA).

    decode_attention(q, k_cache, v_cache, slots, seqlens) -> [B, h_q, d]
    decode_attention_rope(q, k_new, v_new, cos, sin, k_cache, v_cache, slots, seqlens)

q [B, h_q, d] holds one query token per row; row b attends to the first seqlens[b] tokens of
cache slot slots[b] of the per-layer cache [num_slots + 1, max_model_len, h_kv, d]
(rollout/kv_cache.py). Softmax scale 1/sqrt(d); query head h reads K/V head h // (h_q / h_kv).
The _rope form is the whole attention of a decode step in one launch: it takes q and the new
K/V straight from the qkv projection, applies RoPE to q and k_new, writes k_new / v_new at
position seqlens[b] - 1 and counts that token from registers while it reads the cached prefix
(on an H200 the RoPE and cache-write kernels it replaces took ~6 µs per layer per step,
bench/RESULTS.md).

Why a kernel of our own: on an H200 at batch 256 and ~640 cached tokens (Qwen2.5-0.5B shape,
h_q 14, h_kv 2, d 64), flash-attention's varlen kernel spent ~49 µs per layer per decode step,
where reading the ~84 MB of K/V at HBM bandwidth takes ~18 µs: decode attention was 30% of the
step. Here one program handles one (row, K/V head, split of the keys): the G = h_q/h_kv query
heads sharing the K/V head are the rows of one tile, so each K/V byte is read once per step,
and the keys are cut into splits so that even a small batch fills the GPU. The splits' partial
results (normalised output and log-sum-exp) are merged by a second small kernel; a batch large
enough to fill the GPU alone runs one split, which writes the final output. Shapes depend
only on (B, max_model_len), so the step can be captured in a CUDA graph.

Triton is optional: `available()` says whether it can run here. On CPU, TRITON_INTERPRET=1
(set before this module is imported) runs the same kernels through Triton's interpreter, which
is how CI checks them against SDPA.
"""
from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU machines without triton: the SDPA / flash backends remain
    triton = None

BLOCK_N = 64                 # keys per tile
# Measured on an H200 (bench/RESULTS.md, 2026-11-30 session 4; bench/probes/): at batch 256,
# 640 cached tokens, h_kv 2, d 64, one split with 2 warps and 3 stages took 28.1 µs per layer
# (split + merge, CUDA graph) against 31.5 µs at 2 splits, 4 warps; 72 settings spanned 28-33.
LAUNCH = dict(num_warps=2, num_stages=3)
MIN_GROUP_ROWS = 16          # tl.dot needs at least 16 rows: the G query heads are padded
ROW_BYTES = 256              # bytes of one cached token a program reads (kv_heads_per_program)


def available(device: torch.device) -> bool:
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _split_kernel(Q, K, V, Slots, Seqlens, Out, Lse, KNew, VNew, Cos, Sin, sm_scale,
                      stride_qb, stride_qh, stride_ks, stride_kt, stride_kh,
                      stride_nb, stride_nh, stride_cb,
                      GROUP: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK_G: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, NEW_TOKEN: tl.constexpr,
                      PRECISION: tl.constexpr):
        # One program: row b, K/V heads j·KV_HEADS … j·KV_HEADS + KV_HEADS - 1, one split of
        # the keys. A key tile holds those heads side by side ([BLOCK_N, KV_HEADS·HEAD_DIM],
        # contiguous in the cache); q is block-diagonal ([BLOCK_G, KV_HEADS·HEAD_DIM], query
        # row r holds its head's q in its K/V head's columns, zeros elsewhere), so one dot
        # gives every row's scores against its own head, and in p @ V each row keeps the
        # columns of its own head.
        b = tl.program_id(0)
        j = tl.program_id(1)
        s = tl.program_id(2)
        slot = tl.load(Slots + b).to(tl.int64)
        seqlen = tl.load(Seqlens + b)
        r = tl.arange(0, BLOCK_G)
        c = tl.arange(0, KV_HEADS * HEAD_DIM)
        c_head, c_dim = c // HEAD_DIM, c % HEAD_DIM
        r_ok = r < KV_HEADS * GROUP
        own = (r[:, None] // GROUP == c_head[None, :]) & r_ok[:, None]       # block diagonal
        heads = j * KV_HEADS * GROUP + r                                     # query heads
        q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh
        q = tl.load(q_ptr + c_dim[None, :], mask=own, other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, KV_HEADS * HEAD_DIM], tl.float32)
        cols = (j * KV_HEADS + c_head) * stride_kh + c_dim                   # V has K's strides
        k_row = K + slot * stride_ks + cols
        v_row = V + slot * stride_ks + cols
        if NEW_TOKEN:
            # Rotate-half RoPE of q and of the new key (cos, signed sin as the model's tables:
            # x·cos + [x₂, x₁]·sin, rounded once to the cache dtype), the new K/V written to
            # the cache at position seqlen - 1, and the new token counted from registers: the
            # loop below reads only the cached prefix, so no program reads what another writes.
            swap = (c_dim + HEAD_DIM // 2) % HEAD_DIM
            cos = tl.load(Cos + b * stride_cb + c_dim).to(tl.float32)
            sin = tl.load(Sin + b * stride_cb + c_dim).to(tl.float32)
            q_sw = tl.load(q_ptr + swap[None, :], mask=own, other=0.0)
            q = (q.to(tl.float32) * cos[None, :] + q_sw.to(tl.float32) * sin[None, :]).to(
                q.dtype)
            new_ptr = KNew + b * stride_nb + (j * KV_HEADS + c_head) * stride_nh
            k_new = tl.load(new_ptr + c_dim).to(tl.float32) * cos + \
                tl.load(new_ptr + swap).to(tl.float32) * sin
            k_new = k_new.to(K.dtype.element_ty)
            v_new = tl.load(VNew + b * stride_nb + (j * KV_HEADS + c_head) * stride_nh +
                            c_dim).to(V.dtype.element_ty)
            if s == 0:                  # the first split holds the new token
                at = (seqlen - 1).to(tl.int64) * stride_kt
                tl.store(k_row + at, k_new)
                tl.store(v_row + at, v_new)
                m_i = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * sm_scale
                l_i = tl.full([BLOCK_G], 1.0, tl.float32)
                acc = acc + v_new.to(tl.float32)[None, :]
            end = seqlen - 1
        else:
            end = seqlen
        start = s * SPLIT_LEN
        stop = tl.minimum(start + SPLIT_LEN, end)
        for n0 in range(start, stop, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            p_ok = pos < stop
            kv_off = pos[:, None].to(tl.int64) * stride_kt
            k = tl.load(k_row[None, :] + kv_off, mask=p_ok[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * sm_scale
            qk = tl.where(p_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)            # m_new is finite: every tile has a valid key
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_row[None, :] + kv_off, mask=p_ok[:, None], other=0.0)
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv.to(tl.float32)
            m_i = m_new
        # An empty split (start >= its end) leaves l_i = 0: output 0, log-sum-exp -inf.
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
        hq = GROUP * KV_HEADS * tl.num_programs(1)
        row = (b * hq + heads) * NUM_SPLITS + s                             # [B, h_q, splits]
        tl.store(Out + row[:, None] * HEAD_DIM + c_dim[None, :], out.to(Out.dtype.element_ty),
                 mask=own)
        tl.store(Lse + row, lse, mask=r_ok)

    @triton.jit
    def _merge_kernel(Out, Lse, Result, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                      HEAD_DIM: tl.constexpr):
        bh = tl.program_id(0)                      # row·h_q + head
        sp = tl.arange(0, SPLITS_P2)
        dd = tl.arange(0, HEAD_DIM)
        s_ok = sp < NUM_SPLITS
        lse = tl.load(Lse + bh * NUM_SPLITS + sp, mask=s_ok, other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, 0))           # split 0 always holds a key: max is finite
        part = tl.load(Out + (bh * NUM_SPLITS + sp)[:, None] * HEAD_DIM + dd[None, :],
                       mask=s_ok[:, None], other=0.0)
        res = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
        tl.store(Result + bh * HEAD_DIM + dd, res.to(Result.dtype.element_ty))


def supports(q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel handles this head shape (GQA groups; a power-of-two head_dim >= 16,
    the smallest tile tl.dot takes)."""
    return q_heads % kv_heads == 0 and head_dim >= 16 and not head_dim & (head_dim - 1)


def kv_heads_per_program(kv_heads: int, head_dim: int, element_size: int) -> int:
    """K/V heads one program reads side by side: enough for ROW_BYTES contiguous bytes per
    cached token, a power of two dividing kv_heads."""
    n = 1
    while n * head_dim * element_size < ROW_BYTES and kv_heads % (2 * n) == 0:
        n *= 2
    return n


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def split_len(rows: int, programs_per_row: int, max_len: int, num_sms: int) -> int:
    """Keys per split: enough splits that rows·programs_per_row·splits fills ~2 programs per
    SM, never under one tile. A function of static shapes only (CUDA graphs)."""
    want = max(1, math.ceil(2 * num_sms / max(1, rows * programs_per_row)))
    splits = min(want, math.ceil(max_len / BLOCK_N))
    return math.ceil(math.ceil(max_len / splits) / BLOCK_N) * BLOCK_N


def _launch(q, k_cache, v_cache, slots, seqlens, new=None) -> torch.Tensor:
    """The split kernel (+ merge) over the cache; new = (k_new, v_new, cos, sin) fuses RoPE,
    the cache write and the new token (see decode_attention_rope)."""
    B, hq, d = q.shape
    hkv, max_len = k_cache.shape[2], k_cache.shape[1]
    if not supports(hq, hkv, d):
        raise ValueError(f"triton decode attention needs h_q % h_kv == 0 and a power-of-two "
                         f"head_dim >= 16 (h_q={hq}, h_kv={hkv}, head_dim={d})")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("triton decode attention needs K and V caches of one contiguous layout")
    group = hq // hkv
    if q.stride(2) != 1:          # rows and heads may be strided (q a view of the fused qkv)
        q = q.contiguous()
    per_program = kv_heads_per_program(hkv, d, k_cache.element_size())
    length = split_len(B, hkv // per_program, max_len, _num_sms(q.device))
    splits = math.ceil(max_len / length)
    result = torch.empty(B, hq, d, dtype=q.dtype, device=q.device)
    # one split (a large batch fills the GPU alone): the output is final, no merge
    out = result if splits == 1 else \
        torch.empty(B, hq, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, hq, splits, dtype=torch.float32, device=q.device)
    if new is None:
        k_new = v_new = cos = sin = q                       # unused
        new_strides = (0, 0, 0)
    else:
        k_new, v_new, cos, sin = new
        if k_new.stride() != v_new.stride() or k_new.stride(2) != 1 or \
                cos.stride() != sin.stride() or cos.stride(1) != 1:
            raise ValueError("triton decode attention: new K/V (and cos/sin) need one layout "
                             "with a contiguous last dimension")
        new_strides = (k_new.stride(0), k_new.stride(1), cos.stride(0))
    _split_kernel[(B, hkv // per_program, splits)](
        q, k_cache, v_cache, slots, seqlens, out, lse, k_new, v_new, cos, sin,
        1.0 / math.sqrt(d), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), *new_strides, GROUP=group, KV_HEADS=per_program,
        BLOCK_G=max(MIN_GROUP_ROWS, triton.next_power_of_2(group * per_program)), HEAD_DIM=d,
        BLOCK_N=BLOCK_N, SPLIT_LEN=length, NUM_SPLITS=splits, NEW_TOKEN=new is not None,
        # fp32 caches get fp32 products (Triton's default for fp32 would be TF32)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **LAUNCH)
    if splits > 1:
        _merge_kernel[(B * hq,)](out, lse, result, NUM_SPLITS=splits,
                                 SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=d)
    return result


# Custom ops: torch.compile (the rollout's compiled decode step) treats each as one opaque
# node instead of tracing into the launcher.
@torch.library.custom_op("hybridengine::triton_decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
    """Attention of q [B, h_q, d] over the first seqlens[b] >= 1 cached tokens of slots[b]
    (the caller has written this step's K/V); see the module doc."""
    return _launch(q, k_cache, v_cache, slots, seqlens)


@decode_attention.register_fake
def _(q, k_cache, v_cache, slots, seqlens):
    return q.new_empty(q.shape)


@torch.library.custom_op("hybridengine::triton_decode_attention_rope",
                         mutates_args=("k_cache", "v_cache"))
def decode_attention_rope(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slots: torch.Tensor,
                          seqlens: torch.Tensor) -> torch.Tensor:
    """One decode step's attention from the unrotated q [B, h_q, d], k_new / v_new [B, h_kv, d]
    (views of the fused qkv projection) and the RoPE tables cos, signed sin [B, d]: q and k_new
    rotated, k_new / v_new written to the cache at position seqlens[b] - 1 of slots[b], and
    attention over that slot's first seqlens[b] tokens, in one launch."""
    return _launch(q, k_cache, v_cache, slots, seqlens, (k_new, v_new, cos, sin))


@decode_attention_rope.register_fake
def _(q, k_new, v_new, cos, sin, k_cache, v_cache, slots, seqlens):
    return q.new_empty(q.shape)
