"""Device probe of session 7 (2026-11-30; bench/RESULTS.md): the MLP tail, SwiGLU + down
projection, as the rollout runs it (a compiled SwiGLU kernel, then cuBLAS; also the transposed
product) against one Triton kernel below over its tile settings and splits, Qwen2.5-0.5B
shape, bf16, each timed in a CUDA graph over 24 weights (one per layer: the weights come from
HBM, as in the decode step). JSON lines out.

The kernel folds the SwiGLU into the down projection's operand load (silu(g)·u computed in
fp32 and rounded once, as inductor's fused kernel stores it) and splits F into fp32 partial
sums for the decode step's few rows. It lost by far (decode 23.9 against 13.0 µs, prefill 655
against 313 µs): every column tile recomputes the SwiGLU of its rows, and the operand that
passes through registers is not fed to the tensor cores as fast as cuBLAS's. Kept here to
reproduce the measurement.

    python3 bench/probes/swiglu_down.py
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
H, FFN, LAYERS = 896, 4864, 24

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

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


def launch(gate_up, weight, splits, config):
    """silu(gate)·up @ weightᵀ from gate_up [M, 2F] and weight [N, F]: [M, N] in gate_up's
    dtype for one split, else fp32 partial sums [splits', M, N]; config (BLOCK_M, BLOCK_N,
    BLOCK_K, warps, stages)."""
    M, two_f = gate_up.shape
    N, F = weight.shape
    if two_f != 2 * F or gate_up.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"swiglu_down: gate_up [M, 2F] and weight [N, F] with unit last "
                         f"strides; got {tuple(gate_up.shape)} and {tuple(weight.shape)}")
    bm, bn, bk, warps, stages = config
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


def emit(**kw):
    print(json.dumps(kw), flush=True)


def main():
    dev = torch.device("cuda")
    emit(device=torch.cuda.get_device_name(dev), torch=torch.__version__)

    def bench(fn):
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=40) / LAYERS

    @torch.compile
    def unfused(gu, w):
        g, u = gu.split(FFN, dim=-1)
        return F.linear(F.silu(g) * u, w)

    @torch.compile
    def unfused_t(gu, w):
        g, u = gu.split(FFN, dim=-1)
        return (w @ (F.silu(g) * u).t()).t()

    ws = [torch.randn(H, FFN, device=dev, dtype=torch.bfloat16) / FFN ** 0.5
          for _ in range(LAYERS)]
    decode = [(64, bn, bk, 4, st, sp) for bn in (32, 64, 128) for bk in (64, 128)
              for st in (3, 5) for sp in (1, 2, 4, 8)]
    decode += [(128, 64, 64, 8, 3, sp) for sp in (2, 4)] + [(64, 64, 64, 8, 4, sp)
                                                          for sp in (2, 4)]
    prefill = [(128, 128, 64, 8, 3, 1), (128, 128, 64, 8, 4, 1), (128, 256, 64, 8, 3, 1),
               (128, 64, 64, 4, 4, 1), (64, 128, 64, 4, 4, 1), (128, 128, 128, 8, 3, 1),
               (256, 128, 64, 8, 3, 1), (128, 128, 64, 4, 4, 1)]
    with torch.no_grad():
        for m, configs in ((256, decode), (16384, prefill)):
            gu = torch.randn(m, 2 * FFN, device=dev, dtype=torch.bfloat16)
            ref = unfused(gu, ws[0]).float()
            base = {"cublas": bench(lambda: [unfused(gu, w) for w in ws][-1]),
                    "cublas_transposed": bench(lambda: [unfused_t(gu, w) for w in ws][-1])}
            emit(probe="swiglu_down", m=m, unfused_us=base)
            rows = []
            for cfg in configs:
                *tile, splits = cfg

                def fused():
                    return [launch(gu, w, splits, tuple(tile)) for w in ws][-1]

                def fused_sum():
                    outs = [launch(gu, w, splits, tuple(tile)) for w in ws]
                    return [o.sum(0).to(torch.bfloat16) if o.dim() == 3 else o for o in outs][-1]
                try:
                    out = launch(gu, ws[0], splits, tuple(tile))
                    out = out.sum(0) if out.dim() == 3 else out.float()
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    rows.append(dict(cfg=cfg, us=bench(fused), us_with_sum=bench(fused_sum),
                                     rel_err=err))
                except Exception as e:  # noqa: BLE001 - a setting that does not fit is listed
                    rows.append(dict(cfg=cfg, error=repr(e)[:100]))
            emit(probe="swiglu_down", m=m, rows=sorted(rows, key=lambda r: r.get("us", 1e9)))


if __name__ == "__main__":
    main()
