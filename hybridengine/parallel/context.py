"""Context parallelism (CP): the tokens of a packed batch split over a CP group, and attention
across it, for sequences longer than one rank's activations hold (issue 28).

Split. Every sequence of the batch is padded to a multiple of 2c and cut into 2c equal chunks;
CP rank r holds chunks r and 2c-1-r of each (Megatron's load balancing: under the causal mask
an early chunk attends to few keys and a late one to many, so every rank's pair costs the same).
A rank's tokens keep their global positions (RoPE) and targets; everything outside attention
is per token, so only attention needs the group. Pad tokens sit at the end of their sequence:
causally no real token sees them, and their outputs are dropped. A rank's token count can be
made a multiple of the sequence-parallel degree (`multiple_of`) by a trailing sequence of padding.

Attention, through the decoder's `ctx.attend(layer, q, k, v)` protocol (heads already split by
TP, so CP composes with it):
- "ulysses" (DeepSpeed-Ulysses): an all-to-all turns the token split into a head split: each
  rank then holds every token of the batch for h/c of its heads and runs the ordinary packed
  causal attention (flash varlen on CUDA), and a second all-to-all turns it back. Needs h_q
  divisible by c; when h_kv is not, K/V are repeated to one head per query head first (their
  gradients summed back). Per layer and direction: four all-to-alls of (c-1)/c of q, k, v, o.
- "allgather" (Megatron's cp_comm_type="allgather", Llama 3's CP): K and V are all-gathered
  (their gradients reduce-scattered back) and each rank's queries attend to their sequence's
  keys up to their own position. Any head count; the whole batch's K/V per layer on each rank.
  The masked attention here is the reference form (SDPA with a mask per sequence).
- "ring" (Megatron's cp_comm_type="p2p"): K/V blocks passed around the group, the partial
  results merged by their log-sum-exp (parallel.ring_attention). Any head count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridengine.parallel.layout import CP_ATTENTION
from hybridengine.parallel.ring_attention import ring_attention
from hybridengine.parallel.tensor import gather_from_sp, gather_from_sp_copy, group_rank, \
    group_size


@dataclass
class CPShard:
    """One CP rank's part of a packed batch. The padded batch: each sequence padded to a
    multiple of 2c (`padded_cu` [n+1]); `index` [T_r]: this rank's tokens in the padded order;
    `order` [c·T_r]: every rank's `index`, rank after rank (the order of a gather over the
    group); `source` [T_r]: the unpadded token each of this rank's tokens is (-1: padding);
    `gathered_source` [T]: where each unpadded token sits in the gather over the group."""

    cp: int
    rank: int
    padded_cu: torch.Tensor
    padded_max: int
    index: torch.Tensor
    order: torch.Tensor
    source: torch.Tensor
    positions: torch.Tensor       # [T_r] positions within the sequence (RoPE)
    seq_ids: torch.Tensor         # [T_r] the sequence of each token
    gathered_source: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.index.shape[0]

    def take(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """This rank's rows of an unpadded per-token tensor [T, ...] (pad rows: `fill`)."""
        out = x[self.source.clamp(min=0)]
        return out.masked_fill(self._pad_mask(out), fill) if (self.source < 0).any() else out

    def _pad_mask(self, out: torch.Tensor) -> torch.Tensor:
        return (self.source < 0).view(-1, *([1] * (out.dim() - 1)))

    def gather(self, x: torch.Tensor, group) -> torch.Tensor:
        """Every rank's per-token outputs [T_r, ...] -> the unpadded batch's [T, ...], on every
        rank. Every rank then computes the same loss from them, so the backward keeps this
        rank's rows of the gradient (not their sum over the group)."""
        return gather_from_sp_copy(x, group)[self.gathered_source]


