"""The DistributedOptimizer's argument and checkpoint-layout checks (one-line errors)."""
from __future__ import annotations

import itertools

from hybridengine.train.lr_schedule import first_error


def check_layout(saved: list[dict], current: list[dict]) -> None:
    """One-line error naming the first parameter whose place differs."""
    def slots(layout):
        return [(i, *p) for i, b in enumerate(layout) for p in b["params"]]
    for a, b in itertools.zip_longest(slots(saved), slots(current)):
        if a != b:
            raise ValueError(f"optimizer checkpoint does not match the model: {_describe(a)} in "
                             f"the checkpoint, {_describe(b)} now")
    for i, (a, b) in enumerate(zip(saved, current)):
        if a["shard_start"] != b["shard_start"]:
            raise ValueError(f"optimizer checkpoint bucket {i} was saved by another DP rank "
                             f"(shard_start {a['shard_start']} != {b['shard_start']})")


def _describe(slot) -> str:
    if slot is None:
        return "nothing"
    bucket, name, shape, start = slot
    return f"{name} {shape} (bucket {bucket}, offset {start})"


def check_args(params, betas, eps, weight_decay, grad_reduce) -> None:
    first_error([
        (bool(params), "DistributedOptimizer got no trainable parameters"),
        (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas),
         f"optim.betas={tuple(betas)} must be two values in [0, 1)"),
        (eps > 0, f"optim.eps={eps} must be > 0"),
        (weight_decay >= 0, f"optim.weight_decay={weight_decay} must be >= 0"),
        (grad_reduce in ("sum", "mean"), f"grad_reduce={grad_reduce!r} must be 'sum' or 'mean'"),
        (len({n for n, _ in params}) == len({id(p) for _, p in params}) == len(params),
         "DistributedOptimizer got a parameter twice (by name or by tensor)")])
