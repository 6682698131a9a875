"""Device probe (issue 25): how short can the decode step's linear chain get at small batch?

The long-response workload spends most of its steps with 1-16 running rows, where the step
takes ~1.05 ms at 0.5B (bench/RESULTS.md session 19, `tail`): 272 kernels, the 96 GEMMs at
3.9-7.0 µs each against the 0.4-3.6 µs their weights take to read. Reaching half the short
benchmark's tok/s asks for ~0.65 ms. This probe times, in CUDA graphs, the layer chain without
attention (norm, qkv, o_proj + residual, norm, gate_up, SwiGLU, down + residual) of the
Qwen2.5-0.5B shape, 24 layers of their own weights (read from HBM as in the step), two ways:

- `inductor`: the chain compiled as the decode step is (inductor with PDL for its Triton
  kernels; cuBLAS for the products), 7 kernels a layer or more;
- `fused*`: 4 Triton kernels a layer (8 with split-K), each a product at small M (rows padded
  to 16 for the tensor cores) with its neighbours folded in: the RMSNorm into the qkv and gate_up products'
  prologue (each program recomputes the rows' rstd: M x 896 values), SwiGLU into the down
  product's prologue, the residual add into the o_proj and down products' epilogue; launched
  with programmatic dependent launch, each program asking L2 for its weight tile before it
  waits on the kernel before it (`prefetch` on/off), and releasing its dependents right after.

JSON lines out: per M and variant, µs per step (24 layers) and per layer, and the fused
chain's largest relative error against the inductor chain (bf16).

    python3 bench/probes/small_m_chain.py [--rows 1,4,8,16,32,64] [--iters 200]

Result (H200, session 21 call 1; bench/RESULTS.md): inductor 677-808 µs a step (28-34 µs a
layer) at 4-64 rows; every fused setting 2.1-4.7 ms, 3-6x slower. One program per column slice
walking the whole K sequentially moves too few bytes at once (the down product: 56-112
programs), and PDL / the L2 prefetch change nothing measurable (fused against
fused_no_prefetch within 1%; PDL ~10% slower). A competitive small-M product needs split-K over
hundreds of programs, as cuBLAS's kernels do; fusing neighbours into a slow product loses.
The split-K variants (`splitk*`: 112-224 programs a product, a reduce kernel that adds the
bias and the residual), session 30 call 1: 872-1,002 us at 4 rows, 894-1,002 at 8, 1,481-1,796
at 64 against inductor's 677 / 758 / 814: closer, still slower at every batch size. The chain
is bound by its count of dependent kernels, not by its bytes.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from hybridengine.kernels.decode_attention import prefetch_l2_lines  # noqa: E402

H, FFN, QKV, LAYERS, EPS = 896, 4864, 1152, 24, 1e-6
HAS_GDC = hasattr(tl.extra.cuda, "gdc_launch_dependents")


def emit(**kw):
    print(json.dumps(kw), flush=True)


@triton.jit
def _small_linear(X, W, Bias, R, NW, Y, M, N, K, eps, stride_xm, stride_wn, stride_ym,
                  stride_rm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr,
                  HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                  PREFETCH: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
                  SPLIT_K: tl.constexpr, K_PER_SPLIT, P):
    """Y[m, n] = R[m, n] + (pro(X)[m, :] . W[n, :] + Bias[n]) for one BLOCK_N slice of
    columns; pro = RMSNorm (weights NW) or SwiGLU (X = [gate | up], each K wide) or none.
    SPLIT_K > 1: program (n, s) takes K_PER_SPLIT of K and stores its fp32 partial in
    P[s, m, n]; _reduce_splits then adds them up with the bias and the residual."""
    pid = tl.program_id(0)
    k_lo = tl.program_id(1) * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    if PDL:
        if PREFETCH:
            # the weight tile does not depend on the kernel before: ask L2 for it, one
            # 128-byte line (64 16-bit values) at a time, before waiting
            lines = tl.arange(0, BLOCK_K // 64) * 64
            for k0 in range(k_lo, k_hi, BLOCK_K):
                cols = k0 + lines
                prefetch_l2_lines(w_rows + tl.where(cols < k_hi, cols, k_lo)[None, :])
        tl.extra.cuda.gdc_wait()
        if LAUNCH_DEPENDENTS:
            tl.extra.cuda.gdc_launch_dependents()
    x_rows = X + rm[:, None] * stride_xm
    if NORM:
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk[None, :] < K),
                        other=0.0).to(tl.float32)
            ss += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k_hi
        xm = m_ok[:, None] & k_ok[None, :]
        if SWIGLU:
            g = tl.load(x_rows + kk[None, :], mask=xm, other=0.0).to(tl.float32)
            u = tl.load(x_rows + K + kk[None, :], mask=xm, other=0.0).to(tl.float32)
            x = (g * tl.sigmoid(g) * u).to(W.dtype.element_ty)
        else:
            x = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
            if NORM:
                nw = tl.load(NW + kk, mask=k_ok, other=0.0).to(tl.float32)
                x = (x.to(tl.float32) * rstd[:, None] * nw[None, :]).to(W.dtype.element_ty)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:
        tl.store(P + (tl.program_id(1) * M + rm[:, None]) * N + rn[None, :], acc, mask=ok)
        return
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(Y.dtype.element_ty)
    if RESIDUAL:
        r = tl.load(R + rm[:, None] * stride_rm + rn[None, :], mask=ok, other=0.0)
        out = (out.to(tl.float32) + r.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], out, mask=ok)


@triton.jit
def _reduce_splits(P, Bias, R, Y, M, N, stride_ym, stride_rm, SPLIT_K: tl.constexpr,
                   BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                   PDL: tl.constexpr):
    """Y = R + round(sum_s P[s] + Bias): the split-K partials of _small_linear."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    m, n = i // N, i % N
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(P + s * M * N + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=ok, other=0.0).to(tl.float32)
    out = acc.to(Y.dtype.element_ty)
    if RESIDUAL:
        r = tl.load(R + m * stride_rm + n, mask=ok, other=0.0)
        out = (out.to(tl.float32) + r.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + m * stride_ym + n, out, mask=ok)


