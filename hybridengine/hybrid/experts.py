"""Experts into the generation layout under expert parallelism.

The generation layout has no EP: every generation rank runs every expert (at the rollout's TP).
A training rank holds only its EP rank's experts (parallel.layout), so before the reshard plan
runs (hybrid.plan, which plans from training shards holding every expert) each rank all-gathers,
inside its EP group, the expert weights of its (tp_rank, stage) shard: one flat all-gather of
(ep−1)/ep · (expert params)/(t·p) elements received per rank, into a buffer kept for the switch.
The plan then moves the gathered experts as it moves dense weights (zero-copy when t_g = t and
p = 1: the generation experts are views of the buffer).
"""
from __future__ import annotations

import torch

from hybridengine.models.moe import expert_name, is_expert_param
from hybridengine.parallel import tensor as ptensor


class ExpertGather:
    """Every expert of this rank's training shard, from the ranks of its EP group."""

    def __init__(self, ep_group, num_experts: int):
        self.group, self.ep = ep_group, ptensor.group_size(ep_group)
        self.local = num_experts // self.ep
        self.rank = ptensor.group_rank(ep_group)
        self.buffer: torch.Tensor | None = None

    def __call__(self, params: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """(params with every rank's experts in place of this rank's, bytes received)."""
        names = [n for n in params if is_expert_param(n)]
        flat = torch.cat([params[n].detach().reshape(-1) for n in names])
        numel = flat.numel()
        if self.buffer is None or self.buffer.numel() != self.ep * numel or \
                self.buffer.dtype != flat.dtype:
            self.buffer = flat.new_empty(self.ep * numel)
        ptensor.all_gather_flat(self.buffer, flat, self.group)
        out = {n: p for n, p in params.items() if not is_expert_param(n)}
        for r in range(self.ep):
            at = r * numel
            for n in names:
                shape = params[n].shape
                out[expert_name(n, (r - self.rank) * self.local)] = \
                    self.buffer[at:at + shape.numel()].view(shape)
                at += shape.numel()
        return out, (self.ep - 1) * numel * flat.element_size()

    def release(self) -> None:
        self.buffer = None
