"""Vocab-parallel log-probabilities and entropy, never gathering the full vocabulary.

Each TP rank holds logits z[:, v_start:v_start + V/tp] of the padded vocabulary. With z scaled by
1/temperature and pad columns (index >= vocab_size) excluded:

    log Z   = m + log Σ_r Σ_j exp(z_j - m),          m = max over all ranks
    logp(t) = z_t - log Z                             (z_t lives on exactly one rank)
    H       = log Z - Σ_j p_j z_j                     (p = softmax z)

Backward, per local column j:  d logp(t)/dz_j = [j = t] - p_j,  dH/dz_j = p_j (E_p[z] - z_j).
Three all-reduces of [T] vectors per call (max, sum, target/entropy terms); nothing [T, V] crosses
ranks. Only the logits are saved; p is recomputed from them and log Z in backward, in blocks of
rows so that no fp32 [T, V/tp] temporary exists.
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


def _chunk_forward(logits, targets, group, vocab_size, temperature):
    """(logprob, entropy, log Z, E_p[z]) of one block of rows."""
    v_local = logits.shape[-1]
    v_start = group_rank(group) * v_local
    z, pad = _scaled(logits, temperature, v_start, vocab_size)
    z = z.masked_fill(pad, float("-inf"))
    m = z.max(dim=-1).values                                   # [t]
    all_reduce(m, group, dist.ReduceOp.MAX)
    e = torch.exp(z - m.unsqueeze(-1))                         # pads -> 0
    s = all_reduce(e.sum(-1), group)
    log_z = m + torch.log(s)
    local_t = targets - v_start
    own = (local_t >= 0) & (local_t < v_local)
    z_t = torch.gather(z, -1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    z_t = all_reduce(torch.where(own, z_t, torch.zeros_like(z_t)), group)
    e.div_(s.unsqueeze(-1))                                    # p, in place
    ez = all_reduce((e * z.masked_fill(pad, 0.0)).sum(-1), group)
    return z_t - log_z, log_z - ez, log_z, ez


def _chunk_backward(logits, targets, log_z, ez, g_logp, g_ent, group, vocab_size, temperature):
    v_local = logits.shape[-1]
    v_start = group_rank(group) * v_local
    z, pad = _scaled(logits, temperature, v_start, vocab_size)
    p = torch.exp(z - log_z.unsqueeze(-1)).masked_fill_(pad, 0.0)
    if g_ent is not None:     # dH/dz = p (E[z] - z)
        grad = p * (ez.unsqueeze(-1) - z.masked_fill_(pad, 0.0)) * g_ent.unsqueeze(-1)
    else:
        grad = torch.zeros_like(p)
    if g_logp is not None:    # dlogp/dz = onehot(t) - p
        grad -= p * g_logp.unsqueeze(-1)
        local_t = targets - v_start
        rows = ((local_t >= 0) & (local_t < v_local)).nonzero().squeeze(-1)
        grad[rows, local_t[rows]] += g_logp[rows].to(grad.dtype)
    if temperature != 1.0:
        grad /= temperature
    return grad.to(logits.dtype)


# Rows per block: bounds the fp32 temporaries to a few [rows, V/tp] tensors (vocab 151936 makes
# the full [T, V] fp32 softmax the largest tensor of a step).
CHUNK_ROWS = 2048


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size, temperature):
        outs = [_chunk_forward(lg, tg, group, vocab_size, temperature)
                for lg, tg in zip(logits.split(CHUNK_ROWS), targets.split(CHUNK_ROWS))]
        logp, ent, log_z, ez = (torch.cat(t) for t in zip(*outs))
        ctx.save_for_backward(logits, targets, log_z, ez)
        ctx.group, ctx.vocab_size, ctx.temperature = group, vocab_size, temperature
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, log_z, ez = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for i, lg in enumerate(logits.split(CHUNK_ROWS)):
            sl = slice(i * CHUNK_ROWS, i * CHUNK_ROWS + lg.shape[0])
            grad[sl] = _chunk_backward(lg, targets[sl], log_z[sl], ez[sl],
                                       None if g_logp is None else g_logp[sl],
                                       None if g_ent is None else g_ent[sl],
                                       ctx.group, ctx.vocab_size, ctx.temperature)
        return grad, None, None, None, None


def vocab_parallel_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None,
                                   vocab_size: int | None = None, temperature: float = 1.0):
    """Log-prob of `targets` and entropy of softmax(logits / temperature), per row.

    logits: [T, V_padded/tp] this rank's vocabulary slice; targets: [T] global token ids.
    Returns (logprob [T], entropy [T]) in fp32 (fp64 for fp64 logits), identical on all TP ranks.
    """
    if vocab_size is None:
        vocab_size = logits.shape[-1] * group_size(group)
    return _VocabParallelLogprobEntropy.apply(logits, targets, group, vocab_size, temperature)
