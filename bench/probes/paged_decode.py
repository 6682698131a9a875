"""Device probe of session 22 (2026-12-03; bench/RESULTS.md): the paged decode attention
(kernels/paged_decode_attention.py, fused RoPE + cache write form, PDL) against the static
one (kernels/decode_attention.py) at the rollout benchmark's shapes, each timed per layer
inside a CUDA graph (triton.testing.do_bench_cudagraph), JSON lines out:

- short: 256 rows, 640 cached tokens of 768 (Qwen2.5-0.5B heads: 14 / 2 of 64), bf16: the
  static kernel, the paged one with its blocks in order and shuffled, block sizes 16 / 32 /
  64, and a few tile / warp / stage settings;
- tail: 8 rows at 4,096-5,120 tokens of 16,896 (the long workload's last steps) and 2 rows,
  equal and spread lengths: where splitting each row's own length (not the table's width)
  should count;
- 7B heads (28 / 4 of 128) at 64 rows, 2,048 tokens.

    python3 bench/probes/paged_decode.py [--parts short,tail,7b]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())


def emit(**kw):
    print(json.dumps(kw), flush=True)


def make_case(dev, B, hq, hkv, d, max_len, lens, bs, shuffle, gen):
    """Static and paged caches holding the same keys for rows of lengths `lens` (the new
    token's position + 1), and the fused kernels' inputs."""
    from hybridengine.models.attention import RotaryEmbedding
    bf = torch.bfloat16
    lens = torch.as_tensor(lens, device=dev)
    W = -(-max_len // bs)
    kc = torch.randn(B + 1, W * bs, hkv, d, device=dev, generator=gen).to(bf)
    vc = torch.randn_like(kc)
    num_blocks = B * W
    order = torch.randperm(num_blocks, device=dev, generator=gen) if shuffle else \
        torch.arange(num_blocks, device=dev)
    tables = order.view(B, W).int()
    kp = torch.empty(num_blocks + 1, bs, hkv, d, device=dev, dtype=bf)
    vp = torch.empty_like(kp)
    kp[tables.long().flatten()] = kc[:B].reshape(B * W, bs, hkv, d)
    vp[tables.long().flatten()] = vc[:B].reshape(B * W, bs, hkv, d)
    pos = (lens - 1).long()
    qkv = torch.randn(B, hq + 2 * hkv, d, device=dev, generator=gen).to(bf)
    cos, sin = RotaryEmbedding(d, 1e6, dev)(pos)
    rows = torch.arange(B, device=dev)
    slot = tables[rows, pos // bs].long() * bs + pos % bs
    by_slot = torch.cat([pos, pos.new_zeros(1)])
    return dict(qkv=qkv, hq=hq, hkv=hkv, kc=kc, vc=vc, kp=kp, vp=vp, tables=tables, pos=pos,
                rows=rows, slot=slot, by_slot=by_slot, cos=cos, sin=sin, max_len=W * bs,
                kv_bytes=int(lens.sum()) * hkv * d * 2 * 2)


def static_fn(c, **launch):
    from hybridengine.kernels import decode_attention as da
    qkv, hq, hkv = c["qkv"], c["hq"], c["hkv"]
    return lambda: da.decode_attention_rope(qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:],
                                            c["cos"], c["sin"], c["kc"], c["vc"], c["rows"],
                                            c["by_slot"], **launch)


def paged_fn(c, **launch):
    from hybridengine.kernels.paged_decode_attention import paged_decode_attention_rope
    qkv, hq, hkv = c["qkv"], c["hq"], c["hkv"]
    return lambda: paged_decode_attention_rope(
        qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], c["cos"], c["sin"], c["kp"],
        c["vp"], c["tables"], c["slot"], c["rows"], c["pos"], c["max_len"], **launch)


def time_case(name, variants):
    """variants: (label, fn, its case: the static kernel on the same keys is its reference)."""
    import triton
    rows = []
    for label, fn, case in variants:
        try:
            err = (fn().float() - static_fn(case)().float()).abs().max().item()
            ms = triton.testing.do_bench_cudagraph(fn, rep=100)
        except Exception as e:  # noqa: BLE001 - a setting that does not fit is listed
            rows.append(dict(variant=label, error=repr(e)[:120]))
            continue
        rows.append(dict(variant=label, us=round(ms * 1e3, 2),
                         tbps=round(case["kv_bytes"] / ms / 1e9, 3), max_err=err))
    emit(probe="paged_decode", case=name, rows=rows)


def short(dev, gen):
    for shuffle in (False, True):
        variants = []
        for bs in (16, 32, 64):
            c = make_case(dev, 256, 14, 2, 64, 768, [640] * 256, bs, shuffle, gen)
            if bs == 16:
                variants.append(("static", static_fn(c), c))
                for block_n, warps, stages in ((64, 4, 3), (64, 4, 2), (64, 4, 4), (64, 2, 3),
                                               (32, 4, 3), (128, 4, 3)):
                    variants.append((f"paged bs16 n{block_n} w{warps} s{stages}",
                                     paged_fn(c, block_n=block_n, num_warps=warps,
                                              num_stages=stages), c))
                variants.append(("paged bs16 no prefetch", paged_fn(c, prefetch_keys=0), c))
                variants.append(("paged bs16 no pdl", paged_fn(c, pdl=False), c))
            else:
                variants.append((f"paged bs{bs}", paged_fn(c), c))
        time_case(f"short 256x640/768 {'shuffled' if shuffle else 'in order'}", variants)
        del variants, c
        torch.cuda.empty_cache()


def tail(dev, gen):
    for B, lens in ((8, [4608] * 8), (8, [1024, 2048, 3072, 4096, 5120, 5120, 4608, 4096]),
                    (2, [6144, 9216]), (64, [1536] * 64)):
        c = make_case(dev, B, 14, 2, 64, 16896, lens, 16, True, gen)
        time_case(f"tail {B} rows {min(lens)}-{max(lens)} of 16896",
                  [("static", static_fn(c), c), ("paged bs16", paged_fn(c), c)])
        del c
        torch.cuda.empty_cache()


def seven_b(dev, gen):
    c = make_case(dev, 64, 28, 4, 128, 4096, [2048] * 64, 16, True, gen)
    time_case("7b heads 64x2048/4096",
              [("static", static_fn(c), c), ("static n32", static_fn(c, block_n=32), c),
               ("paged bs16", paged_fn(c), c), ("paged bs16 n32", paged_fn(c, block_n=32), c)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="short,tail,7b")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    emit(probe="paged_decode_env", gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    parts = {"short": short, "tail": tail, "7b": seven_b}
    for name in args.parts.split(","):
        parts[name](dev, gen)


if __name__ == "__main__":
    main()