def shard_packed(cu_seqlens: torch.Tensor, cp: int, rank: int, multiple_of: int = 1) -> CPShard:
    """The load-balanced split of a packed batch with sequence bounds cu_seqlens [n+1]; each
    rank's token count a multiple of `multiple_of` (a trailing sequence of padding)."""
    cu = cu_seqlens.tolist()
    lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    padded = [-(-n // (2 * cp)) * 2 * cp for n in lens]
    short = -(sum(padded) // cp) % multiple_of      # per rank; a pad sequence adds an even count
    if short:
        lens.append(0)
        padded.append(cp * (short + multiple_of if short % 2 else short))
    pcu = [0]
    for p in padded:
        pcu.append(pcu[-1] + p)
    per_rank: list[list[int]] = [[] for _ in range(cp)]
    source: list[list[int]] = [[] for _ in range(cp)]
    for s, (n, p) in enumerate(zip(lens, padded)):
        chunk = p // (2 * cp)
        for r in range(cp):
            for c in (r, 2 * cp - 1 - r):
                for t in range(c * chunk, (c + 1) * chunk):
                    per_rank[r].append(pcu[s] + t)
                    source[r].append(cu[s] + t if t < n else -1)
    gathered = [0] * cu[-1]
    for i, src in enumerate(x for r in source for x in r):
        if src >= 0:
            gathered[src] = i
    device = cu_seqlens.device
    index = torch.tensor(per_rank[rank], dtype=torch.long, device=device)
    starts = torch.tensor(pcu[:-1], dtype=torch.long, device=device)
    seq_ids = torch.bucketize(index, torch.tensor(pcu[1:], device=device), right=True)
    return CPShard(cp, rank, torch.tensor(pcu, dtype=torch.int32, device=device),
                   max(padded, default=0), index,
                   torch.tensor([i for r in per_rank for i in r], dtype=torch.long,
                                device=device),
                   torch.tensor(source[rank], dtype=torch.long, device=device),
                   index - starts[seq_ids], seq_ids,
                   torch.tensor(gathered, dtype=torch.long, device=device))


class _AllToAll(torch.autograd.Function):
    """x [c, ...]: block j goes to rank j; returns [c, ...] with block j from rank j. Its own
    adjoint: the backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, g):
        return _exchange(g, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()          # the collective reads and writes dense memory in block order
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _heads_to_tokens(x: torch.Tensor, c: int, group) -> torch.Tensor:
    """[T_r, h, d] (this rank's tokens, all heads) -> [c·T_r, h/c, d] (every rank's tokens in
    rank order, this rank's heads)."""
    t, h, d = x.shape
    blocks = x.view(t, c, h // c, d).transpose(0, 1)                   # [c, T_r, h/c, d]
    return _AllToAll.apply(blocks, group).reshape(c * t, h // c, d)


def _tokens_to_heads(x: torch.Tensor, c: int, group) -> torch.Tensor:
    """The inverse of _heads_to_tokens."""
    ct, hc, d = x.shape
    out = _AllToAll.apply(x.view(c, ct // c, hc, d), group)            # [c, T_r, h/c, d]
    return out.transpose(0, 1).reshape(ct // c, c * hc, d)


class CPAttention:
    """Causal attention of a CP rank's tokens (module docstring). `inner(cu, max_len)` builds
    the packed attention context Ulysses runs over the whole padded batch (default
    models.attention.PackedCausalAttention: pass it in, parallel/ does not import models/)."""

    def __init__(self, shard: CPShard, group, mode: str = "ulysses", inner=None):
        if mode not in CP_ATTENTION:
            raise ValueError(f"context-parallel attention {mode!r} is not one of {CP_ATTENTION}")
        if group_size(group) != shard.cp or group_rank(group) != shard.rank:
            raise ValueError(f"CP group of {group_size(group)} ranks does not match the shard "
                             f"(cp {shard.cp}, rank {shard.rank})")
        self.shard, self.group, self.mode = shard, group, mode
        self.real_rows = shard.source >= 0      # this rank's rows that are tokens, not padding
        self._unorder = torch.argsort(shard.order)             # rank-major -> padded order
        self._inner = inner(shard.padded_cu, shard.padded_max) if mode == "ulysses" else None
        if mode == "ring":      # every rank's token metadata: the blocks arrive without theirs
            starts, ends = shard.padded_cu[:-1].long(), shard.padded_cu[1:].long()
            per_rank = shard.order.view(shard.cp, -1)
            self._seq_ids = [torch.bucketize(i, ends, right=True) for i in per_rank]
            self._positions = [i - starts[s] for i, s in zip(per_rank, self._seq_ids)]

    def attend(self, layer_idx: int, q, k, v, spec=None) -> torch.Tensor:
        if spec is not None:
            raise NotImplementedError(f"context parallelism with {spec} (sliding window, "
                                      f"soft-cap or query scale) is not supported")
        if self.mode == "ulysses":
            return self._ulysses(layer_idx, q, k, v)
        if self.mode == "ring":
            return ring_attention(q, k, v, self.group, self.shard.rank, self._seq_ids,
                                  self._positions)
        return self._allgather(q, k, v)

    def _ulysses(self, layer_idx, q, k, v):
        c = self.shard.cp
        if q.shape[1] % c:
            raise ValueError(f"Ulysses context parallelism: {q.shape[1]} query heads per TP "
                             f"rank are not divisible by ulysses_sequence_parallel_size={c}")
        if k.shape[1] % c:      # one K/V head per query head: every rank keeps its groups whole
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = (_heads_to_tokens(x, c, self.group)[self._unorder] for x in (q, k, v))
        o = self._inner.attend(layer_idx, q, k, v)                 # [T, h/c, d], padded order
        return _tokens_to_heads(o[self.shard.order], c, self.group)

    def _allgather(self, q, k, v):
        s = self.shard
        k_all, v_all = (gather_from_sp(x, self.group)[self._unorder] for x in (k, v))
        cu = s.padded_cu.tolist()
        out = torch.empty_like(q)
        gqa = k.shape[1] != q.shape[1]
        for seq in range(len(cu) - 1):
            rows = (s.seq_ids == seq).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            keys = slice(cu[seq], cu[seq + 1])
            pos_k = torch.arange(cu[seq + 1] - cu[seq], device=q.device)
            mask = pos_k.unsqueeze(0) <= s.positions[rows].unsqueeze(1)       # [q, k]
            qs = q[rows].transpose(0, 1).unsqueeze(0)
            ks, vs = (x[keys].transpose(0, 1).unsqueeze(0) for x in (k_all, v_all))
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa)
            out = out.index_put((rows,), o.squeeze(0).transpose(0, 1))
        return out