def small_linear(x, w, *, bias=None, residual=None, norm_weight=None, swiglu=False, out=None,
                 block_n=32, block_k=128, num_warps=4, num_stages=3, pdl=True, prefetch=True,
                 launch_dependents=True, split_k=1, workspace=None):
    M = x.shape[0]
    N, K = w.shape
    block_m = max(16, triton.next_power_of_2(M))
    y = out if out is not None else torch.empty(M, N, dtype=w.dtype, device=w.device)
    dummy = w
    pdl = pdl and HAS_GDC
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per_split)
    if split_k > 1 and workspace is None:
        workspace = torch.empty(split_k * M * N, dtype=torch.float32, device=w.device)
    _small_linear[(triton.cdiv(N, block_n), split_k)](
        x, w, bias if bias is not None else dummy, residual if residual is not None else dummy,
        norm_weight if norm_weight is not None else dummy, y, M, N, K, EPS,
        x.stride(0), w.stride(0), y.stride(0),
        residual.stride(0) if residual is not None else 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None,
        SWIGLU=swiglu, HAS_BIAS=bias is not None, RESIDUAL=residual is not None, PDL=pdl,
        PREFETCH=prefetch, LAUNCH_DEPENDENTS=launch_dependents, SPLIT_K=split_k,
        K_PER_SPLIT=k_per_split, P=workspace if split_k > 1 else dummy, num_warps=num_warps,
        num_stages=num_stages, **({"launch_pdl": True} if pdl else {}))
    if split_k > 1:
        block = 1024
        _reduce_splits[(triton.cdiv(M * N, block),)](
            workspace, bias if bias is not None else dummy,
            residual if residual is not None else dummy, y, M, N, y.stride(0),
            residual.stride(0) if residual is not None else 0, SPLIT_K=split_k, BLOCK=block,
            HAS_BIAS=bias is not None, RESIDUAL=residual is not None, PDL=pdl, num_warps=4,
            **({"launch_pdl": True} if pdl else {}))
    return y


