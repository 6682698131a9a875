"""LoRA adapters on the tensor-parallel linear layers (Megatron-Bridge's scheme).

An adapted weight acts as W + s·B·A (s = alpha / rank; A [r, in], B [out, r]) without W ever
changing: the delta is a second path, x·Aᵀ·Bᵀ·s, added to the layer's output.

- Column-parallel layer (this rank holds W's output rows W_i): A replicated, B sharded like the
  rows (B_i). The delta of this rank's rows, x·Aᵀ·B_iᵀ, needs the same gathered input as W_i.
  A fused layer (qkv, gate_up) carries one adapter per HF module it fuses (q_proj, k_proj,
  v_proj; gate_proj, up_proj): a target is a slice of the rank's output rows.
- Row-parallel layer (this rank holds W's input columns W_i): A sharded like the columns (A_i),
  B replicated. Σ_i x_i·A_iᵀ·Bᵀ = (Σ_i x_i·A_iᵀ)·Bᵀ, so each rank adds its x_i·A_iᵀ·Bᵀ to its
  partial output and the layer's own all-reduce (or reduce-scatter) sums the delta with the rest:
  no collective of its own.

A replicated matrix's gradient is the sum of what each rank computed (its rows or columns of the
product), so it is marked like the sequence-parallel norm weights (`p.sequence_parallel`), whose
gradients the optimizer sums over TP. Initialisation is PEFT's (A Kaiming-uniform, B zero: the
adapted model starts as the base), drawn from a generator seeded per adapter over A's full
shape, so that every layout holds the same adapters.

`lora_delta_weight` gives a rank's s·B·A for its shard of W, computed where W lives: the merged
generation weights need no collective beyond the base's own, and W stays bit for bit what it
was over any number of merges.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from hybridengine.parallel.tensor import group_rank, group_size


@dataclass(frozen=True)
class LoRATarget:
    """One adapted HF module inside a parallel layer: its name (q_proj, …) and, for a column
    layer, the rows [offset, offset + rows) of this rank's output shard it covers."""
    name: str
    offset: int = 0
    rows: int = 0


class LoRA(nn.Module):
    """The adapters of one ColumnParallelLinear ("column") or RowParallelLinear ("row"): A[name],
    B[name] per target. enabled=False: the layer computes the base alone (the reference)."""

    def __init__(self, kind: str, targets: list[LoRATarget], in_features: int,
                 out_features: int, rank: int, alpha: float, group, seed: int,
                 dtype=None, device=None):
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(f"LoRA kind {kind!r}: column or row")
        if kind == "row" and len(targets) != 1:
            raise ValueError("a row-parallel layer has one adapter")
        self.kind, self.targets, self.rank = kind, tuple(targets), rank
        self.scaling = alpha / rank
        self.enabled = True
        tp, tp_rank = group_size(group), group_rank(group)
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        for i, t in enumerate(targets):
            full_a = torch.empty(rank, in_features * (tp if kind == "row" else 1),
                                 dtype=torch.float32)
            g = torch.Generator().manual_seed(seed * 1009 + i)
            # PEFT: kaiming_uniform_(a=sqrt(5)) over A's full fan-in
            bound = 1.0 / math.sqrt(full_a.shape[1])
            full_a.uniform_(-bound, bound, generator=g)
            a = full_a if kind == "column" else full_a.chunk(tp, dim=1)[tp_rank]
            self.A[t.name] = nn.Parameter(a.to(dtype=dtype, device=device).contiguous())
            rows = t.rows if kind == "column" else out_features
            self.B[t.name] = nn.Parameter(torch.zeros(rows, rank, dtype=dtype, device=device))
            # replicated across TP: its gradient is the sum of the ranks' parts
            replicated = self.A[t.name] if kind == "column" else self.B[t.name]
            replicated.sequence_parallel = True

    def delta(self, x: torch.Tensor, out_features: int) -> torch.Tensor:
        """s·x·Aᵀ·Bᵀ over this rank's output (column: [T, out_per_partition], zeros where no
        target; row: this rank's partial [T, out], summed by the layer's reduction)."""
        if self.kind == "row":
            t = self.targets[0].name
            return (x @ self.A[t].t() @ self.B[t].t()) * self.scaling
        names = [t.name for t in self.targets]
        xa = x @ torch.cat([self.A[n] for n in names]).t()               # [T, targets·r]
        parts, at = [], 0
        for i, t in enumerate(self.targets):
            if t.offset > at:
                parts.append(x.new_zeros(x.shape[0], t.offset - at))
            parts.append(xa[:, i * self.rank:(i + 1) * self.rank] @ self.B[t.name].t())
            at = t.offset + t.rows
        if at < out_features:
            parts.append(x.new_zeros(x.shape[0], out_features - at))
        return torch.cat(parts, dim=-1) * self.scaling


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def lora_delta_weight(layer: nn.Module) -> torch.Tensor:
    """s·B·A shaped like this rank's shard of layer.weight (at least fp32): rows of the column
    layer's targets, the row layer's columns of this rank."""
    lora: LoRA = layer.lora
    w, wide = layer.weight, _wide(layer.weight.dtype)
    delta = torch.zeros(w.shape, dtype=wide, device=w.device)
    for t in lora.targets:
        ba = lora.B[t.name].to(wide) @ lora.A[t.name].to(wide) * lora.scaling
        if lora.kind == "row":
            delta += ba
        else:
            delta[t.offset:t.offset + t.rows] += ba
    return delta


def merged_weight(layer: nn.Module) -> torch.Tensor:
    """W + s·B·A for this rank's shard, in W's dtype; W itself is not touched."""
    if getattr(layer, "lora", None) is None:
        return layer.weight
    w = layer.weight
    return (w.to(_wide(w.dtype)) + lora_delta_weight(layer)).to(w.dtype)


def lora_layers(module: nn.Module):
    """The LoRA modules under `module`."""
    return [m for m in module.modules() if isinstance(m, LoRA)]


@contextmanager
def adapters_disabled(module: nn.Module):
    """The base model inside the block (the reference policy: verl's ref_in_actor)."""
    layers = lora_layers(module)
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m, on in zip(layers, before):
            m.enabled = on
