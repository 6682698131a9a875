"""Megatron tensor and sequence parallelism on torch.distributed.

Every collective lives here, as an autograd function paired with its opposite for backward, and
takes an explicit `group` (None means a group of one: the op is the identity). Activations are
token-major: [T, H] with T the (packed) token count; under sequence parallelism each TP rank holds
a contiguous block of T/tp tokens.

    copy_to_tp           fwd identity            bwd all-reduce        (enter a TP region)
    reduce_from_tp       fwd all-reduce          bwd identity          (leave a TP region)
    gather_from_sp       fwd all-gather dim 0    bwd reduce-scatter    (before a column layer)
    reduce_scatter_to_sp fwd reduce-scatter dim0 bwd all-gather        (after a row layer)
    gather_from_sp_copy  fwd all-gather dim 0    bwd split             (leave SP, replicated output)
    all_to_all           fwd all-to-all dim 0    bwd all-to-all back   (expert token dispatch)

Layers (weights are this rank's shard; biases follow their output dimension):
    ColumnParallelLinear  Y = X·A^T, A = [A_1; …; A_tp] split on the output dim; Y_i = X·A_i^T
    RowParallelLinear     Y = Σ_i X_i·A_i^T, A = [A_1 … A_tp] split on the input dim
    VocabParallelEmbedding rows [v_start, v_end) of the (tp-padded) vocabulary on each rank
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from hybridengine.parallel.wgrad_accumulation import linear


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# --- raw collectives (version-proof names) ------------------------------------------------------

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] on each rank -> [n·size, ...] in rank order."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    """Gather equal-sized flat buffers into `out` (size·numel) in rank order."""
    return _all_gather_single(out, x, group=group, async_op=async_op)


class _Works:
    """Several async works waited on as one."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()


def all_gather_flat_group(pairs: list[tuple[torch.Tensor, torch.Tensor]], group):
    """Async all-gathers [(out, x)] issued as one coalesced group (for NCCL one group launch:
    many mid-sized gathers then run near the bandwidth of one large one) -> a work to wait on.
    One by one elsewhere (gloo cannot coalesce on a subgroup)."""
    manager = getattr(dist, "_coalescing_manager", None)
    if manager is None or len(pairs) == 1 or dist.get_backend(group) != "nccl":
        return _Works([all_gather_flat(out, x, group, async_op=True) for out, x in pairs])
    with manager(group=group, device=pairs[0][0].device, async_ops=True) as works:
        for out, x in pairs:
            _all_gather_single(out, x, group=group, async_op=True)
    return works


def reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """[n·size, ...] on each rank -> this rank's [n, ...] block of the sum over ranks."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def split_dim0(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} not divisible by tp={size}")
    n = x.shape[0] // size
    return x[group_rank(group) * n:(group_rank(group) + 1) * n].contiguous()


# --- autograd collectives -----------------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_dim0(g, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.group), None


class _GatherFromSPCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return split_dim0(g, ctx.group), None


class _RingShift(torch.autograd.Function):
    """x of rank r goes to rank r+1 (mod size); returns the x of rank r-1. The backward is the
    opposite shift: a gradient goes back to the rank its input came from."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _ring_exchange(x, group, 1)

    @staticmethod
    def backward(ctx, g):
        return _ring_exchange(g, ctx.group, -1), None


def _ring_exchange(x: torch.Tensor, group, shift: int) -> torch.Tensor:
    size, rank = group_size(group), group_rank(group)
    x, out = x.contiguous(), torch.empty_like(x)
    # both posted before either waits: every rank sends and receives at once
    works = [dist.isend(x, dist.get_global_rank(group, (rank + shift) % size), group=group),
             dist.irecv(out, dist.get_global_rank(group, (rank - shift) % size), group=group)]
    for w in works:
        w.wait()
    return out


class _AllToAll(torch.autograd.Function):
    """Rows [Σ send[:j], Σ send[:j+1]) of x go to rank j; the result holds recv[i] rows from
    each rank i in rank order. The backward sends every row's gradient back where it came
    from: the same exchange with the split sizes swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return all_to_all_dim0(x, send, recv, group)

    @staticmethod
    def backward(ctx, g):
        return all_to_all_dim0(g, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all_dim0(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """send[j] rows of x to rank j, recv[i] rows from rank i, in rank order (no autograd)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, recv, send, group=group)
    return out


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """[Σ send, ...] -> [Σ recv, ...] (_AllToAll): send[j] rows to rank j, recv[i] from rank i."""
    return x if group_size(group) == 1 else _AllToAll.apply(x, send, recv, group)


