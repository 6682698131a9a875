"""Experts into the generation layout under expert parallelism.

The generation layout has no EP: every generation rank runs every expert (at the rollout's TP).
A training rank holds only its EP rank's experts (parallel.layout), stacked per layer
(models.moe), so before the reshard plan runs (hybrid.plan, which plans from training shards
holding every expert) each rank all-gathers, inside its EP group, every stacked experts
parameter of its (tp_rank, stage) shard: the parameter itself is the gather's input (no packing
copy) and its output the [E, ...] stack of the whole group (rank-major = global expert order),
a section of one buffer kept for the switch. (ep−1)/ep · (expert params)/(t·p) elements are
received per rank, one gather per stacked parameter (coalesced under NCCL). The plan then moves
the gathered experts, per expert, as it moves dense weights (zero-copy when t_g = t and p = 1:
the generation experts are the buffer's sections).
"""
from __future__ import annotations

import torch

from hybridengine.models.moe import is_expert_param
from hybridengine.parallel import tensor as ptensor


class ExpertGather:
    """Every expert of this rank's training shard, from the ranks of its EP group."""

    def __init__(self, ep_group):
        self.group, self.ep = ep_group, ptensor.group_size(ep_group)
        self.buffer: torch.Tensor | None = None

    def __call__(self, params: dict[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], int, int]:
        """(params with each stacked experts parameter [E/ep, ...] replaced by the EP group's
        [E, ...], bytes received, collectives)."""
        names = [n for n in params if is_expert_param(n)]
        first = params[names[0]]
        numel = sum(params[n].numel() for n in names)
        if self.buffer is None or self.buffer.numel() != self.ep * numel or \
                self.buffer.dtype != first.dtype:
            self.buffer = first.new_empty(self.ep * numel)
        out, pairs, at = dict(params), [], 0
        for n in names:
            p = params[n].detach()
            whole = self.buffer[at:at + self.ep * p.numel()]
            pairs.append((whole, p.reshape(-1)))      # a contiguous parameter: a view
            out[n] = whole.view(self.ep * p.shape[0], *p.shape[1:])
            at += whole.numel()
        ptensor.all_gather_flat_group(pairs, self.group).wait()
        return out, (self.ep - 1) * numel * first.element_size(), len(pairs)

    def release(self) -> None:
        self.buffer = None
