"""Device probe of session 8 (2026-11-30; bench/RESULTS.md): can a Triton matmul beat cuBLAS on
the decode step's small products?

At M = 256 rows the decode step's qkv (1152×896) and o_proj (896×896) products move ~2 MB of
weight, ~0.5 µs at HBM bandwidth, yet cuBLAS takes ~5 µs each (session 7's gemm_forms probe).
Finer tiles or split-K might fill the GPU better. This probe times, in CUDA graphs, a plain Triton matmul (y = x·Wᵀ + b, W row-major [N, K] as nn.Linear
keeps it) over tile shapes and split-K degrees (fp32 partials + one reduce kernel, both
timed), against torch's linear, for the decode shapes of Qwen2.5-0.5B. Each call reads its
own weight among 24 (one per layer), from HBM as in the decode step. JSON lines out: per
shape cuBLAS's time and the best settings.

    python3 bench/probes/small_gemm.py [--quick]

Result (H200, session 8 call 2): no setting beats cuBLAS by more than 0.2 µs (o_proj); each
matmul costs ~4.4–5.5 µs in the captured step however it is tiled.
"""
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
H, FFN, LAYERS, M = 896, 4864, 24, 256
SHAPES = (("qkv", 1152, H, True), ("o_proj", H, H, False), ("gate_up", 2 * FFN, H, False),
          ("down", H, FFN, False))


def emit(**kw):
    print(json.dumps(kw), flush=True)


@triton.jit
def _mm_kernel(X, W, B, Y, P, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_ym,
               HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    num_n = tl.cdiv(N, BN)
    pm, pn = pid // num_n, pid % num_n
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    k0 = s * K_PER_SPLIT
    for k in range(k0, k0 + K_PER_SPLIT, BK):
        kk = k + rk
        x = tl.load(X + rm[:, None] * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(W + rn[:, None] * stride_wn + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=ok)
    else:
        tl.store(P + (s * M + rm[:, None]) * N + rn[None, :], acc, mask=ok)


@triton.jit
def _reduce_kernel(P, B, Y, MN, N, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT):
        acc += tl.load(P + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


def triton_linear(x, w, b, y, part, bm, bn, bk, split, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    kps = triton.cdiv(triton.cdiv(k, split), bk) * bk
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    _mm_kernel[grid](x, w, b if b is not None else w, y, part, m, n, k, kps, x.stride(0), w.stride(0),
                     y.stride(0), HAS_BIAS=b is not None, BM=bm, BN=bn, BK=bk, SPLIT=split,
                     num_warps=warps, num_stages=stages)
    if split > 1:
        _reduce_kernel[(triton.cdiv(m * n, 1024),)](part, b if b is not None else w, y, m * n, n,
                                                   HAS_BIAS=b is not None, SPLIT=split,
                                                   BLOCK=1024, num_warps=4)
    return y


def main():
    quick = "--quick" in sys.argv
    dev = torch.device("cuda")
    emit(device=torch.cuda.get_device_name(dev), torch=torch.__version__,
         triton=triton.__version__)

    def bench(fn):
        return triton.testing.do_bench_cudagraph(fn, rep=30)
    settings = list(itertools.product((64, 128), (32, 64, 128), (64, 128), (1, 2, 4, 7),
                                      (4,), (3, 4)))
    if quick:
        settings = [s for s in settings if s[5] == 3]
    torch.manual_seed(0)
    with torch.no_grad():
        for name, n, k, bias in SHAPES:
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
                  for _ in range(LAYERS)]
            bs = [torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
                  for _ in range(LAYERS)]
            x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(M, n, device=dev, dtype=torch.bfloat16)
            part = torch.empty(7, M, n, device=dev, dtype=torch.float32)
            ref = F.linear(x, ws[0], bs[0]).float()

            def cublas():
                for w, b in zip(ws, bs):
                    out = F.linear(x, w, b)
                return out
            base = 1e3 * bench(cublas) / LAYERS
            rows = []
            for bm, bn, bk, split, warps, stages in settings:
                if split > 1 and k // split < bk:
                    continue
                cfg = dict(bm=bm, bn=bn, bk=bk, split=split, warps=warps, stages=stages)
                try:
                    err = (triton_linear(x, ws[0], bs[0], y, part, **cfg).float()
                           - ref).abs().max().item()

                    def fn(cfg=cfg):
                        for w, b in zip(ws, bs):
                            triton_linear(x, w, b, y, part, **cfg)
                    rows.append(dict(cfg, us=1e3 * bench(fn) / LAYERS, err=err))
                except Exception as e:  # noqa: BLE001 - a setting that does not fit is listed
                    rows.append(dict(cfg, error=repr(e)[:80]))
            rows.sort(key=lambda r: r.get("us", 1e9))
            emit(probe="small_gemm", name=name, m=M, n=n, k=k, cublas_us=base,
                 best=rows[:8], settings=len(rows))
            del ws, bs, part


if __name__ == "__main__":
    main()