def make_layers(device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)
    return [dict(n1=1 + rnd(H, scale=0.1), wqkv=rnd(QKV, H, scale=H ** -0.5),
                 bqkv=rnd(QKV, scale=0.02), wo=rnd(H, H, scale=H ** -0.5),
                 n2=1 + rnd(H, scale=0.1), wgu=rnd(2 * FFN, H, scale=H ** -0.5),
                 wd=rnd(H, FFN, scale=FFN ** -0.5)) for _ in range(LAYERS)]


def chain_torch(h, layers):
    for L in layers:
        qkv = F.linear(F.rms_norm(h, (H,), L["n1"], EPS), L["wqkv"], L["bqkv"])
        h = h + F.linear(qkv[:, :H], L["wo"])
        gate, up = F.linear(F.rms_norm(h, (H,), L["n2"], EPS), L["wgu"]).split(FFN, dim=-1)
        h = h + F.linear(F.silu(gate) * up, L["wd"])
    return h


def chain_fused(h, layers, bufs, cfg):
    qkv, gu, h1, h2 = bufs
    for L in layers:
        small_linear(h, L["wqkv"], bias=L["bqkv"], norm_weight=L["n1"], out=qkv, **cfg["qkv"])
        small_linear(qkv, L["wo"], residual=h, out=h1, **cfg["o"])
        small_linear(h1, L["wgu"], norm_weight=L["n2"], out=gu, **cfg["gu"])
        small_linear(gu, L["wd"], residual=h1, swiglu=True, out=h2, **cfg["down"])
        h = h2          # the next layer reads h2 until its o_proj has written h1
    return h


def time_graph(fn, iters):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1000 / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    from hybridengine.rollout.compile_steps import inductor_options
    layers = make_layers(dev, dt)
    compiled = torch.compile(chain_torch, options=inductor_options(dev, decode=True),
                             dynamic=False)
    base = dict(block_n=32, block_k=128, num_warps=4, num_stages=3)
    split = dict(qkv=dict(base, split_k=4), o=dict(base, split_k=4),
                 gu=dict(base, block_n=64, split_k=2), down=dict(base, split_k=8))
    variants = {
        # session 21 call 1: one program per column slice over the whole K (3-6x slower)
        "fused_bk256": dict(qkv=dict(base, block_k=256), o=dict(base, block_k=256),
                            gu=dict(base, block_n=64, block_k=256),
                            down=dict(base, block_n=16, block_k=256)),
        # split-K: 112-224 programs a product, fp32 partials summed by a reduce kernel that
        # also adds the bias and the residual (8 kernels a layer)
        "splitk": split,
        "splitk_more": dict(qkv=dict(base, split_k=7), o=dict(base, split_k=7),
                            gu=dict(base, split_k=2), down=dict(base, split_k=16)),
        "splitk_no_pdl": {k: dict(v, pdl=False) for k, v in split.items()},
        "splitk_no_prefetch": {k: dict(v, prefetch=False) for k, v in split.items()},
        "splitk_warps2": {k: dict(v, num_warps=2) for k, v in split.items()},
    }
    for M in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(M, H, device=dev, dtype=dt)
        bufs = (torch.empty(M, QKV, device=dev, dtype=dt),
                torch.empty(M, 2 * FFN, device=dev, dtype=dt),
                torch.empty(M, H, device=dev, dtype=dt), torch.empty(M, H, device=dev, dtype=dt))
        ref = compiled(x, layers).float()
        out = {}
        us = time_graph(lambda: out.__setitem__("y", compiled(x, layers)), args.iters)
        emit(rows=M, variant="inductor", us_per_step=round(us, 2),
             us_per_layer=round(us / LAYERS, 3))
        for name, cfg in variants.items():
            try:
                y = chain_fused(x, layers, bufs, cfg).float()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                us = time_graph(lambda: chain_fused(x, layers, bufs, cfg), args.iters)
                emit(rows=M, variant=name, us_per_step=round(us, 2),
                     us_per_layer=round(us / LAYERS, 3), max_rel_err=round(err, 5))
            except Exception as e:       # a setting Triton refuses: say so, go on
                emit(rows=M, variant=name, error=f"{type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    main()
