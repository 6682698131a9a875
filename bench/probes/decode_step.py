"""Device probe of session 5 (2026-11-30; bench/RESULTS.md): the pieces of one decode step of
the rollout benchmark (Qwen2.5-0.5B shape, 256 rows, 640 cached tokens of 768, bf16), each
timed inside a CUDA graph (triton.testing.do_bench_cudagraph), JSON lines out:

1. attention: the Triton decode kernel after a separate cache write against the fused form
   (RoPE + cache write + attention in one launch), and the fused form's settings (splits,
   key tile, warps, stages; call 2 of session 5 also swept two K/V heads side by side per
   program, since removed);
2. gemm: the step's five matmul shapes at M = 256 (cuBLAS through torch), against their
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
    import triton
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
    rows = []
    base = (da.BLOCK_N, dict(da.LAUNCH), da.split_len)
    for splits in (1, 2):
        for block_n in (32, 64):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    da.BLOCK_N, da.LAUNCH = block_n, dict(num_warps=warps, num_stages=stages)
                    da.split_len = lambda *a, n=splits, bn=block_n: -(-L // (n * bn)) * bn
                    setting = dict(splits=splits, block_n=block_n, warps=warps, stages=stages)
                    try:
                        err = (fused().float() - ref.float()).abs().max().item()
                        ms = triton.testing.do_bench_cudagraph(fused, rep=50)
                        rows.append(dict(ms=ms, gbps=kv_bytes / ms / 1e6, err=err, **setting))
                    except Exception as e:    # noqa: BLE001 - a failing setting is listed
                        rows.append(dict(ms=1e9, error=repr(e)[:80], **setting))
    da.BLOCK_N, da.LAUNCH, da.split_len = base
    emit(probe="attention_sweep", best=sorted(rows, key=lambda row: row["ms"])[:12])


def gemm_shapes():
    """(name, N, K) of the decode step's matmuls: x [256, K] @ W[N, K]^T."""
    return [("qkv", (HQ + 2 * HKV) * D, H), ("o_proj", H, HQ * D), ("gate_up", 2 * FFN, H),
            ("down", H, FFN), ("lm_head", VOCAB, H)]


def gemm(dev):
    import triton
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
    gemm(dev)


if __name__ == "__main__":
    main()
