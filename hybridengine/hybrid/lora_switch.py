"""Adapter-only switches of a LoRA actor whose generation layout differs from its training one
(t_g < t, p = 1; issue 24).

The base W is frozen, so its generation shard moves once: hybrid.reshard runs its program over
the base weights at the first switch (the HybridFlow bytes) and keeps the result. Every switch
then all-gathers only the adapter matrices that TP splits, inside the micro-DP group (the t/t_g
training ranks [j·k, (j+1)·k) that hold generation shard j, in rank order; k = t/t_g):

    column layer (qkv, gate_up)   B of each target, split by W's rows: the members' B_i stacked
                                  are the generation shard's B; A is whole on every rank
    row layer (o, down)           A, split by W's columns: the members' A_i side by side; B whole

and builds each adapted generation weight locally as W_g + s·B_g·A_g, with the arithmetic of
parallel.lora.merged_weight (at least fp32, then W's dtype). A target's rows in the fused
generation layer are its training rows scaled by k (q, k, v and gate, up each grow by k). With
p > 1 a micro-DP group mixes pipeline stages, whose layers differ: such layouts keep merging on
the training side and moving merged weights (hybrid.reshard decides).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridengine.parallel import tensor as ptensor
from hybridengine.parallel.lora import LoRA


def frozen_base(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base parameters as they are (no merge, no adapters, no value head): what the first
    adapter-only switch reshards once."""
    return {n: p for n, p in model.named_parameters()
            if ".lora." not in n and not n.startswith("value_head.")}


def _split_shards(layers: dict[str, nn.Module]) -> list[torch.Tensor]:
    """The adapter matrices TP splits, in a fixed order (every member lists the same)."""
    out = []
    for layer in layers.values():
        lora: LoRA = layer.lora
        for t in lora.targets:
            out.append(lora.B[t.name] if lora.kind == "column" else lora.A[t.name])
    return out


def gather_adapters(layers: dict[str, nn.Module], group, k: int):
    """All-gather the split adapter matrices over the micro-DP `group` (k members) in one
    collective. Returns ({weight name: {target: (A_g, B_g)}}, bytes received, collectives)."""
    shards = [s.detach() for s in _split_shards(layers)]
    flat = torch.cat([s.reshape(-1) for s in shards])
    gathered = torch.empty(k * flat.numel(), dtype=flat.dtype, device=flat.device)
    ptensor.all_gather_flat(gathered, flat, group)
    chunks, at, out = gathered.view(k, -1), 0, {}
    for name, layer in layers.items():
        lora: LoRA = layer.lora
        out[name] = {}
        for t in lora.targets:
            shard = lora.B[t.name] if lora.kind == "column" else lora.A[t.name]
            parts = chunks[:, at:at + shard.numel()].reshape(k, *shard.shape)
            at += shard.numel()
            if lora.kind == "column":
                out[name][t.name] = (lora.A[t.name].detach(), parts.reshape(-1, lora.rank))
            else:
                out[name][t.name] = (torch.cat(list(parts), dim=1), lora.B[t.name].detach())
    return out, (k - 1) * flat.numel() * flat.element_size(), 1


def merge_generation_weight(base: torch.Tensor, lora: LoRA, adapters: dict, k: int,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """W_g + s·B_g·A_g for a generation shard `base` (W_g), into `out` when given."""
    wide = torch.promote_types(base.dtype, torch.float32)
    delta = torch.zeros(base.shape, dtype=wide, device=base.device)
    for t in lora.targets:
        a, b = adapters[t.name]
        ba = b.to(wide) @ a.to(wide) * lora.scaling
        if lora.kind == "row":
            delta += ba
        else:
            delta[t.offset * k:(t.offset + t.rows) * k] += ba
    merged = (base.to(wide) + delta).to(base.dtype)
    if out is None:
        return merged
    return out.copy_(merged)
