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

Then `pack` lays one micro-batch out as a single row of T tokens: position ids restart at 0 per
sequence and `cu_seqlens` marks the boundaries for varlen attention, so no pad token is ever
computed. `pad_packed_to_multiple` appends one dummy sequence so T divides the tensor-parallel
size (sequence parallelism scatters T over TP ranks). Callers ignore the dummy by construction:
it is the last segment of `cu_seqlens` (its own sequence, so real tokens never attend to it),
`seqlens` lists only the real sequences, per-token outputs are cut back with `strip` / `unpack`,
and per-token inputs built with `pack_values` carry `pad_value` (0 for loss masks) there.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

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
    if count < k_min:
        raise ValueError(f"num_microbatches={count} is below the {k_min} micro-batches that "
                         f"max_tokens_per_microbatch={max_tokens_per_microbatch} needs here")
    if count > len(seqlens):
        raise ValueError(f"{count} micro-batches requested but this rank has only {len(seqlens)} "
                         f"sequences; raise max_tokens_per_microbatch or the batch size")
    if count == k_min:
        return feasible
    parts = balanced_partitions(seqlens, count)
    if _fits(seqlens, parts, max_tokens_per_microbatch):
        return parts
    return _split_to_count(seqlens, feasible, count)


def equal_count_microbatches(
    per_rank_seqlens: Sequence[Sequence[int]],
    max_tokens_per_microbatch: int,
    num_microbatches_multiple_of: int | None = None,
) -> list[list[list[int]]]:
    """Per-rank micro-batch index lists under one token budget, with the same count on every
    rank (the largest of the ranks' minimum counts). Single-process form of the all-reduce."""
    count = max(num_microbatches_for_budget(s, max_tokens_per_microbatch, num_microbatches_multiple_of)
                for s in per_rank_seqlens)
    return [token_budget_microbatches(s, max_tokens_per_microbatch, num_microbatches=count)
            for s in per_rank_seqlens]


def fixed_size_microbatches(n: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive index chunks of `micro_batch_size` (the last may be shorter); dynamic batch
    size off. Equal n on every rank gives equal counts."""
    if n < 0:
        raise ValueError(f"number of sequences n={n} must be >= 0")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]


# ----------------------------------------------------------------------------- packing


@dataclass
class PackedBatch:
    """One micro-batch as a single row of T tokens.

    cu_seqlens has one more segment than `seqlens` when `num_pad` > 0: the trailing dummy
    sequence of `pad_packed_to_multiple`. max_seqlen covers every segment (varlen kernels need it).
    """

    input_ids: Tensor      # [T] int64
    position_ids: Tensor   # [T] int64, 0.. per sequence
    cu_seqlens: Tensor     # [n+1] int32 (n+2 when padded)
    max_seqlen: int
    seqlens: list[int]     # real sequences only
    num_pad: int = 0

    @property
    def num_sequences(self) -> int:
        return len(self.seqlens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def strip(self, values: Tensor) -> Tensor:
        """[T, ...] -> [T - num_pad, ...]: drop the dummy tokens from a per-token output."""
        return values[: values.shape[0] - self.num_pad]

    def unpack(self, values: Tensor) -> list[Tensor]:
        """[T, ...] -> one [L_i, ...] view per real sequence (the dummy is dropped)."""
        return unpack(values, self.cu_seqlens)[: self.num_sequences]


def pack(sequences: Sequence[Tensor]) -> PackedBatch:
    """Concatenate 1-D token tensors into one packed row (device of the inputs)."""
    if not sequences:
        raise ValueError("cannot pack an empty list of sequences")
    for i, seq in enumerate(sequences):
        if seq.dim() != 1 or seq.numel() == 0:
            raise ValueError(f"sequence {i} has shape {tuple(seq.shape)}; expected a non-empty 1-D tensor")
    device = sequences[0].device
    seqlens = [int(seq.numel()) for seq in sequences]
    lengths = torch.tensor(seqlens, dtype=torch.int64, device=device)
    cu_seqlens = torch.zeros(len(seqlens) + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = lengths.cumsum(0)
    input_ids = torch.cat([seq.to(torch.int64) for seq in sequences])   # [T]
    starts = torch.repeat_interleave(cu_seqlens[:-1].to(torch.int64), lengths)
    position_ids = torch.arange(input_ids.shape[0], device=device) - starts  # [T]
    return PackedBatch(input_ids, position_ids, cu_seqlens, max(seqlens), seqlens)


def unpack(values: Tensor, cu_seqlens: Tensor) -> list[Tensor]:
    """[T, ...] packed values -> per-segment views [L_i, ...] (every segment of cu_seqlens,
    the dummy one included; `PackedBatch.unpack` drops it)."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != values.shape[0]:
        raise ValueError(f"cu_seqlens spans [{bounds[0]}, {bounds[-1]}] but values have "
                         f"{values.shape[0]} tokens")
    return list(torch.split(values, [b - a for a, b in zip(bounds[:-1], bounds[1:])]))


def pad_packed_to_multiple(packed: PackedBatch, multiple: int, pad_token_id: int = 0) -> PackedBatch:
    """Append one dummy sequence of (-T mod multiple) tokens so T divides `multiple` (the TP
    size under sequence parallelism). Returns `packed` itself when no padding is needed."""
    if multiple < 1:
        raise ValueError(f"multiple={multiple} must be >= 1")
    num_pad = (-packed.num_tokens) % multiple
    if num_pad == 0:
        return packed
    if packed.num_pad:
        raise ValueError(f"batch already carries {packed.num_pad} pad tokens for another multiple")
    device = packed.input_ids.device
    pad_ids = torch.full((num_pad,), pad_token_id, dtype=packed.input_ids.dtype, device=device)
    end = packed.cu_seqlens[-1:] + num_pad
    return PackedBatch(
        input_ids=torch.cat([packed.input_ids, pad_ids]),
        position_ids=torch.cat([packed.position_ids, torch.arange(num_pad, device=device)]),
        cu_seqlens=torch.cat([packed.cu_seqlens, end.to(torch.int32)]),
        max_seqlen=max(packed.max_seqlen, num_pad),
        seqlens=list(packed.seqlens),
        num_pad=num_pad,
    )


def pack_values(values: Sequence[Tensor], packed: PackedBatch, pad_value: float = 0) -> Tensor:
    """Lay per-sequence tensors [L_i, ...] out like `packed` (labels, masks, advantages):
    concatenated, plus `num_pad` rows of `pad_value` for the dummy sequence."""
    lengths = [int(v.shape[0]) for v in values]
    if lengths != packed.seqlens:
        raise ValueError(f"value lengths {lengths} do not match packed seqlens {packed.seqlens}")
    flat = torch.cat(list(values))                                     # [T - num_pad, ...]
    if not packed.num_pad:
        return flat
    pad = flat.new_full((packed.num_pad, *flat.shape[1:]), pad_value)
    return torch.cat([flat, pad])                                       # [T, ...]
