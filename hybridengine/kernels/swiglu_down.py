"""The MLP's down projection with the SwiGLU folded into its operand load, in Triton.

    swiglu_down(gate_up, weight, splits) -> [splits, M, N] fp32 partial sums, or [M, N] in
                                             gate_up's dtype when splits == 1

gate_up [M, 2F] holds the gate and up projections side by side (models.decoder.MLP's fused
column layer), weight [N, F] the down projection; the result is silu(gate)·up @ weightᵀ. The
product silu(g)·u is computed in fp32 from the bf16 projections and rounded once to their
dtype before the matmul, as inductor's fused SwiGLU kernel stores it, so the numbers are those
of the unfused MLP up to the matmul's summation order.

Why: in the rollout's decode step (M = 256 rows, Qwen2.5-0.5B: F 4864, N 896) the unfused MLP
tail is three kernels per layer (SwiGLU 3.1 µs, cuBLAS split-K matmul 7.5 µs and its reduce
kernel 2.4 µs on an H200, bench/RESULTS.md session 7); here it is one. With splits > 1 each
program sums one slice of F and writes its fp32 partial; the caller's sum over splits is an
elementwise op that torch.compile fuses into the residual add and RMSNorm which follow.

Triton is optional: `available()` says whether it can run (CUDA, or TRITON_INTERPRET=1 on the
CPU, which is how CI checks it against the unfused MLP).
"""
from __future__ import annotations

import torch

from hybridengine.kernels.decode_attention import available  # noqa: F401  (same condition)

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by the problem's rows; set from bench/probes/
# swiglu_down.py's sweep on an H200 (bench/RESULTS.md)
SMALL_M = 512                # at most this many rows: the decode step's settings
DECODE_CONFIG = (64, 64, 64, 4, 4)
PREFILL_CONFIG = (128, 128, 64, 8, 3)


if triton is not None:
    @triton.jit
    def _swiglu_down_kernel(GU, W, Out, M, N, F, stride_gm, stride_wn, stride_os,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            K_SPLIT: tl.constexpr, GROUP_M: tl.constexpr,
                            EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
        pid = tl.program_id(0)
        s = tl.program_id(1)
        # programs that share weight columns run side by side (L2 reuse of the weight tile)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = s * K_SPLIT + tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        g_ptr = GU + rm[:, None].to(tl.int64) * stride_gm + rk[None, :]
        w_ptr = W + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]          # [K, N] tile
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K_SPLIT, BLOCK_K):
            if EVEN_K:
                g = tl.load(g_ptr, mask=m_ok[:, None], other=0.0)
                u = tl.load(g_ptr + F, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_ptr, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = (rk + k0) < F
                g = tl.load(g_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                u = tl.load(g_ptr + F, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            gf = g.to(tl.float32)
            a = (gf * tl.sigmoid(gf) * u.to(tl.float32)).to(g.dtype)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            g_ptr += BLOCK_K
            w_ptr += BLOCK_K
        out = Out + s * stride_os + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(out, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _config(rows: int) -> tuple:
    return DECODE_CONFIG if rows <= SMALL_M else PREFILL_CONFIG


def launch(gate_up: torch.Tensor, weight: torch.Tensor, splits: int,
           config: tuple | None = None) -> torch.Tensor:
    M, two_f = gate_up.shape
    N, F = weight.shape
    if two_f != 2 * F or gate_up.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"swiglu_down: gate_up [M, 2F] and weight [N, F] with unit last "
                         f"strides; got {tuple(gate_up.shape)} and {tuple(weight.shape)}")
    bm, bn, bk, warps, stages = config or _config(M)
    # each split a whole number of K tiles; the last may run past F (masked)
    k_split = triton.cdiv(triton.cdiv(F, splits), bk) * bk
    splits = triton.cdiv(F, k_split)
    if splits == 1:
        out = torch.empty(M, N, dtype=gate_up.dtype, device=gate_up.device)
    else:
        out = torch.empty(splits, M, N, dtype=torch.float32, device=gate_up.device)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), splits)
    _swiglu_down_kernel[grid](gate_up, weight, out, M, N, F, gate_up.stride(0),
                              weight.stride(0), M * N, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                              K_SPLIT=k_split, GROUP_M=8, EVEN_K=F % k_split == 0,
                              # fp32 gets fp32 products (Triton's default for fp32: TF32)
                              PRECISION="ieee" if gate_up.dtype == torch.float32 else "tf32",
                              num_warps=warps, num_stages=stages)
    return out


def num_splits(rows: int, out_features: int, in_features: int, num_sms: int) -> int:
    """Splits of F that give ~one program per SM for the decode step's few rows (one split
    when the row and column tiles alone fill the GPU)."""
    bm, bn, bk = _config(rows)[:3]
    tiles = triton.cdiv(rows, bm) * triton.cdiv(out_features, bn)
    return max(1, min(num_sms // tiles, in_features // (4 * bk)))


@torch.library.custom_op("hybridengine::swiglu_down", mutates_args=())
def swiglu_down(gate_up: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """silu(gate)·up @ weightᵀ from gate_up [M, 2F] and weight [N, F]: [M, N] in gate_up's
    dtype when splits == 1, else fp32 partial sums [splits', M, N] to be summed over dim 0
    (splits' <= splits: each split a whole number of K tiles)."""
    return launch(gate_up, weight, splits)


@swiglu_down.register_fake
def _(gate_up, weight, splits):
    M, N, F = gate_up.shape[0], weight.shape[0], weight.shape[1]
    bk = _config(M)[2]
    k_split = -(-(-(-F // splits)) // bk) * bk
    used = -(-F // k_split)
    if used == 1:
        return gate_up.new_empty(M, N)
    return gate_up.new_empty(used, M, N, dtype=torch.float32)
