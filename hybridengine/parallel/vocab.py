"""Vocab-parallel log-probabilities and entropy, never gathering the full vocabulary.

Each TP rank holds logits z[:, v_start:v_start + V/tp] of the padded vocabulary. With z scaled by
1/temperature and pad columns (index >= vocab_size) excluded:

    log Z   = m + log Σ_r Σ_j exp(z_j - m),          m = max over all ranks
    logp(t) = z_t - log Z                             (z_t lives on exactly one rank)
    H       = log Z - Σ_j p_j z_j                     (p = softmax z)

Backward, per local column j:  d logp(t)/dz_j = [j = t] - p_j,  dH/dz_j = p_j (E_p[z] - z_j).
Three all-reduces of [T] vectors per call (max, sum, target/entropy terms); nothing [T, V] crosses
ranks. Only the logits are saved; p is recomputed from them and log Z in backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hybridengine.parallel.tensor import all_reduce, group_rank, group_size


def _scaled(logits: torch.Tensor, temperature: float, v_start: int, vocab_size: int):
    """z = logits / T in >= fp32, and the mask of pad columns of this rank's slice."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        z = z / temperature
    cols = torch.arange(v_start, v_start + z.shape[-1], device=z.device)
    pad = cols >= vocab_size                                   # [V/tp]
    return z, pad


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size, temperature):
        v_local = logits.shape[-1]
        v_start = group_rank(group) * v_local
        z, pad = _scaled(logits, temperature, v_start, vocab_size)
        z = z.masked_fill(pad, float("-inf"))
        m = z.max(dim=-1).values                               # [T]
        all_reduce(m, group, dist.ReduceOp.MAX)
        e = torch.exp(z - m.unsqueeze(-1))                     # pads -> 0
        s = all_reduce(e.sum(-1), group)
        log_z = m + torch.log(s)                               # [T]
        local_t = targets - v_start
        own = (local_t >= 0) & (local_t < v_local)
        z_t = torch.gather(z, -1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
        z_t = all_reduce(torch.where(own, z_t, torch.zeros_like(z_t)), group)
        p = e / s.unsqueeze(-1)
        ez = all_reduce((p * z.masked_fill(pad, 0.0)).sum(-1), group)   # E_p[z]
        ctx.save_for_backward(logits, targets, log_z, ez)
        ctx.group, ctx.vocab_size, ctx.temperature = group, vocab_size, temperature
        return z_t - log_z, log_z - ez

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, log_z, ez = ctx.saved_tensors
        v_local = logits.shape[-1]
        v_start = group_rank(ctx.group) * v_local
        z, pad = _scaled(logits, ctx.temperature, v_start, ctx.vocab_size)
        p = torch.exp(z - log_z.unsqueeze(-1)).masked_fill(pad, 0.0)
        grad = torch.zeros_like(p)
        if g_logp is not None:
            grad -= p * g_logp.unsqueeze(-1)
            local_t = targets - v_start
            own = (local_t >= 0) & (local_t < v_local)
            rows = own.nonzero().squeeze(-1)
            grad[rows, local_t[rows]] += g_logp[rows].to(grad.dtype)
        if g_ent is not None:
            grad += p * (ez.unsqueeze(-1) - z.masked_fill(pad, 0.0)) * g_ent.unsqueeze(-1)
        if ctx.temperature != 1.0:
            grad = grad / ctx.temperature
        return grad.to(logits.dtype), None, None, None, None


def vocab_parallel_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None,
                                   vocab_size: int | None = None, temperature: float = 1.0):
    """Log-prob of `targets` and entropy of softmax(logits / temperature), per row.

    logits: [T, V_padded/tp] this rank's vocabulary slice; targets: [T] global token ids.
    Returns (logprob [T], entropy [T]) in fp32 (fp64 for fp64 logits), identical on all TP ranks.
    """
    if vocab_size is None:
        vocab_size = logits.shape[-1] * group_size(group)
    return _VocabParallelLogprobEntropy.apply(logits, targets, group, vocab_size, temperature)


def vocab_parallel_logprob(logits, targets, group=None, vocab_size=None, temperature=1.0):
    return vocab_parallel_logprob_entropy(logits, targets, group, vocab_size, temperature)[0]
