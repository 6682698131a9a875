"""Split-KV decode attention over the rollout's KV cache, in Triton (flash-decoding with GQA).

    decode_attention(q, k_flat, v_flat, slots, seqlens, max_model_len) -> [B, h_q, d]

q [B, h_q, d] holds one query token per row; row b attends to the first seqlens[b] tokens of
cache slot slots[b], i.e. rows slots[b]·max_model_len + t of the flat per-layer cache
[(num_slots + 1)·max_model_len, h_kv, d] (rollout/kv_cache.py). Softmax scale 1/sqrt(d); query
head h reads K/V head h // (h_q / h_kv).

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


def available(device: torch.device) -> bool:
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _split_kernel(Q, K, V, Slots, Seqlens, Out, Lse, max_len, sm_scale,
                      stride_qb, stride_qh, stride_kt, stride_kh,
                      GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      PRECISION: tl.constexpr):
        b = tl.program_id(0)
        j = tl.program_id(1)
        s = tl.program_id(2)
        slot = tl.load(Slots + b).to(tl.int64)
        seqlen = tl.load(Seqlens + b)
        g = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, HEAD_DIM)
        heads = j * GROUP + g
        g_ok = g < GROUP
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + dd[None, :],
                    mask=g_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        start = s * SPLIT_LEN
        stop = tl.minimum(start + SPLIT_LEN, seqlen)
        for n0 in range(start, stop, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            p_ok = pos < stop
            rows = slot * max_len + pos
            kv_off = rows[:, None] * stride_kt + j * stride_kh + dd[None, :]
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
        row = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + s     # [B, h_q, splits]
        tl.store(Out + row[:, None] * HEAD_DIM + dd[None, :], out.to(Out.dtype.element_ty),
                 mask=g_ok[:, None])
        tl.store(Lse + row, lse, mask=g_ok)

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


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def split_len(rows: int, kv_heads: int, max_len: int, num_sms: int) -> int:
    """Keys per split: enough splits that rows·kv_heads·splits fills ~2 programs per SM, never
    under one tile. A function of static shapes only (CUDA graphs)."""
    want = max(1, math.ceil(2 * num_sms / max(1, rows * kv_heads)))
    splits = min(want, math.ceil(max_len / BLOCK_N))
    return math.ceil(math.ceil(max_len / splits) / BLOCK_N) * BLOCK_N


# A custom op: torch.compile (the rollout's compiled decode step) treats it as one opaque node
# instead of tracing into the launcher.
@torch.library.custom_op("hybridengine::triton_decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                     slots: torch.Tensor, seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
    """See the module doc. seqlens >= 1 for every row (padding rows attend to their own slot)."""
    B, hq, d = q.shape
    hkv = k_flat.shape[1]
    if not supports(hq, hkv, d):
        raise ValueError(f"triton decode attention needs h_q % h_kv == 0 and a power-of-two "
                         f"head_dim >= 16 (h_q={hq}, h_kv={hkv}, head_dim={d})")
    group = hq // hkv
    if q.stride(2) != 1:          # rows and heads may be strided (q a view of the fused qkv)
        q = q.contiguous()
    length = split_len(B, hkv, max_len, _num_sms(q.device))
    splits = math.ceil(max_len / length)
    result = torch.empty(B, hq, d, dtype=q.dtype, device=q.device)
    # one split (a large batch fills the GPU alone): the output is final, no merge
    out = result if splits == 1 else \
        torch.empty(B, hq, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, hq, splits, dtype=torch.float32, device=q.device)
    _split_kernel[(B, hkv, splits)](
        q, k_flat, v_flat, slots, seqlens, out, lse, max_len, 1.0 / math.sqrt(d),
        q.stride(0), q.stride(1), k_flat.stride(0), k_flat.stride(1),
        GROUP=group, BLOCK_G=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_N=BLOCK_N, SPLIT_LEN=length, NUM_SPLITS=splits,
        # fp32 caches get fp32 products (Triton's default for fp32 would be TF32)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **LAUNCH)
    if splits > 1:
        _merge_kernel[(B * hq,)](out, lse, result, NUM_SPLITS=splits,
                                 SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=d)
    return result


@decode_attention.register_fake
def _(q, k_flat, v_flat, slots, seqlens, max_len):
    return q.new_empty(q.shape)
