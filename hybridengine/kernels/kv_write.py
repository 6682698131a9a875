"""The prefill's K/V cache write in Triton: packed rows scattered into cache rows.

    write_kv_rows(k_cache, v_cache, dst_slot, dst_pos, k, v, src)

k_cache/v_cache[dst_slot[i], dst_pos[i]] = k/v[src[i]] for every i, where k, v [T, h_kv, d] are
the packed prefill's new keys and values (views of the qkv projection and of the RoPE output:
any row stride, each row's h_kv·d elements contiguous) and the caches [slots + 1, max_model_len,
h_kv, d] are contiguous (rollout/kv_cache.py). One program copies BLOCK_R rows of K and of V,
each row one contiguous vector load and store.

Why a kernel: with the dense (cuDNN) prefill attention, torch's indexing ran this write as a
gather and an index_put kernel per tensor: 10 ms per generate of the rollout benchmark on an
H200 (~50 µs per layer for ~17 MB of traffic; bench/RESULTS.md 2026-11-30 session 6).

Triton is optional (`available`); TRITON_INTERPRET=1 runs the kernel on CPU for the tests.
"""
from __future__ import annotations

import torch

# available: the same condition as the decode kernel's
from hybridengine.kernels.decode_attention import available, stride_or_zero  # noqa: F401

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK_R = 16


if triton is not None:
    @triton.jit
    def _write_kernel(K, V, KC, VC, Src, Slot, Pos, num_rows, stride_k, stride_v, stride_cs,
                      stride_ct, ROW: tl.constexpr, BLOCK_C: tl.constexpr,
                      BLOCK_R: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < num_rows
        src = tl.load(Src + r, mask=r_ok, other=0).to(tl.int64)
        dst = tl.load(Slot + r, mask=r_ok, other=0).to(tl.int64) * stride_cs + \
            tl.load(Pos + r, mask=r_ok, other=0).to(tl.int64) * stride_ct
        c = tl.arange(0, BLOCK_C)
        ok = r_ok[:, None] & (c < ROW)[None, :]
        k = tl.load(K + src[:, None] * stride_k + c[None, :], mask=ok)
        tl.store(KC + dst[:, None] + c[None, :], k.to(KC.dtype.element_ty), mask=ok)
        v = tl.load(V + src[:, None] * stride_v + c[None, :], mask=ok)
        tl.store(VC + dst[:, None] + c[None, :], v.to(VC.dtype.element_ty), mask=ok)


def supports(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> bool:
    """Contiguous caches of one shape and K/V rows whose h_kv·d elements are contiguous (the
    head stride is not looked at when h_kv = 1: torch leaves a size-1 dimension's stride
    arbitrary, and a row of one head is contiguous whatever it says)."""
    h, d = k_cache.shape[2:]
    return k_cache.is_contiguous() and v_cache.is_contiguous() and \
        k_cache.shape == v_cache.shape and all(
            t.shape[1:] == (h, d) and t.stride(2) == 1 and (h == 1 or t.stride(1) == d)
            for t in (k, v))


def write_kv_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, dst_slot: torch.Tensor,
                  dst_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  src: torch.Tensor) -> None:
    """k_cache/v_cache[dst_slot[i], dst_pos[i]] = k/v[src[i]] (see the module doc)."""
    if not supports(k_cache, v_cache, k, v):
        raise ValueError("write_kv_rows needs contiguous caches of one shape and K/V rows of "
                         "h_kv·d contiguous elements")
    n = src.shape[0]
    if n == 0:
        return
    row = k_cache.shape[2] * k_cache.shape[3]
    _write_kernel[(triton.cdiv(n, BLOCK_R),)](
        k, v, k_cache, v_cache, src, dst_slot, dst_pos, n, stride_or_zero(k, 0),
        stride_or_zero(v, 0), k_cache.stride(0), k_cache.stride(1), ROW=row,
        BLOCK_C=triton.next_power_of_2(row), BLOCK_R=BLOCK_R)