def _wrap(fn):
    def apply(x: torch.Tensor, group) -> torch.Tensor:
        return x if group_size(group) == 1 else fn.apply(x, group)
    apply.__doc__ = fn.__doc__
    return apply


copy_to_tp = _wrap(_CopyToTP)
reduce_from_tp = _wrap(_ReduceFromTP)
gather_from_sp = _wrap(_GatherFromSP)
reduce_scatter_to_sp = _wrap(_ReduceScatterToSP)
gather_from_sp_copy = _wrap(_GatherFromSPCopy)
ring_shift = _wrap(_RingShift)


# --- layers --------------------------------------------------------------------------------------

def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor parallel size {d}")
    return n // d


class ColumnParallelLinear(nn.Module):
    """Y = X·A^T + b with A split on its output dim: this rank holds A_i [out/tp, in].

    Input: replicated [T, in], or with sequence_parallel this rank's [T/tp, in] block, all-gathered
    here. Output: this rank's [T, out/tp]. `output_size_per_partition` may be given explicitly for
    fused weights whose shards are not equal splits of one matrix (qkv under GQA).
    """

    def __init__(self, in_features: int, out_features: int, group=None, bias: bool = False,
                 sequence_parallel: bool = False, out_per_partition: int | None = None,
                 dtype=None, device=None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        tp = group_size(group)
        self.in_features = in_features
        self.out_per_partition = out_per_partition or divide(out_features, tp, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_partition, in_features,
                                               dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(self.out_per_partition, dtype=dtype, device=device)) \
            if bias else None
        nn.init.normal_(self.weight, std=0.02)
        self.lora = None            # parallel.lora.LoRA adapters, when the model has them
        self.fuse_wgrad = False     # the weight gradient into main_grad (wgrad_accumulation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sp(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        y = linear(x, self.weight, self.bias, self.fuse_wgrad)
        if self.lora is not None and self.lora.enabled:
            y = y + self.lora.delta(x, self.out_per_partition)
        return y


class RowParallelLinear(nn.Module):
    """Y = Σ_i X_i·A_i^T + b with A split on its input dim: this rank holds A_i [out, in/tp].

    Input: this rank's [T, in/tp] (the output of a column layer). Output: the sum over ranks,
    replicated [T, out], or with sequence_parallel reduce-scattered to this rank's [T/tp, out].
    """

    def __init__(self, in_features: int, out_features: int, group=None, bias: bool = False,
                 sequence_parallel: bool = False, dtype=None, device=None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.in_per_partition = divide(in_features, group_size(group), "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_partition,
                                               dtype=dtype, device=device))
        # The bias is added once, after the reduction: it is replicated on every rank.
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) \
            if bias else None
        nn.init.normal_(self.weight, std=0.02)
        self.lora = None            # parallel.lora.LoRA adapters, when the model has them
        self.fuse_wgrad = False     # the weight gradient into main_grad (wgrad_accumulation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.fuse_wgrad)
        if self.lora is not None and self.lora.enabled:
            # this rank's partial delta rides on the layer's own reduction (parallel.lora)
            y = y + self.lora.delta(x, self.weight.shape[0])
        y = reduce_scatter_to_sp(y, self.group) if self.sequence_parallel \
            else reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """Smallest size >= vocab_size divisible by tp·multiple (pad rows never reach a logit)."""
    m = tp * multiple
    return int(math.ceil(vocab_size / m) * m)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [v_start, v_end) of the padded vocabulary; ids outside give zeros, and the
    sum over ranks (all-reduce, or reduce-scatter to the SP block) is the full lookup."""

    def __init__(self, vocab_size: int, hidden: int, group=None, sequence_parallel: bool = False,
                 dtype=None, device=None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        tp = group_size(group)
        self.vocab_size = vocab_size
        self.padded_vocab = padded_vocab_size(vocab_size, tp)
        self.per_partition = self.padded_vocab // tp
        self.v_start = group_rank(group) * self.per_partition
        self.weight = nn.Parameter(torch.empty(self.per_partition, hidden, dtype=dtype,
                                               device=device))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.v_start
        outside = (local < 0) | (local >= self.per_partition)
        y = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_to_sp(y, self.group) if self.sequence_parallel \
            else reduce_from_tp(y, self.group)


def sync_sequence_parallel_grads(module: nn.Module, group) -> None:
    """Sum over TP the gradients of replicated parameters used on sequence shards (norm weights,
    value head): each rank computed its part from T/tp tokens. One flat all-reduce."""
    grads = [p.grad for p in module.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if group_size(group) == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
