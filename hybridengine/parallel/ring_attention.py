"""Ring attention over a context-parallel group (parallel.context's "ring" mode, issue 28).

Each CP rank holds two mirrored chunks of every sequence (parallel.context.shard_packed). Its
K/V block travels around the group, c - 1 shifts (parallel.tensor.ring_shift, whose backward
shifts the gradient back), and at every step the rank's queries attend to the block it holds
now: a query of sequence s at position p sees a key of the same sequence at a position <= p
(varlen: sequence ids and positions of every rank's tokens are known from the shard, so no
metadata travels). The partial results merge by their log-sum-exp (the online softmax of flash
attention):  lse = log(e^lse_a + e^lse_b),  o = o_a·e^(lse_a − lse) + o_b·e^(lse_b − lse).

The reference form: dense masked scores per block ([h, T_r, T_r]), no overlap of the shift with
the compute, and autograd keeps every block it saw for the backward (the K/V memory of
all-gather attention). What it shows is the communication pattern and the merge.
"""
from __future__ import annotations

import torch

from hybridengine.parallel.tensor import ring_shift


def ring_attention(q, k, v, group, rank: int, seq_ids: list[torch.Tensor],
                   positions: list[torch.Tensor]) -> torch.Tensor:
    """q [T_r, h_q, d], k/v [T_r, h_kv, d] of this rank; seq_ids / positions [T_r] of every
    rank's tokens (list index = CP rank). Returns the causal attention output [T_r, h_q, d]."""
    cp = len(seq_ids)
    kv = torch.stack([k, v])                                     # one shift moves both
    out = lse = None
    for step in range(cp):
        src = (rank - step) % cp                                 # whose block this rank holds
        mask = (seq_ids[rank].unsqueeze(1) == seq_ids[src].unsqueeze(0)) & \
            (positions[src].unsqueeze(0) <= positions[rank].unsqueeze(1))     # [q, k]
        o_b, lse_b = _block_attention(q, kv[0], kv[1], mask)
        if out is None:             # the own block: every query sees itself, lse is finite
            out, lse = o_b, lse_b
        else:
            merged = torch.logaddexp(lse, lse_b)
            out = out * torch.exp(lse - merged).unsqueeze(-1) + \
                o_b * torch.exp(lse_b - merged).unsqueeze(-1)
            lse = merged
        if step < cp - 1:
            kv = ring_shift(kv, group)
    return out.to(q.dtype)


def _block_attention(q, k, v, mask):
    """Softmax attention of q [T, h_q, d] over one block k/v [S, h_kv, d] under mask [T, S]:
    (output [T, h_q, d], log-sum-exp [T, h_q]) in at least fp32. A query with no key in the
    block gets a finite lse at the dtype's minimum, so its weight in the merge is exactly 0
    (-inf would make the backward 0·nan)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).view(t, hkv, hq // hkv, d)                  # query heads by K/V group
    scores = torch.einsum("tgrd,sgd->grts", qg, k.to(acc)) * d ** -0.5    # [g, r, T, S]
    scores = scores.masked_fill(~mask, torch.finfo(acc).min)
    lse = torch.logsumexp(scores, dim=-1)                        # [g, r, T]
    p = torch.exp(scores - lse.unsqueeze(-1))
    o = torch.einsum("grts,sgd->tgrd", p, v.to(acc)).reshape(t, hq, d)
    return o, lse.permute(2, 0, 1).reshape(t, hq)
