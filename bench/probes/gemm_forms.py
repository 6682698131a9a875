"""Device probe of session 7 (2026-11-30; bench/RESULTS.md): what the rollout's matmuls and
its sampler cost under settings the engine could choose, each timed in a CUDA graph
(triton.testing.do_bench_cudagraph), JSON lines out.

1. gemm: the decoder's matmul shapes at M = 256 (the decode step) and M = 16384 (a prefill
   step), Qwen2.5-0.5B, bf16: torch's linear against the same product computed transposed
   (W @ xᵀ, then viewed back: cuBLAS sees the small dimension as N and picks other kernels),
   each under the cuBLAS and the cuBLASLt backend of torch (preferred_blas_library). Every
   call reads its own copy of the weight among 24 (one per layer), so the weights come
   from HBM as in the decode step, not from a warm L2.
2. sampler: the fused sampler's first pass over [256, 151936] bf16 logits by chunk size and
   warps, at temperature 1 and 0.7.

    python3 bench/probes/gemm_forms.py
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
H, FFN, VOCAB, LAYERS = 896, 4864, 151936, 24
SHAPES = (("qkv", 1152, H, True), ("o_proj", H, H, False), ("gate_up", 2 * FFN, H, False),
          ("down", H, FFN, False), ("lm_head", VOCAB, H, False))


def emit(**kw):
    print(json.dumps(kw), flush=True)


def gemm(dev, bench):
    for m in (256, 16384):
        for name, n, k, bias in SHAPES:
            copies = 1 if name == "lm_head" else LAYERS
            if m > 256 and name == "lm_head":
                continue
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
                  for _ in range(copies)]
            bs = [torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
                  for _ in range(copies)]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, ws[0], bs[0]).float()

            def linear():
                for w, b in zip(ws, bs):
                    y = F.linear(x, w, b)
                return y

            def transposed():
                for w, b in zip(ws, bs):
                    y = (torch.addmm(b[:, None], w, x.t()) if b is not None else w @ x.t()).t()
                return y
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                for form, fn in (("linear", linear), ("transposed", transposed)):
                    err = (fn().float() - ref).abs().max().item() if copies == 1 else None
                    us = 1e3 * bench(fn) / copies
                    flops = 2 * m * n * k
                    emit(probe="gemm", m=m, name=name, lib=lib, form=form, us=us,
                         tflops=flops / us / 1e6, err=err)
            torch.backends.cuda.preferred_blas_library("cublas")
            del ws, bs


def sampler(dev, bench):
    from hybridengine.kernels import sampler as fs
    logits = torch.randn(256, VOCAB, device=dev, dtype=torch.bfloat16) * 3
    u = torch.rand(256, device=dev)
    for temp in (1.0, 0.7):
        t = torch.tensor([temp], device=dev)
        ref = fs.sample_temperature(logits, t, u, scaled=temp != 1.0)[0]
        rows = []
        for chunk in (8, 16, 32, 64):
            for warps in (2, 4, 8, 16):
                # as the engine passes RolloutKernelSettings.sampler_chunk_*
                fn = lambda: fs.sample_temperature(logits, t, u, scaled=temp != 1.0,  # noqa: E731
                                                   chunk_blocks=chunk, chunk_warps=warps)
                try:
                    same = torch.equal(fn()[0], ref)
                    rows.append(dict(chunk=chunk, warps=warps, us=1e3 * bench(fn), same=same))
                except Exception as e:  # noqa: BLE001 - a setting that does not fit is listed
                    rows.append(dict(chunk=chunk, warps=warps, error=repr(e)[:80]))
        emit(probe="sampler", temperature=temp,
             rows=sorted(rows, key=lambda r: r.get("us", 1e9)))


def main():
    import triton
    dev = torch.device("cuda")
    emit(device=torch.cuda.get_device_name(dev), torch=torch.__version__)

    def bench(fn):
        return triton.testing.do_bench_cudagraph(fn, rep=50)
    with torch.no_grad():
        sampler(dev, bench)
        gemm(dev, bench)


if __name__ == "__main__":
    main()
