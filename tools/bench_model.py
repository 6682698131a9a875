"""Forward+backward throughput and MFU of the decoder on one device (JSON to stdout).

Qwen2.5-0.5B shape (random bf16 weights), a packed batch of ~16k tokens in sequences of mixed
lengths 100-768, loss = -mean log p(next token) through the vocab-parallel log-prob. MFU counts
model FLOPs (hybridengine.rl.flops.decoder_flops, fwd+bwd = 3x forward) against a bf16 matmul peak
measured in the same run. `--hf` adds HF transformers on the same sequences, padded.

    python tools/bench_model.py [--tokens 16384] [--iters 10] [--hf] [--compile]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybridengine.models.attention import PackedInput  # noqa: E402
from hybridengine.models.decoder import Decoder  # noqa: E402
from hybridengine.rl.flops import decoder_flops, peak_flops  # noqa: E402

from hybridengine.models.shapes import QWEN2_5_0_5B, TINY  # noqa: E402


def mixed_lengths(total: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        lens.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    lens[-1] -= sum(lens) - total
    if lens[-1] < 1:
        lens.pop()
    return lens


def _time(fn, iters: int, device) -> float:
    for _ in range(2):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def _profile(step, device, top: int = 25) -> None:
    """One profiled step: the top kernels by device time, to stderr."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=70),
          file=sys.stderr)


def bench_ours(cfg, lens, device, dtype, iters, compile_layers, profile=False):
    torch.manual_seed(0)
    model = Decoder(cfg, dtype=dtype, device=device)
    if compile_layers:
        for layer in model.layers:
            layer.compile()
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), device=device)
    packed = PackedInput.from_lengths(ids, lens)
    packed.cu_seqlens = packed.cu_seqlens.to(device)
    targets = torch.roll(ids, -1)

    def step():
        logp, _ = model.logprob_entropy(model(packed), targets)
        (-logp.mean()).backward()
        for p in model.parameters():
            p.grad = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sec = _time(step, iters, device)
    if profile:
        _profile(step, device)
    mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return sec, mem


def bench_hf(cfg, lens, device, dtype, iters):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    hf_cfg = Qwen2Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    model = Qwen2ForCausalLM(hf_cfg).to(device=device, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size, (len(lens), max(lens)), device=device)
    mask = (torch.arange(max(lens), device=device)[None] < torch.tensor(lens, device=device)[:, None])

    def step():
        out = model(input_ids=ids, attention_mask=mask.long(), labels=ids.masked_fill(~mask, -100))
        out.loss.backward()
        model.zero_grad(set_to_none=True)
    return _time(step, iters, device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny model")
    ap.add_argument("--profile", action="store_true", help="top kernels of one step to stderr")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = TINY if args.tiny else QWEN2_5_0_5B
    tokens = 512 if args.tiny else args.tokens
    lens = mixed_lengths(tokens, min(args.min_len, 16) if args.tiny else args.min_len,
                         64 if args.tiny else args.max_len)
    flops = decoder_flops(cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, lens, backward=True)
    peak = peak_flops() if cuda else None
    sec, mem = bench_ours(cfg, lens, device, dtype, args.iters, args.compile, args.profile)
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "model": "tiny" if args.tiny else "qwen2.5-0.5b-shape", "tokens": sum(lens),
           "num_seqs": len(lens), "compile": args.compile, "step_s": sec,
           "tokens_per_s": sum(lens) / sec, "model_tflop_per_step": flops / 1e12,
           "peak_tflops": peak / 1e12 if peak else None,
           "mfu": flops / sec / peak if peak else None, "peak_mem_gb": mem}
    if args.hf:
        hf_sec = bench_hf(cfg, lens, device, dtype, args.iters)
        out.update(hf_step_s=hf_sec, hf_tokens_per_s=sum(lens) / hf_sec,
                   hf_mfu=flops / hf_sec / peak if peak else None, speedup_vs_hf=hf_sec / sec)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
