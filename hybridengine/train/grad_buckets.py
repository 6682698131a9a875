"""The flat gradient buckets of train.optimizer.DistributedOptimizer: which parameter sits where
(aligned entries, buckets of about bucket_mb MB, padded to a multiple of the shard count), and
the runs of a rank's slice that the norm counts and that weight decay applies to."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

ParamFilter = Callable[[str, nn.Parameter], bool]
GRAD_ALIGN = 64          # elements: bucket views start on 256-byte (fp32) boundaries


def default_no_decay(name: str, param: nn.Parameter) -> bool:
    """Biases and norm weights (every parameter with fewer than 2 dims) get no weight decay."""
    return param.dim() < 2


@dataclass
class Entry:
    """One parameter's place in its bucket: elements [start, start + numel)."""

    name: str
    param: nn.Parameter
    start: int
    counted: bool
    decay: bool

    @property
    def stop(self) -> int:
        return self.start + self.param.numel()


@dataclass
class Bucket:
    entries: list[Entry]
    numel: int                          # padded to a multiple of dp
    grad: torch.Tensor                  # fp32 [numel]
    group: object = None                # its replicas: dp, or expert-dp for expert buckets
    sharded: bool = False               # ZeRO-1 over `group`
    expert: bool = False
    shard_start: int = 0                # this rank's slice [shard_start, shard_start + shard_numel)
    shard_numel: int = 0
    master: torch.Tensor = None         # fp32 [shard_numel]
    exp_avg: torch.Tensor = None
    exp_avg_sq: torch.Tensor = None
    norm_views: list[torch.Tensor] = field(default_factory=list)    # counted grad runs
    adam_runs: list[tuple[bool, int, int]] = field(default_factory=list)  # (decay, lo, hi)

    @property
    def shard_grad(self) -> torch.Tensor:
        return self.grad[self.shard_start:self.shard_start + self.shard_numel]

    def runs(self, keep: Callable[[Entry], bool]) -> list[tuple[int, int]]:
        """Maximal runs [lo, hi) of this rank's slice, in slice coordinates, covering consecutive
        entries with keep(entry). Alignment gaps inside a run hold zeros and are harmless."""
        lo_s, hi_s = self.shard_start, self.shard_start + self.shard_numel
        runs: list[list[int]] = []
        prev_kept = False
        for e in self.entries:
            lo, hi = max(e.start, lo_s), min(e.stop, hi_s)
            if lo >= hi:
                continue
            if keep(e) and prev_kept:
                runs[-1][1] = hi - lo_s
            elif keep(e):
                runs.append([lo - lo_s, hi - lo_s])
            prev_kept = keep(e)
        return [(a, b) for a, b in runs]


def fused_adam_lists(parts) -> dict[bool, list[list[torch.Tensor]]]:
    """The fused AdamW kernel's tensor lists over `parts` (buckets, or the host step's chunks of
    them: anything with master, shard_grad, exp_avg, exp_avg_sq and adam_runs): per decay flag,
    [masters, grads, exp_avgs, exp_avg_sqs] views of the runs with that flag."""
    return {decay: [[getattr(p, t)[lo:hi] for p in parts for d, lo, hi in p.adam_runs
                     if d == decay] for t in ("master", "shard_grad", "exp_avg", "exp_avg_sq")]
            for decay in (True, False)}


def cover_runs(kept: list[tuple[int, int]], n: int) -> list[tuple[bool, int, int]]:
    """(True, lo, hi) for the sorted disjoint runs `kept` of [0, n), (False, lo, hi) for the gaps
    between them: the whole range, in order."""
    out, at = [], 0
    for lo, hi in kept:
        if at < lo:
            out.append((False, at, lo))
        out.append((True, lo, hi))
        at = hi
    return out + ([(False, at, n)] if at < n else [])


def build_buckets(params, bucket_mb, num_shards, count_fn, no_decay_fn) -> list[Bucket]:
    max_numel = int(bucket_mb * 2**20 / 4) if bucket_mb and bucket_mb > 0 else None
    groups: list[list[Entry]] = []
    key, size = None, 0
    for name, p in reversed(params):
        start = -(-size // GRAD_ALIGN) * GRAD_ALIGN
        if not groups or (p.dtype, p.device) != key or (
                max_numel is not None and size > 0 and start + p.numel() > max_numel):
            groups.append([])
            key, start = (p.dtype, p.device), 0
        groups[-1].append(Entry(name, p, start, count_fn(name, p), not no_decay_fn(name, p)))
        size = start + p.numel()
    buckets = []
    for entries in groups:
        used = entries[-1].stop
        numel = -(-used // (num_shards * GRAD_ALIGN)) * num_shards * GRAD_ALIGN
        # fp32 for bf16/fp16/fp32 parameters; fp64 parameters (tests) keep fp64 throughout
        dtype = torch.promote_types(entries[0].param.dtype, torch.float32)
        grad = torch.zeros(numel, dtype=dtype, device=entries[0].param.device)
        buckets.append(Bucket(entries, numel, grad))
    return buckets
