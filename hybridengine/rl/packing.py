"""Sequence packing (no padding) and micro-batching balanced across data-parallel ranks.

Three layers, each a pure function of sequence lengths (no communication, no tensors):

1. `balanced_partitions(seqlens, k)` splits a batch over k DP ranks so each rank gets about
   the same number of *tokens* (Karmarkar–Karp largest differencing; verl's
   `get_seqlen_balanced_partitions`). With `equal_size` every rank also gets n/k sequences.
2. `token_budget_microbatches(seqlens, max_tokens)` splits one rank's share into micro-batches
   of at most `max_tokens` tokens (a sequence longer than the budget travels alone), again
   balanced by Karmarkar–Karp. `fixed_size_microbatches` is the `use_dynamic_bsz=False` path.
3. Every DP rank must run the *same number* of micro-batches (gradient sync after the last one,
   the 1F1B schedule's length). The rule is: count = max over ranks of each rank's smallest
   feasible count. In one process: `equal_count_microbatches(per_rank_seqlens, max_tokens)`.
   Across processes each rank computes `num_microbatches_for_budget(...)`, all-reduces MAX over
   its DP group, and calls `token_budget_microbatches(..., num_microbatches=that_max)`; any
   count between a rank's minimum and its number of sequences is achievable.

Packing a micro-batch into one row of tokens (position ids restarting per sequence,
`cu_seqlens` for varlen attention, a dummy tail sequence so T divides the TP size) is
`hybridengine.models.attention.PackedInput`.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

import torch

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- partitioning


def _check_lengths(seqlens: Sequence[int]) -> None:
    for i, s in enumerate(seqlens):
        if s < 0:
            raise ValueError(f"seqlens[{i}]={s} must be >= 0")


def balanced_partitions(seqlens: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split indices of `seqlens` into k non-empty groups with near-equal token totals.

    Karmarkar–Karp largest differencing for k-way partitioning: every item starts as a k-tuple of
    partial partitions; the two tuples with the largest spread (max sum - min sum) are merged by
    pairing the heaviest partition of one with the lightest of the other, which cancels the big
    differences first. With `equal_size` the initial tuples hold k items each (one per
    partition, taken in sorted order), so every merge keeps the sizes equal: n must divide by k.
    Deterministic: every rank computing it gets the same answer. Each group is sorted, and the
    groups are ordered by their first index.
    """
    n = len(seqlens)
    _check_lengths(seqlens)
    if k < 1:
        raise ValueError(f"number of partitions k={k} must be >= 1")
    if n < k:
        raise ValueError(f"cannot split {n} sequences into {k} non-empty partitions")
    if equal_size and n % k:
        raise ValueError(f"equal_size partitions need len(seqlens)={n} divisible by k={k}")

    # A tuple is (sums, parts) with parts sorted by sum, heaviest first.
    if equal_size:
        order = sorted(range(n), key=lambda i: (seqlens[i], i))
        tuples = [[[i] for i in reversed(order[j:j + k])] for j in range(0, n, k)]
    else:
        tuples = [[[i]] + [[] for _ in range(k - 1)] for i in range(n)]
    counter = itertools.count()
    heap = []
    for parts in tuples:
        sums = [sum(seqlens[i] for i in p) for p in parts]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), next(counter), sums, parts))

    while len(heap) > 1:
        _, _, sums_a, parts_a = heapq.heappop(heap)
        _, _, sums_b, parts_b = heapq.heappop(heap)
        # heaviest of a with lightest of b: a is ordered heaviest first, b reversed
        merged = sorted(
            ((sa + sb, pa + pb) for sa, pa, sb, pb in
             zip(sums_a, parts_a, reversed(sums_b), reversed(parts_b))),
            key=lambda sp: -sp[0],
        )
        sums = [s for s, _ in merged]
        parts = [p for _, p in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), next(counter), sums, parts))

    parts = [sorted(p) for p in heap[0][3]]
    return sorted(parts, key=lambda p: p[0])


def _fits(seqlens: Sequence[int], parts: list[list[int]], max_tokens: int) -> bool:
    return all(len(p) == 1 or sum(seqlens[i] for i in p) <= max_tokens for p in parts)


def _lower_bound(seqlens: Sequence[int], max_tokens: int) -> int:
    # each oversized sequence needs its own micro-batch; the rest need ceil(tokens / budget)
    num_oversized = sum(1 for s in seqlens if s > max_tokens)
    rest = sum(s for s in seqlens if s <= max_tokens)
    return max(1, num_oversized + math.ceil(rest / max_tokens))


