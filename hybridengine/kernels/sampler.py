"""Fused temperature sampling with log-probs, in Triton: two passes over the logits.

    tokens, logprobs, sampled_logprobs = sample_temperature(logits, temperature, u)

The same distribution and the same draw as rollout.sampling.sample for a non-greedy sampler
without top-k / top-p: token = the first index whose cumulative weight exp(z/T) reaches
u · total, searched over block sums of CDF_BLOCK tokens, then inside one block; logprobs are
log softmax(z) (temperature 1) and sampled_logprobs log softmax(z/T) at the token.

Why: at batch 256 and vocabulary 151936 the torch sampler makes ~6 passes over [B, V] fp32
(a cast, softmax, block sums, the chosen block's gather) and was ~0.37 ms of a 2.5 ms decode
step on an H200 (bench/RESULTS.md, 2026-11-30 session 4). Here pass 1 reads the logits once in
their own dtype, in chunks of chunk_blocks blocks per program: the chunk's maximum, its sum of
exp(z - max) and its block sums of exp((z - max)/T); pass 2 (one program per row) rescales
those to the row's maximum, finds the block by a cumulative sum over block sums, re-reads that
one block and finds the token. Block sums are computed per chunk and rescaled, not from the
row's probabilities as the torch path does, so a draw can differ from it only when u lands
within rounding (~1e-7 relative) of a token boundary.

Triton is optional: `available()` says whether this can run (CUDA, or TRITON_INTERPRET=1 on
the CPU, which is how CI checks it against the torch sampler).
"""
from __future__ import annotations

import torch

# available: the same condition as the decode kernel's
from hybridengine.kernels.decode_attention import available, stride_or_zero  # noqa: F401
from hybridengine.kernels.settings import DEFAULT_KERNEL_SETTINGS as _DEFAULT

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

CDF_BLOCK = 128              # tokens per block of the inverse-CDF search (rollout.sampling too)
# blocks and warps per pass-1 program: arguments of sample_temperature, with the defaults (and
# measurements) of kernels.settings.RolloutKernelSettings.sampler_chunk_*


