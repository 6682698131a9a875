"""Device probe of session 32 (2026-12-04; bench/RESULTS.md): what a training micro-batch's
weight-gradient products cost with and without gradient-accumulation fusion
(hybridengine/parallel/wgrad_accumulation.py), at the Qwen2.5-0.5B layer's shapes.

Per shape (qkv, o_proj, gate_up, down) and token count T, in bf16 with an fp32 bucket:
    unfused   dW = gᵀ·x in bf16 (F.linear's backward), then bucket += dW (the optimizer's hook)
    fused     bucket = gᵀ·x + bucket in one cuBLAS call (aten::addmm.dtype_out, fp32 C)
    op        the same through the hybridengine::accumulate_wgrad op as the backward calls it
              (its C++ CUDA kernel, csrc/wgrad_accumulation.cpp, when it builds)
Device time from CUDA events over 24 layers' products (each its own weight, as in an update);
host time per call without a sync, of each form on one-token products (launch-bound): the
unfused pair of calls, the fused aten call, the op (C++ kernel) and the op's Python kernel.
JSON lines.

    python3 bench/probes/wgrad_accumulation.py
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from hybridengine.kernels.wgrad import load_wgrad_kernel  # noqa: E402
from hybridengine.parallel.wgrad_accumulation import (_accumulate_wgrad,  # noqa: E402
                                                      accumulate_wgrad)

H, FFN, LAYERS = 896, 4864, 24
SHAPES = (("qkv", 1152, H), ("o_proj", H, H), ("gate_up", 2 * FFN, H), ("down", H, FFN))


def _device_ms(fn, iters=5):
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def main():
    dev = torch.device("cuda")
    print(json.dumps({"cpp_kernel": load_wgrad_kernel(torch.bfloat16)}), flush=True)
    for tokens in (2048, 8192):
        for name, n_out, n_in in SHAPES:
            g = torch.randn(tokens, n_out, device=dev, dtype=torch.bfloat16)
            x = torch.randn(tokens, n_in, device=dev, dtype=torch.bfloat16)
            buckets = [torch.zeros(n_out, n_in, device=dev) for _ in range(LAYERS)]

            def unfused():
                for b in buckets:
                    b.add_(g.t() @ x)

            def fused():
                for b in buckets:
                    torch.ops.aten.addmm.dtype_out(b, g.t(), x, torch.float32, out=b)

            def op():
                for b in buckets:
                    accumulate_wgrad(b, g, x)
            row = {"tokens": tokens, "shape": name, "out": n_out, "in": n_in}
            for label, fn in (("unfused", unfused), ("fused", fused), ("op", op)):
                row[f"{label}_us_per_layer"] = round(_device_ms(fn) * 1e3 / LAYERS, 2)
            one_g, one_x = g[:1], x[:1]
            host = {"unfused": lambda b: b.add_(one_g.t() @ one_x),
                    "fused": lambda b: torch.ops.aten.addmm.dtype_out(
                        b, one_g.t(), one_x, torch.float32, out=b),
                    "op": lambda b: accumulate_wgrad(b, one_g, one_x),
                    "op_python": lambda b: _accumulate_wgrad(b, one_g, one_x)}
            for label, call in host.items():
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(20):
                    for b in buckets:
                        call(b)
                row[f"{label}_host_us"] = round((time.perf_counter() - t) / (20 * LAYERS) * 1e6, 2)
            torch.cuda.synchronize()
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