def _round_up(k: int, multiple: int | None) -> int:
    return k if not multiple else -(-k // multiple) * multiple


def _check_budget(seqlens: Sequence[int], max_tokens: int, multiple: int | None) -> None:
    _check_lengths(seqlens)
    if not seqlens:
        raise ValueError("cannot micro-batch an empty list of sequences")
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch={max_tokens} must be >= 1")
    if multiple is not None and multiple < 1:
        raise ValueError(f"num_microbatches_multiple_of={multiple} must be >= 1")


def _smallest_feasible(seqlens: Sequence[int], max_tokens: int) -> tuple[int, list[list[int]]]:
    """Smallest k (from a lower bound up) whose KK partition respects the budget. k = n always
    does (one sequence each), so the loop ends."""
    for k in range(_lower_bound(seqlens, max_tokens), len(seqlens) + 1):
        parts = balanced_partitions(seqlens, k)
        if _fits(seqlens, parts, max_tokens):
            return k, parts
    raise AssertionError("unreachable: one sequence per micro-batch always fits")


def num_microbatches_for_budget(
    seqlens: Sequence[int], max_tokens_per_microbatch: int, num_microbatches_multiple_of: int | None = None
) -> int:
    """This rank's smallest micro-batch count under the budget (rounded up to the multiple).
    All-reduce MAX it over the DP group before calling `token_budget_microbatches`."""
    _check_budget(seqlens, max_tokens_per_microbatch, num_microbatches_multiple_of)
    k, _ = _smallest_feasible(seqlens, max_tokens_per_microbatch)
    return _round_up(k, num_microbatches_multiple_of)


def _split_to_count(seqlens: Sequence[int], parts: list[list[int]], count: int) -> list[list[int]]:
    """Grow a feasible partition to `count` parts by halving the heaviest multi-sequence part:
    a subset of a part that fits also fits, so feasibility is kept."""
    parts = [list(p) for p in parts]
    while len(parts) < count:
        splittable = [p for p in parts if len(p) > 1]
        heaviest = max(splittable, key=lambda p: (sum(seqlens[i] for i in p), -p[0]))
        parts.remove(heaviest)
        halves = balanced_partitions([seqlens[i] for i in heaviest], 2)
        parts += [[heaviest[j] for j in half] for half in halves]
    return sorted(parts, key=lambda p: p[0])


def token_budget_microbatches(
    seqlens: Sequence[int],
    max_tokens_per_microbatch: int,
    num_microbatches_multiple_of: int | None = None,
    num_microbatches: int | None = None,
) -> list[list[int]]:
    """Group one rank's sequences into micro-batches of <= `max_tokens_per_microbatch` tokens
    each (a longer sequence gets a micro-batch of its own), token totals balanced.

    Without `num_microbatches` the count is the smallest feasible one, rounded up to a multiple
    of `num_microbatches_multiple_of`; with it the count is exactly that (the DP-wide maximum,
    see the module docstring), which must lie between this rank's minimum and len(seqlens).
    Returns index lists (sorted; micro-batches ordered by first index).
    """
    _check_budget(seqlens, max_tokens_per_microbatch, num_microbatches_multiple_of)
    k_min, feasible = _smallest_feasible(seqlens, max_tokens_per_microbatch)
    count = num_microbatches if num_microbatches is not None else _round_up(k_min, num_microbatches_multiple_of)
    return _microbatches_of_count(seqlens, max_tokens_per_microbatch, count, k_min, feasible)


def _microbatches_of_count(seqlens: Sequence[int], max_tokens: int, count: int, k_min: int,
                           feasible: list[list[int]]) -> list[list[int]]:
    """token_budget_microbatches at `count` parts, from the smallest feasible partition
    (k_min parts, `feasible`) that _smallest_feasible found."""
    if count < k_min:
        raise ValueError(f"num_microbatches={count} is below the {k_min} micro-batches that "
                         f"max_tokens_per_microbatch={max_tokens} needs here")
    if count > len(seqlens):
        raise ValueError(f"{count} micro-batches requested but this rank has only {len(seqlens)} "
                         f"sequences; raise max_tokens_per_microbatch or the batch size")
    if count == k_min:
        return feasible
    parts = balanced_partitions(seqlens, count)
    if _fits(seqlens, parts, max_tokens):
        return parts
    return _split_to_count(seqlens, feasible, count)


def equal_count_microbatches(
    per_rank_seqlens: Sequence[Sequence[int]],
    max_tokens_per_microbatch: int,
    num_microbatches_multiple_of: int | None = None,
) -> list[list[list[int]]]:
    """Per-rank micro-batch index lists under one token budget, with the same count on every
    rank (the largest of the ranks' minimum counts). Single-process form of the all-reduce."""
    for s in per_rank_seqlens:
        _check_budget(s, max_tokens_per_microbatch, num_microbatches_multiple_of)
    # each rank's smallest feasible partition once (the count and, where it is the count, the
    # answer): Karmarkar-Karp ran twice a rank before, ~1/2 of the plan's host time
    smallest = [_smallest_feasible(s, max_tokens_per_microbatch) for s in per_rank_seqlens]
    count = max(_round_up(k, num_microbatches_multiple_of) for k, _ in smallest)
    return [_microbatches_of_count(s, max_tokens_per_microbatch, count, k, feasible)
            for s, (k, feasible) in zip(per_rank_seqlens, smallest)]


def fixed_size_microbatches(n: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive index chunks of `micro_batch_size` (the last may be shorter); dynamic batch
    size off. Equal n on every rank gives equal counts."""
    if n < 0:
        raise ValueError(f"number of sequences n={n} must be >= 0")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
