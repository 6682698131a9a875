"""Split-KV decode attention over the rollout's KV cache, in Triton (flash-decoding with GQA).

    decode_attention(q, k_cache, v_cache, slots, seqlens) -> [B, h_q, d]
    decode_attention_rope(q, k_new, v_new, cos, sin, k_cache, v_cache, slots, slot_positions)

q [B, h_q, d] holds one query token per row; row b attends to the first seqlens[b] tokens of
cache slot slots[b] of the per-layer cache [num_slots + 1, max_model_len, h_kv, d]
(rollout/kv_cache.py). Softmax scale 1/sqrt(d) unless given; query head h reads K/V head
h // (h_q / h_kv). A layer's AttentionSpec (models.features: Gemma's query scale, logit
soft-cap, sliding window) enters as scale / softcap / window (0: none): the cap bends each
score (cap·tanh(s/cap), in fp32) and a window starts each row's key loop at its first visible
key, so windowed layers read only the window.
The _rope form is the whole attention of a decode step in one launch: it takes q and the new
K/V straight from the qkv projection, applies RoPE to q and k_new, writes k_new / v_new at the
slot's position and counts that token from registers while it reads the cached prefix (on an
H200 it replaced a RoPE and a cache-write kernel per layer: 1.5 + 1.4 µs, bench/RESULTS.md).
On Hopper and later it is launched with programmatic dependent launch: its programs start
while the qkv projection drains, read the slots and positions, ask L2 for the first tiles
of their cached K/V, and wait on the device for the projection's output (_split_kernel).

The tile and launch settings (keys per tile, warps, stages, PDL, L2 prefetch) are arguments of
the launchers, with the defaults of kernels.settings.RolloutKernelSettings (where they are
documented and measured): the rollout passes its engine's settings.

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

from hybridengine.kernels.settings import DEFAULT_KERNEL_SETTINGS as _DEFAULT

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU machines without triton: the SDPA / flash backends remain
    triton = None

# Not taken (H200, bench/RESULTS.md 2026-11-30 sessions 4 and 5, with the default launch
# settings): one program reading two K/V heads side by side (256 contiguous bytes per token
# instead of 128) took 25.4 against 25.0 µs per layer.
MIN_GROUP_ROWS = 16          # tl.dot needs at least 16 rows: the G query heads are padded


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on this device can be launched with programmatic dependent launch
    (CUDA, Hopper or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def available(device: torch.device) -> bool:
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _prefetch_l2(row, pos, last, stride_t):
        """Asks L2 for the first 128-byte line of one head's cached row at each position in
        pos (the whole row at d = 64 in 16-bit types), holding no register for the data;
        positions past `last` ask for position 0's. PTX: CUDA only, not the interpreter."""
        prefetch_l2_lines(row + tl.where(pos <= last, pos, 0).to(tl.int64) * stride_t)

    @triton.jit
    def prefetch_l2_lines(ptr):
        """Asks L2 for the 128-byte line at each address of ptr, holding no register for the
        data (PTX: CUDA only, not the interpreter). Also the paged kernel's."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptr],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def rope_new_token(q, q_ptr, g_ok, dd, cos, sin, k_ptr, v_ptr, K, V,
                       HEAD_DIM: tl.constexpr):
        """Rotate-half RoPE of the step's q [G, d] (loaded from q_ptr) and of the new key at
        k_ptr (x·cos + [x₂, x₁]·sin, the fp32 tables already rounded to q's dtype as apply_rope
        does; one rounding at the end): (q rotated, k_new and v_new in the cache's dtypes). The
        fused forms of both decode kernels (this one and paged_decode_attention's)."""
        swap = (dd + HEAD_DIM // 2) % HEAD_DIM
        q_sw = tl.load(q_ptr + swap[None, :], mask=g_ok[:, None], other=0.0)
        q = (q.to(tl.float32) * cos[None, :] + q_sw.to(tl.float32) * sin[None, :]).to(q.dtype)
        k_new = tl.load(k_ptr + dd).to(tl.float32) * cos + \
            tl.load(k_ptr + swap).to(tl.float32) * sin
        return q, k_new.to(K.dtype.element_ty), tl.load(v_ptr + dd).to(V.dtype.element_ty)

    @triton.jit
    def capped(s, softcap, SOFTCAP: tl.constexpr):
        """cap·tanh(s/cap) (tanh as 2·sigmoid(2x) − 1), or s."""
        if SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        return s

    @triton.jit
    def _split_kernel(Q, K, V, Slots, Lens, Out, Lse, KNew, VNew, Cos, Sin, sm_scale, max_len,
                      softcap, window,
                      stride_qb, stride_qh, stride_ks, stride_kt, stride_kh,
                      stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cb, stride_sb,
                      GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      NEW_TOKEN: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                      PREFETCH_KEYS: tl.constexpr, SOFTCAP: tl.constexpr,
                      WINDOW: tl.constexpr):
        b = tl.program_id(0)
        j = tl.program_id(1)
        s = tl.program_id(2)
        slot = tl.load(Slots + b).to(tl.int64)
        if NEW_TOKEN:   # Lens: the position of each slot's new token (written at ≤ max_len - 1)
            seqlen = tl.minimum(tl.load(Lens + slot) + 1, max_len).to(tl.int32)
        else:           # Lens: each row's number of cached tokens
            seqlen = tl.load(Lens + b)
        g = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, HEAD_DIM)
        heads = j * GROUP + g
        g_ok = g < GROUP
        k_row = K + slot * stride_ks + j * stride_kh            # V has K's strides
        v_row = V + slot * stride_ks + j * stride_kh
        # this split's cached keys [start, stop): with NEW_TOKEN the last position is the new
        # token's, counted from registers below
        end = seqlen - 1 if NEW_TOKEN else seqlen
        start = s * SPLIT_LEN
        stop = tl.minimum(start + SPLIT_LEN, end)
        if WINDOW:      # the query sits at seqlen - 1 and sees keys after seqlen - 1 - window
            start = tl.maximum(start, seqlen - window)
        if PDL:
            # Launched programmatically: this program may run while the kernel before it (the
            # qkv projection, or a kernel of its epilogue) drains. Only state written before
            # this decode step began is read above (the row's slot, the slot's position) and
            # prefetched (the cached prefix); everything computed in the step (q, k_new, v_new,
            # the RoPE tables) waits.
            if PREFETCH_KEYS > 0:
                first = start + tl.arange(0, PREFETCH_KEYS)
                _prefetch_l2(k_row, first, stop - 1, stride_kt)
                _prefetch_l2(v_row, first, stop - 1, stride_kt)
            tl.extra.cuda.gdc_wait()
        if NEW_TOKEN:
            cos = tl.load(Cos + b * stride_cb + dd).to(Q.dtype.element_ty).to(tl.float32)
            sin = tl.load(Sin + b * stride_sb + dd).to(Q.dtype.element_ty).to(tl.float32)
        q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh
        q = tl.load(q_ptr + dd[None, :], mask=g_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        if NEW_TOKEN:
            # RoPE of q and of the new key, the new K/V written to the cache at position
            # seqlen - 1, and the new token counted from registers: the loop below reads only
            # the cached prefix, so no program reads what another writes.
            q, k_new, v_new = rope_new_token(q, q_ptr, g_ok, dd, cos, sin,
                                             KNew + b * stride_knb + j * stride_knh,
                                             VNew + b * stride_vnb + j * stride_vnh, K, V,
                                             HEAD_DIM)
            if s == 0:                  # the first split holds the new token
                at = (seqlen - 1).to(tl.int64) * stride_kt
                tl.store(k_row + at + dd, k_new)
                tl.store(v_row + at + dd, v_new)
                m_i = capped(tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1)
                             * sm_scale, softcap, SOFTCAP)
                l_i = tl.full([BLOCK_G], 1.0, tl.float32)
                acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32) + v_new.to(tl.float32)[None, :]
        for n0 in range(start, stop, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            p_ok = pos < stop
            kv_off = pos[:, None].to(tl.int64) * stride_kt + dd[None, :]
            k = tl.load(k_row + kv_off, mask=p_ok[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * sm_scale
            qk = capped(qk, softcap, SOFTCAP)
            qk = tl.where(p_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)            # m_new is finite: every tile has a valid key
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_row + kv_off, mask=p_ok[:, None], other=0.0)
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv.to(tl.float32)
            m_i = m_new
        # An empty split (start >= its end) leaves l_i = 0: output 0, log-sum-exp -inf.
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


def split_len(rows: int, kv_heads: int, max_len: int, num_sms: int,
              block_n: int = _DEFAULT.decode_block_n) -> int:
    """Keys per split: enough splits that rows·kv_heads·splits fills ~2 programs per SM, never
    under one tile of block_n keys. A function of static shapes only (CUDA graphs)."""
    want = max(1, math.ceil(2 * num_sms / max(1, rows * kv_heads)))
    splits = min(want, math.ceil(max_len / block_n))
    return math.ceil(math.ceil(max_len / splits) / block_n) * block_n


def stride_or_zero(t: torch.Tensor, dim: int) -> int:
    """t.stride(dim), or 0 where that dimension has size 1. Torch leaves the stride of a size-1
    dimension arbitrary: at decode batch 1, k and v, [1, h_kv, d] views of the qkv projection's
    one row, have batch strides (h_q + h_kv)·d and h_kv·d. A kernel only ever multiplies it by
    index 0; 0 (divisible by 16, as the strides of larger sizes are) keeps Triton's
    specialisation of the kernel the one the other sizes use."""
    return t.stride(dim) if t.shape[dim] > 1 else 0


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy when its last dimension is strided (never from the decoder,
    whose q/k/v views and RoPE tables all have unit stride there)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _new_token_args(new, B: int, hkv: int, d: int) -> tuple[tuple, tuple]:
    """The fused form's (k_new, v_new, cos, sin) with a unit last stride, and their row / head
    strides for the kernel: each tensor has its own (no layout shared between them is
    assumed), with stride_or_zero for dimensions of size 1."""
    k_new, v_new, cos, sin = (_unit_last(t) for t in new)
    if k_new.shape != (B, hkv, d) or v_new.shape != (B, hkv, d) or \
            cos.shape != (B, d) or sin.shape != (B, d):
        raise ValueError(f"triton decode attention: k_new / v_new must be [B, h_kv, d] = "
                         f"{[B, hkv, d]} and cos / sin [B, d]; got {list(k_new.shape)}, "
                         f"{list(v_new.shape)}, {list(cos.shape)}, {list(sin.shape)}")
    strides = (stride_or_zero(k_new, 0), stride_or_zero(k_new, 1), stride_or_zero(v_new, 0),
               stride_or_zero(v_new, 1), stride_or_zero(cos, 0), stride_or_zero(sin, 0))
    return (k_new, v_new, cos, sin), strides


def _launch(q, k_cache, v_cache, slots, lens, new=None, *, block_n: int, num_warps: int,
            num_stages: int, pdl: bool = False,
            prefetch_keys: int = _DEFAULT.decode_prefetch_keys, scale: float = 0.0,
            softcap: float = 0.0, window: int = 0) -> torch.Tensor:
    """The split kernel (+ merge) over the cache; new = (k_new, v_new, cos, sin) fuses RoPE,
    the cache write and the new token (see decode_attention_rope). Inputs of any strides are
    taken (those of size-1 dimensions ignored); q and the new tensors are copied only if
    strided along d. Every choice here reads shapes and strides, never device data: nothing
    synchronises, and the same launch is captured in a CUDA graph. block_n, num_warps,
    num_stages, pdl, prefetch_keys: kernels.settings.RolloutKernelSettings's decode_* and pdl.
    scale, softcap, window: a layer's AttentionSpec (0: the default scale, no cap, no window)."""
    B, hq, d = q.shape
    hkv, max_len = k_cache.shape[2], k_cache.shape[1]
    if not supports(hq, hkv, d):
        raise ValueError(f"triton decode attention needs h_q % h_kv == 0 and a power-of-two "
                         f"head_dim >= 16 (h_q={hq}, h_kv={hkv}, head_dim={d})")
    cache_strides = tuple(stride_or_zero(k_cache, i) for i in range(3))
    v_strides = tuple(stride_or_zero(v_cache, i) for i in range(3))
    # the caches are written in place (no copy can stand in): KVCache allocates K and V alike
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != d or k_cache.stride(3) != 1 or \
            v_cache.stride(3) != 1 or cache_strides != v_strides:
        raise ValueError("triton decode attention needs K and V caches of one shape and layout "
                         "with a contiguous last dimension")
    group, fused = hq // hkv, new is not None
    # K and V tiles of block_n keys, num_stages deep, must fit in shared memory: at head_dim
    # 256 (Gemma 2) the tiles of the default 64 keys would take ~192 KB
    block_n = min(block_n, max(16, block_n * 128 // d))
    q = _unit_last(q)             # rows and heads may be strided (q a view of the fused qkv)
    # the fused form on Hopper+, whose slot positions are the runner's state from earlier
    # steps; not in the interpreter, nor for the plain form, whose lengths come from the step
    pdl = pdl and fused and pdl_supported(q.device)
    length = split_len(B, hkv, max_len, _num_sms(q.device), block_n)
    splits = math.ceil(max_len / length)
    result = torch.empty(B, hq, d, dtype=q.dtype, device=q.device)
    # one split (a large batch fills the GPU alone): the output is final, no merge
    out = result if splits == 1 else \
        torch.empty(B, hq, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, hq, splits, dtype=torch.float32, device=q.device)
    if fused:
        new, new_strides = _new_token_args(new, B, hkv, d)
    else:
        new, new_strides = (q, q, q, q), (0,) * 6               # unused
    _split_kernel[(B, hkv, splits)](
        q, k_cache, v_cache, slots, lens, out, lse, *new,
        scale or 1.0 / math.sqrt(d), max_len, float(softcap), int(window),
        stride_or_zero(q, 0), stride_or_zero(q, 1),
        *cache_strides, *new_strides,
        GROUP=group, BLOCK_G=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_N=block_n, SPLIT_LEN=length, NUM_SPLITS=splits, NEW_TOKEN=fused,
        # fp32 caches get fp32 products (Triton's default for fp32 would be TF32)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl,
        PREFETCH_KEYS=prefetch_keys, SOFTCAP=softcap > 0, WINDOW=window > 0,
        num_warps=num_warps, num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}))
    if splits > 1:
        _merge_kernel[(B * hq,)](out, lse, result, NUM_SPLITS=splits,
                                 SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=d)
    return result


# Custom ops: torch.compile (the rollout's compiled decode step) treats each as one opaque
# node instead of tracing into the launcher (the settings enter it as constants).
@torch.library.custom_op("hybridengine::triton_decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, seqlens: torch.Tensor,
                     block_n: int = _DEFAULT.decode_block_n,
                     num_warps: int = _DEFAULT.decode_num_warps,
                     num_stages: int = _DEFAULT.decode_num_stages, scale: float = 0.0,
                     softcap: float = 0.0, window: int = 0) -> torch.Tensor:
    """Attention of q [B, h_q, d] over the first seqlens[b] >= 1 (int32) cached tokens of
    slots[b] (the caller has written this step's K/V); see the module doc."""
    return _launch(q, k_cache, v_cache, slots, seqlens, block_n=block_n, num_warps=num_warps,
                   num_stages=num_stages, scale=scale, softcap=softcap, window=window)


@decode_attention.register_fake
def _(q, *args, **kwargs):
    return q.new_empty(q.shape)


@torch.library.custom_op("hybridengine::triton_decode_attention_rope",
                         mutates_args=("k_cache", "v_cache"))
def decode_attention_rope(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slots: torch.Tensor,
                          slot_positions: torch.Tensor,
                          block_n: int = _DEFAULT.decode_block_n,
                          num_warps: int = _DEFAULT.decode_num_warps,
                          num_stages: int = _DEFAULT.decode_num_stages,
                          pdl: bool = _DEFAULT.pdl,
                          prefetch_keys: int = _DEFAULT.decode_prefetch_keys,
                          scale: float = 0.0, softcap: float = 0.0,
                          window: int = 0) -> torch.Tensor:
    """One decode step's attention from the unrotated q [B, h_q, d], k_new / v_new [B, h_kv, d]
    (views of the fused qkv projection; any strides, each tensor its own) and the fp32 RoPE
    tables cos, signed sin [B, d]: q and k_new rotated, k_new / v_new written to the cache of
    slots[b] at position p = slot_positions[slots[b]] (clamped to max_model_len - 1), and
    attention over that slot's first min(p + 1, max_model_len) tokens, in one launch. The
    state tensors are read as they are: under torch.compile an input computed in the graph
    would be copied for every call. pdl: programmatic dependent launch where the device has it
    (Hopper+), with prefetch_keys cached keys asked into L2 before the wait."""
    return _launch(q, k_cache, v_cache, slots, slot_positions, (k_new, v_new, cos, sin),
                   block_n=block_n, num_warps=num_warps, num_stages=num_stages, pdl=pdl,
                   prefetch_keys=prefetch_keys, scale=scale, softcap=softcap, window=window)


@decode_attention_rope.register_fake
def _(q, *args, **kwargs):
    return q.new_empty(q.shape)
