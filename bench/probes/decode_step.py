"""Device probe of session 5 (2026-11-30; bench/RESULTS.md): the pieces of one decode step of
the rollout benchmark (Qwen2.5-0.5B shape, 256 rows, 640 cached tokens of 768, bf16), each
timed inside a CUDA graph (triton.testing.do_bench_cudagraph), JSON lines out:

1. attention: the Triton decode kernel after a separate cache write against the fused form
   (RoPE + cache write + attention in one launch), and the fused form on a token-major and a
   head-major cache (calls 2-3 swept its splits, key tile, warps and stages, call 2 also two
   K/V heads side by side per program);
2. swiglu: cuBLAS gate/up + a compiled SwiGLU kernel against one Triton kernel (below);
3. gemm: the step's five matmul shapes at M = 256 (cuBLAS through torch), against their
   bandwidth and FLOP floors.

    python3 bench/probes/decode_step.py            # all parts
    python3 bench/probes/decode_step.py --ncu      # the fused kernel and the GEMMs, 3 calls
                                                   # each, for ncu to read
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
B, HQ, HKV, D, L, CTX, H, FFN, VOCAB = 256, 14, 2, 64, 768, 640, 896, 4864, 151936


# The one-kernel gate/up projection + SwiGLU that call 4 timed against cuBLAS + a compiled
# SwiGLU kernel (it lost: 13.9 against 12.4 µs, bench/RESULTS.md); kept here to reproduce it.
# One program computes a [BLOCK_M, BLOCK_N] output tile from the matching gate and up tiles;
# each product is rounded to x's dtype before the SwiGLU, as the unfused projection stores it.
try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def _swiglu_kernel(X, W, Out, M, F, K, stride_xm, stride_wn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < F
        x_ptr = X + rm[:, None] * stride_xm + rk[None, :]
        g_ptr = W + rn[:, None] * stride_wn + rk[None, :]               # gate rows
        u_ptr = g_ptr + F * stride_wn                                   # up rows
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptr, mask=m_ok[:, None], other=0.0)
                g = tl.load(g_ptr, mask=n_ok[:, None], other=0.0)
                u = tl.load(u_ptr, mask=n_ok[:, None], other=0.0)
            else:
                k_ok = (k0 + rk) < K
                a = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                g = tl.load(g_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                u = tl.load(u_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_g = tl.dot(a, tl.trans(g), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, tl.trans(u), acc_u, input_precision=PRECISION)
            x_ptr += BLOCK_K
            g_ptr += BLOCK_K
            u_ptr += BLOCK_K
        gate = acc_g.to(Out.dtype.element_ty).to(tl.float32)
        up = acc_u.to(Out.dtype.element_ty).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(Out + rm[:, None] * stride_om + rn[None, :], out.to(Out.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

def swiglu_matmul(x, w, config):
    """silu(x @ w[:F]^T) * (x @ w[F:]^T), x [M, K], w [2F, K] (gate rows first), one kernel."""
    M, K = x.shape
    F = w.shape[0] // 2
    out = torch.empty(M, F, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = config
    _swiglu_kernel[(triton.cdiv(M, bm), triton.cdiv(F, bn))](
        x, w, out, M, F, K, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0, PRECISION="tf32",
        num_warps=warps, num_stages=stages)
    return out


def emit(**kw):
    print(json.dumps(kw), flush=True)


def attention_inputs(dev):
    from hybridengine.models.attention import RotaryEmbedding
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    qkv = torch.randn(B, HQ + 2 * HKV, D, device=dev, generator=g).to(bf)
    kc = torch.randn(B + 1, L, HKV, D, device=dev, generator=g).to(bf)
    vc = torch.randn_like(kc)
    slots = torch.arange(B, device=dev)
    by_slot = torch.full((B + 1,), CTX - 1, device=dev)        # the new token's position
    cos, sin = RotaryEmbedding(D, 1e6, dev)(by_slot[:B])
    return qkv, kc, vc, slots, by_slot, cos, sin


def attention(dev):
    from hybridengine.kernels import decode_attention as da
    from hybridengine.models.attention import apply_rope
    qkv, kc, vc, slots, by_slot, cos, sin = attention_inputs(dev)
    q, k_new, v_new = qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
    pos = by_slot[slots]
    seqlens = (pos + 1).to(torch.int32)

    def separate():           # what the decode step ran before the fused form
        qk = apply_rope(qkv[:, :HQ + HKV], cos, sin)
        kc[slots, pos] = qk[:, HQ:]
        vc[slots, pos] = v_new
        return da.decode_attention(qk[:, :HQ], kc, vc, slots, seqlens)

    def fused():
        return da.decode_attention_rope(q, k_new, v_new, cos, sin, kc, vc, slots, by_slot)

    ref, out = separate(), fused()
    kv_bytes = B * CTX * HKV * D * 2 * 2
    res = {name: triton.testing.do_bench_cudagraph(fn, rep=100)
           for name, fn in (("separate_rope_write_attention", separate), ("fused", fused))}
    emit(probe="attention", ms=res, fused_gbps=kv_bytes / res["fused"] / 1e6,
         max_err=(out.float() - ref.float()).abs().max().item())
    # the cache layout: token-major (the KVCache's [slot, token, head, d]) against head-major
    # ([slot, head, token, d], passed as a permuted view: the kernel takes any strides)
    rows = []
    heads_major = [t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for t in (kc, vc)]
    for layout, (k_cache, v_cache) in (("token_major", (kc, vc)), ("head_major", heads_major)):
        configs = ((64, 4, 3), (64, 2, 3), (128, 4, 2), (128, 8, 3), (32, 4, 3))
        if layout == "token_major":        # session 6: deeper pipelines, smaller tiles
            configs += ((64, 4, 4), (64, 4, 5), (64, 2, 4), (64, 8, 4), (32, 4, 4), (32, 4, 6),
                        (32, 2, 6), (16, 4, 8), (128, 4, 3))
        for block_n, warps, stages in configs:
            # the launch settings as the engine passes them (RolloutKernelSettings.decode_*)
            def run(launch=dict(block_n=block_n, num_warps=warps, num_stages=stages)):
                return da.decode_attention_rope(q, k_new, v_new, cos, sin, k_cache, v_cache,
                                                slots, by_slot, **launch)
            try:
                err = (run().float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench_cudagraph(run, rep=50)
            except Exception as e:  # noqa: BLE001 - a setting that does not fit is listed
                rows.append(dict(layout=layout, ms=1e9, error=repr(e)[:80], block_n=block_n,
                                 warps=warps, stages=stages))
                continue
            rows.append(dict(layout=layout, ms=ms, gbps=kv_bytes / ms / 1e6, err=err,
                             block_n=block_n, warps=warps, stages=stages))
    emit(probe="attention_layout", rows=sorted(rows, key=lambda row: row["ms"]))


def swiglu(dev):
    """The decode step's gate/up projection + SwiGLU: cuBLAS + a compiled SwiGLU kernel
    against the one-kernel Triton form above over its tile settings."""
    x = torch.randn(B, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2 * FFN, H, device=dev, dtype=torch.bfloat16) / 30
    act = torch.compile(lambda y: torch.nn.functional.silu(y[:, :FFN]) * y[:, FFN:])

    def unfused():
        return act(torch.nn.functional.linear(x, w))
    ref = unfused()
    res = {"cublas_gate_up": triton.testing.do_bench_cudagraph(
        lambda: torch.nn.functional.linear(x, w), rep=50),
        "cublas_plus_compiled_swiglu": triton.testing.do_bench_cudagraph(unfused, rep=50)}
    rows = []
    for bm in (64, 128):
        for bn in (64, 128):
            for bk in (64, 128):
                for warps in (4, 8):
                    for stages in (3, 4):
                        config = (bm, bn, bk, warps, stages)
                        try:
                            err = (swiglu_matmul(x, w, config).float() - ref.float()).abs().max()
                            ms = triton.testing.do_bench_cudagraph(
                                lambda: swiglu_matmul(x, w, config), rep=50)
                            rows.append(dict(ms=ms, err=err.item(), config=config))
                        except Exception as e:    # noqa: BLE001 - a failing setting is listed
                            rows.append(dict(ms=1e9, error=repr(e)[:80], config=config))
    emit(probe="swiglu", ms=res, best=sorted(rows, key=lambda row: row["ms"])[:10])


def gemm_shapes():
    """(name, N, K) of the decode step's matmuls: x [256, K] @ W[N, K]^T."""
    return [("qkv", (HQ + 2 * HKV) * D, H), ("o_proj", H, HQ * D), ("gate_up", 2 * FFN, H),
            ("down", H, FFN), ("lm_head", VOCAB, H)]


def gemm(dev):
    peak_bw, peak_flops = 4.8e12, 989e12
    for name, n, k in gemm_shapes():
        x = torch.randn(B, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        ms = triton.testing.do_bench_cudagraph(lambda: torch.nn.functional.linear(x, w), rep=50)
        floor_us = 1e6 * max(2 * n * k / peak_bw, 2 * B * n * k / peak_flops)
        emit(probe="gemm", name=name, m=B, n=n, k=k, us=1e3 * ms, floor_us=floor_us)


def ncu_targets(dev):
    from hybridengine.kernels import decode_attention as da
    qkv, kc, vc, slots, by_slot, cos, sin = attention_inputs(dev)
    for _ in range(3):
        da.decode_attention_rope(qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:], cos, sin,
                                 kc, vc, slots, by_slot)
    for name, n, k in gemm_shapes():
        x = torch.randn(B, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()


def main():
    dev = torch.device("cuda")
    emit(torch=torch.__version__, device=torch.cuda.get_device_name())
    if "--ncu" in sys.argv:
        return ncu_targets(dev)
    attention(dev)
    if "--attention-only" in sys.argv:
        return
    swiglu(dev)
    gemm(dev)


if __name__ == "__main__":
    main()
