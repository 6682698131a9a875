"""Expert parallelism: the token all-to-all of a mixture-of-experts layer (Megatron-core's
MoEAlltoAllTokenDispatcher), on an explicit EP group.

EP rank r of ep holds experts [r·E/ep, (r+1)·E/ep) (parallel.layout). Each rank routes its own
tokens; its (token, slot) rows, sorted by global expert id, are therefore ep runs, one per
destination rank:

    dispatch   counts [E] exchanged (all-to-all of E/ep counts per rank: rank j learns how many
               rows each rank sends to each of its experts), then the rows themselves
               (tensor.all_to_all with those split sizes); the received rows, ordered by
               (source rank, local expert), are regrouped by (local expert, source rank) so
               each local expert reads one contiguous block
    combine    the inverse: the expert outputs back to (source, expert) order, and an all-to-all
               with the split sizes swapped returns each row to the rank that sent it, in the
               order it was sent

Both all-to-alls are autograd functions (their backward the opposite exchange), so gradients of
the expert weights come from every rank's tokens and the input gradients go back to their
tokens' ranks. One host synchronisation per layer and call: the split sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridengine.parallel.tensor import all_to_all_dim0, all_to_all, group_size


@dataclass
class Dispatched:
    """What a dispatch received, and how to send the outputs back (combine)."""

    rows: torch.Tensor            # [Σ recv, H] grouped by local expert
    expert_counts: list[int]      # rows per local expert, in order
    order: torch.Tensor           # received (source-major) row of each grouped row
    send: list[int]
    recv: list[int]
    group: object


def dispatch(rows: torch.Tensor, counts: torch.Tensor, group) -> Dispatched:
    """rows [N, H] sorted by global expert id, counts [E] rows per global expert -> the rows of
    this rank's experts from every rank of the EP group (module doc)."""
    ep = group_size(group)
    local = counts.numel() // ep
    # matrix[i][j]: rows rank i sends to local expert j of this rank
    matrix = all_to_all_dim0(counts, [local] * ep, [local] * ep, group)
    sizes = torch.cat([counts.view(ep, local).sum(1), matrix]).tolist()
    send, matrix = sizes[:ep], [sizes[ep + i * local:ep + (i + 1) * local] for i in range(ep)]
    recv = [sum(m) for m in matrix]
    received = all_to_all(rows, send, recv, group)
    starts, at = [], 0
    for m in matrix:
        starts.append([])
        for n in m:
            starts[-1].append(at)
            at += n
    order = [torch.arange(starts[i][j], starts[i][j] + matrix[i][j], device=rows.device)
             for j in range(local) for i in range(ep)]
    order = torch.cat(order) if order else torch.zeros(0, dtype=torch.long, device=rows.device)
    return Dispatched(received[order], [sum(matrix[i][j] for i in range(ep))
                                        for j in range(local)], order, send, recv, group)


def combine(out: torch.Tensor, d: Dispatched) -> torch.Tensor:
    """Expert outputs [Σ recv, H], grouped as d.rows -> [N, H] in the order dispatched."""
    back = torch.empty_like(d.order)
    back[d.order] = torch.arange(d.order.numel(), device=d.order.device)
    return all_to_all(out[back], d.recv, d.send, d.group)
