"""LM-head log-prob + entropy, fwd and fwd+bwd: the unfused path against the fused one (JSON out).

Default shape: the Qwen2.5-0.5B head, 16384 tokens x hidden 896 x vocab 151936, bf16, tp=1.
loss = sum(a·logprob + b·entropy) with random per-token a, b (both outputs carry gradients).

    unfused      F.linear -> parallel/vocab.py (what Decoder.logprob_entropy did before)
    fused        kernels.fused_linear_logprob_entropy, CUDA chunk ops (csrc/logprob_kernels.cu)
    fused_torch  the same chunking with the torch chunk ops (the fallback)
    gemm_floor   the fused path's GEMMs alone (same chunks, no softmax work): its lower bound

Per variant: median ms of --iters runs after 2 warm-ups (fwd under no_grad, as for old/ref
log-probs; fwd+bwd), peak GiB allocated above the inputs during fwd+bwd, and TFLOP/s of the
model FLOPs 6·T·H·V (the fused path does 8·T·H·V: one recomputed GEMM). Differences against
unfused are max relative errors (max |x − y| / max |y|).

    python tools/bench_logprob.py [--tokens 16384] [--hidden 896] [--vocab 151936] [--iters 10]
                                  [--chunk-cols N ...] [--no-torch]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybridengine.kernels import cuda_extension, fused_linear_logprob_entropy  # noqa: E402
from hybridengine.kernels.logprob import _chunks  # noqa: E402
from hybridengine.parallel.vocab import vocab_parallel_logprob_entropy  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, iters, device):
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _peak_gib(fn, device):
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _forward(variant, h, w, targets, vocab, chunk_cols):
    if variant == "unfused":
        return vocab_parallel_logprob_entropy(torch.nn.functional.linear(h, w), targets, None,
                                              vocab)
    impl = "torch" if variant == "fused_torch" else "cuda"
    return fused_linear_logprob_entropy(h, w, targets, None, vocab, chunk_cols=chunk_cols,
                                        impl=impl)


def _gemm_floor(h, w, vocab, chunk_cols):
    """The fused path's GEMMs with nothing between them: fwd, then recompute + 2 grad GEMMs."""
    chunks = _chunks(w.shape[0], 0, vocab, h.shape[0], chunk_cols)
    buf = h.new_empty(h.shape[0] * max(b - a for a, b, _ in chunks))
    grad_w = torch.empty_like(w)
    grad_x = torch.zeros(h.shape, dtype=torch.float32, device=h.device)

    def logits(a, b):
        return torch.mm(h, w[a:b].t(), out=buf[: h.shape[0] * (b - a)].view(h.shape[0], b - a))

    @torch.no_grad()
    def fwd():
        for a, b, _ in chunks:
            logits(a, b)

    @torch.no_grad()
    def fwd_bwd():
        fwd()
        for a, b, _ in chunks:
            g = logits(a, b)
            torch.mm(g.t(), h, out=grad_w[a:b])
            grad_x.add_(torch.mm(g, w[a:b], out_dtype=torch.float32) if h.is_cuda
                        else torch.mm(g, w[a:b]).float())
    return fwd, fwd_bwd


def bench_variant(variant, h, w, targets, a, b, vocab, chunk_cols, iters):
    device = h.device
    if variant == "gemm_floor":
        fwd, fwd_bwd = _gemm_floor(h, w, vocab, chunk_cols)
    else:
        def fwd():
            with torch.no_grad():
                _forward(variant, h, w, targets, vocab, chunk_cols)

        def fwd_bwd():
            logp, ent = _forward(variant, h, w, targets, vocab, chunk_cols)
            ((logp * a).sum() + (ent * b).sum()).backward()
            h.grad = w.grad = None
    ms_fwd, ms = _median_ms(fwd, iters, device), _median_ms(fwd_bwd, iters, device)
    flops = 6 * h.shape[0] * h.shape[1] * vocab
    # gemm_floor allocates its buffers up front: a peak above them would mean nothing.
    peak = None if variant == "gemm_floor" else _peak_gib(fwd_bwd, device)
    return {"fwd_ms": round(ms_fwd, 2), "fwd_bwd_ms": round(ms, 2),
            "peak_gib": None if peak is None else round(peak, 2),
            "model_tflops": round(flops / ms / 1e9, 1)}


def _outputs(variant, h, w, targets, a, b, vocab, chunk_cols):
    logp, ent = _forward(variant, h, w, targets, vocab, chunk_cols)
    ((logp * a).sum() + (ent * b).sum()).backward()
    out = (logp.detach(), ent.detach(), h.grad.float(), w.grad.float())
    h.grad = w.grad = None
    return out


def _rel(x, y):
    return float((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--chunk-cols", type=int, nargs="*", default=[],
                    help="extra fused runs with these chunk widths (default run: auto)")
    ap.add_argument("--no-torch", action="store_true", help="skip the fused_torch variant")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, device=device) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device)
    a, b = torch.randn(args.tokens, device=device), torch.randn(args.tokens, device=device)

    kernels = cuda and cuda_extension() is not None
    variants = ["unfused"] + (["fused"] if kernels else []) + \
        ([] if args.no_torch else ["fused_torch"]) + (["gemm_floor"] if cuda else [])
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "dtype": str(dtype).replace("torch.", ""), "tokens": args.tokens,
           "hidden": args.hidden, "vocab": args.vocab, "tp": 1, "cuda_kernels": kernels,
           "chunks": len(_chunks(args.vocab, 0, args.vocab, args.tokens, None))}
    for v in variants:
        print(f"bench {v} ...", file=sys.stderr)
        out[v] = bench_variant(v, h, w, targets, a, b, args.vocab, None, args.iters)
    for cols in args.chunk_cols:
        print(f"bench fused chunk_cols={cols} ...", file=sys.stderr)
        out[f"fused_chunk{cols}"] = bench_variant("fused" if kernels else "fused_torch", h, w,
                                                  targets, a, b, args.vocab, cols, args.iters)
    ref = _outputs("unfused", h, w, targets, a, b, args.vocab, None)
    names = ("logprob", "entropy", "grad_hidden", "grad_weight")
    for v in variants:
        if v not in ("unfused", "gemm_floor"):
            got = _outputs(v, h, w, targets, a, b, args.vocab, None)
            out[v]["rel_err_vs_unfused"] = {n: _rel(x, y) for n, x, y in zip(names, got, ref)}
    fused = out.get("fused") or out.get("fused_torch")
    out["speedup_fwd_bwd"] = round(out["unfused"]["fwd_bwd_ms"] / fused["fwd_bwd_ms"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
