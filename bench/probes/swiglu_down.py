"""Device probe of session 7 (2026-11-30; bench/RESULTS.md): the MLP tail, SwiGLU + down
projection, as the rollout runs it (a compiled SwiGLU kernel, then cuBLAS; the transposed
product for the prefill's M) against kernels/swiglu_down.py over its tile settings and splits,
Qwen2.5-0.5B shape, bf16, each timed in a CUDA graph over 24 weights (one per layer: the
weights come from HBM, as in the decode step). JSON lines out.

    python3 bench/probes/swiglu_down.py
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
H, FFN, LAYERS = 896, 4864, 24


def emit(**kw):
    print(json.dumps(kw), flush=True)


def main():
    import triton
    from hybridengine.kernels import swiglu_down as sd
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
                    return [sd.launch(gu, w, splits, tuple(tile)) for w in ws][-1]

                def fused_sum():
                    outs = [sd.launch(gu, w, splits, tuple(tile)) for w in ws]
                    return [o.sum(0).to(torch.bfloat16) if o.dim() == 3 else o for o in outs][-1]
                try:
                    out = sd.launch(gu, ws[0], splits, tuple(tile))
                    out = out.sum(0) if out.dim() == 3 else out.float()
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    rows.append(dict(cfg=cfg, us=bench(fused), us_with_sum=bench(fused_sum),
                                     rel_err=err))
                except Exception as e:  # noqa: BLE001 - a setting that does not fit is listed
                    rows.append(dict(cfg=cfg, error=repr(e)[:100]))
            emit(probe="swiglu_down", m=m, rows=sorted(rows, key=lambda r: r.get("us", 1e9)))


if __name__ == "__main__":
    main()
