"""Device probe of session 6 (bench/RESULTS.md): the rollout prefill's attention at the
benchmark's shape (one 16k-token prefill step: 32 packed prompts of 512 tokens, Qwen2.5-0.5B
heads h_q 14, h_kv 2, d 64, causal, bf16) through each kernel torch offers, against the one the
engine runs (aten flash varlen, native GQA). JSON lines: time, TFLOP/s (causal FLOPs of the
full batch) and the largest difference from the flash output. Call 1 also timed cuDNN's ragged
form (_cudnn_attention_forward with cum_seq_q/k): 53 ms, against 0.148 ms for flash varlen.

    python3 bench/probes/prefill_attention.py [--seqs 32] [--len 512]
"""
import argparse
import json
import math

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())


def emit(**kw):
    print(json.dumps(kw), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--len", type=int, default=512)
    args = ap.parse_args()
    import triton
    dev, bf = torch.device("cuda"), torch.bfloat16
    S, N, HQ, HKV, D = args.seqs, args.len, 14, 2, 64
    T = S * N
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(T, HQ, D, device=dev, generator=g).to(bf)
    k = torch.randn(T, HKV, D, device=dev, generator=g).to(bf)
    v = torch.randn(T, HKV, D, device=dev, generator=g).to(bf)
    cu = torch.arange(0, T + 1, N, device=dev, dtype=torch.int32)
    flops = 4 * S * HQ * D * N * N / 2            # causal: half of the score matrix
    emit(torch=torch.__version__, device=torch.cuda.get_device_name(), tokens=T,
         cudnn=torch.backends.cudnn.version())
    rep = HQ // HKV
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def flash():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, N, N, 0.0, True,
                                                       False)[0]

    # dense [S, h, N, d] (only an equal-length batch fits this form): what each SDPA backend
    # does at this shape, the bound a varlen path could reach
    qd = q.view(S, N, HQ, D).transpose(1, 2)
    kd = k.view(S, N, HKV, D).transpose(1, 2)
    vd = v.view(S, N, HKV, D).transpose(1, 2)
    krd, vrd = kr.view(S, N, HQ, D).transpose(1, 2), vr.view(S, N, HQ, D).transpose(1, 2)

    def dense(backend, gqa):
        from torch.nn.attention import sdpa_kernel

        def run():
            with sdpa_kernel(backend):
                if gqa:
                    return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True,
                                                          enable_gqa=True)
                return F.scaled_dot_product_attention(qd, krd, vrd, is_causal=True)
        return run

    def aten_cudnn_gqa():
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            qd, kd, vd, None, False, 0.0, True, False, scale=1 / math.sqrt(D))[0]

    from hybridengine.rollout.attention import padded_causal_attention

    def engine_dense():             # what the engine's dense prefill runs (no padding here)
        return padded_causal_attention(q, k, v, S, N)

    # the same tokens as prompts of 3/4 to all of N tokens, padded to N (T' < T tokens)
    lens = torch.randint(3 * N // 4, N + 1, (S,), generator=torch.Generator().manual_seed(0))
    lens[0] = N
    pad_index = torch.cat([i * N + torch.arange(n) for i, n in enumerate(lens.tolist())]).to(dev)
    Tp = int(lens.sum())
    cu_p = torch.zeros(S + 1, dtype=torch.int32)
    cu_p[1:] = torch.cumsum(lens, 0)
    cu_p = cu_p.to(dev)
    qp, kp, vp = q[:Tp], k[:Tp], v[:Tp]

    def engine_dense_padded():
        return padded_causal_attention(qp, kp, vp, S, N, pad_index)

    def flash_varlen_uneven():
        return torch.ops.aten._flash_attention_forward(qp, kp, vp, cu_p, cu_p, N, N, 0.0, True,
                                                       False)[0]

    from torch.nn.attention import SDPBackend
    ref = flash().float()
    forms = {"flash_varlen_gqa": flash,
             "dense_cudnn_gqa": dense(SDPBackend.CUDNN_ATTENTION, True),
             "dense_cudnn_repeated_kv": dense(SDPBackend.CUDNN_ATTENTION, False),
             "dense_flash_gqa": dense(SDPBackend.FLASH_ATTENTION, True),
             "aten_cudnn_gqa": aten_cudnn_gqa, "engine_dense": engine_dense}
    uneven = {"flash_varlen_uneven": flash_varlen_uneven,
              "engine_dense_padded_uneven": engine_dense_padded}
    ref_uneven = flash_varlen_uneven().float()
    for name, fn in [*forms.items(), *uneven.items()]:
        try:
            out = fn()
            if out.dim() == 4:                          # dense [S, h, N, d] -> packed
                out = out.transpose(1, 2).reshape(T, HQ, D)
            err = (out.float() - (ref_uneven if name in uneven else ref)).abs().max().item()
            ms = triton.testing.do_bench(fn, rep=100)
            emit(probe="prefill_attention", form=name, ms=ms, tflops=flops / ms / 1e9,
                 max_err=err)
        except Exception as e:  # noqa: BLE001 - a form this torch lacks is listed, not fatal
            emit(probe="prefill_attention", form=name, error=f"{type(e).__name__}: "
                 f"{str(e).splitlines()[0][:200] if str(e) else ''}")


if __name__ == "__main__":
    main()