if triton is not None:
    @triton.jit
    def _chunk_kernel(Logits, stride_b, V, Temp, ChunkMax, ChunkSum, BlockSum, NB, NC,
                      SCALED: tl.constexpr, BLOCK: tl.constexpr, CHUNK_BLOCKS: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1)
        blk = c * CHUNK_BLOCKS + tl.arange(0, CHUNK_BLOCKS)
        col = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        z = tl.load(Logits + b.to(tl.int64) * stride_b + col, mask=col < V,
                    other=float("-inf")).to(tl.float32)
        m = tl.max(tl.max(z, 1), 0)                  # finite: every chunk holds a token
        tl.store(ChunkMax + b * NC + c, m)
        e = tl.exp(z - m)
        if SCALED:
            w = tl.exp((z - m) * (1.0 / tl.load(Temp).to(tl.float32)))
        else:   # temperature 1: the weights are e (one exponential per logit, not two)
            w = e
        blocks = tl.sum(w, 1)
        tl.store(ChunkSum + b * NC + c, tl.sum(tl.sum(e, 1), 0) if SCALED else tl.sum(blocks, 0))
        tl.store(BlockSum + b * NB + blk, blocks, mask=blk < NB)

    @triton.jit
    def _pick_kernel(Logits, stride_b, V, Temp, ChunkMax, ChunkSum, BlockSum, U,
                     Tok, LogP, SampledLogP, NB, NC, SCALED: tl.constexpr,
                     BLOCK: tl.constexpr, CHUNK_BLOCKS: tl.constexpr,
                     NB_P2: tl.constexpr, NC_P2: tl.constexpr):
        b = tl.program_id(0)
        inv_t = 1.0 / tl.load(Temp).to(tl.float32)
        cc = tl.arange(0, NC_P2)
        cm = tl.load(ChunkMax + b * NC + cc, mask=cc < NC, other=float("-inf"))
        m = tl.max(cm, 0)
        cs = tl.load(ChunkSum + b * NC + cc, mask=cc < NC, other=0.0)
        log_sum = tl.log(tl.sum(cs * tl.exp(cm - m), 0))            # temperature 1, at m
        i = tl.arange(0, NB_P2)
        ok = i < NB
        w = tl.load(BlockSum + b * NB + i, mask=ok, other=0.0)
        # relative to the row max (padding blocks get their chunk max -inf: weight 0, never
        # 0 * exp(-m / T), which overflows for a row of large negative logits)
        own = tl.load(ChunkMax + b * NC + i // CHUNK_BLOCKS, mask=ok, other=float("-inf"))
        w = w * tl.exp((own - m) * inv_t)
        cdf = tl.cumsum(w, 0)
        total = tl.max(cdf, 0)
        target = tl.load(U + b) * total
        blk = tl.minimum(tl.sum((cdf < target).to(tl.int32), 0), NB - 1)
        before = tl.max(tl.where(i < blk, cdf, 0.0), 0)
        j = tl.arange(0, BLOCK)
        col = blk * BLOCK + j
        row = Logits + b.to(tl.int64) * stride_b
        z = tl.load(row + col, mask=col < V, other=float("-inf")).to(tl.float32)
        inner = tl.cumsum(tl.exp((z - m) * inv_t), 0)
        k = tl.sum((inner < target - before).to(tl.int32), 0)
        # rounding can put the remainder past the block's own total: take its last token of
        # positive weight (the first index where the block's cumulative sum reaches its total)
        last = tl.sum((inner < tl.max(inner, 0)).to(tl.int32), 0)
        tok = blk * BLOCK + tl.minimum(k, last)
        z_tok = tl.load(row + tok).to(tl.float32)
        logp = (z_tok - m) - log_sum         # both terms small: no cancellation of ~|m|
        tl.store(Tok + b, tok.to(tl.int64))
        tl.store(LogP + b, logp)
        if SCALED:
            tl.store(SampledLogP + b, (z_tok - m) * inv_t - tl.log(total))
        else:
            tl.store(SampledLogP + b, logp)


def sample_temperature(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                       scaled: bool = True, chunk_blocks: int = _DEFAULT.sampler_chunk_blocks,
                       chunk_warps: int = _DEFAULT.sampler_chunk_warps):
    """logits [B, V] (any float dtype, unit stride along V), temperature [1] (a device tensor:
    graph-safe), u [B] fp32 uniforms in (0, 1). scaled=False promises temperature == 1 (the
    sampled log-probs are then the log-probs). chunk_blocks (a power of two) and chunk_warps:
    the first pass's blocks and warps per program. Returns (tokens [B] int64, logprobs [B]
    fp32, sampled_logprobs [B] fp32); static shapes, no host synchronisation."""
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    nb = triton.cdiv(V, CDF_BLOCK)
    nc = triton.cdiv(nb, chunk_blocks)
    dev = logits.device
    stride_b = stride_or_zero(logits, 0)       # a lone row: its stride is arbitrary
    chunk_max = torch.empty(B, nc, dtype=torch.float32, device=dev)
    chunk_sum = torch.empty_like(chunk_max)
    block_sum = torch.empty(B, nb, dtype=torch.float32, device=dev)
    tok = torch.empty(B, dtype=torch.int64, device=dev)
    logp = torch.empty(B, dtype=torch.float32, device=dev)
    sampled = torch.empty_like(logp)
    _chunk_kernel[(B, nc)](logits, stride_b, V, temperature, chunk_max, chunk_sum,
                           block_sum, nb, nc, SCALED=scaled, BLOCK=CDF_BLOCK,
                           CHUNK_BLOCKS=chunk_blocks, num_warps=chunk_warps)
    _pick_kernel[(B,)](logits, stride_b, V, temperature, chunk_max, chunk_sum,
                       block_sum, u.float(), tok, logp, sampled, nb, nc, SCALED=scaled,
                       BLOCK=CDF_BLOCK, CHUNK_BLOCKS=chunk_blocks,
                       NB_P2=triton.next_power_of_2(nb), NC_P2=triton.next_power_of_2(nc))
    return tok, logp, sampled
