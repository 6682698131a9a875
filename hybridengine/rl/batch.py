"""The step's batch of sequences and how it becomes packed micro-batches.

Every rank holds the whole batch (token ids and [B, R] per-response-token tensors: a few MB even
at B = 2048, R = 4096) so that rewards, advantages and KL control are computed identically
everywhere, exactly as in a single process. Model work is split: each data-parallel rank scores
or trains on its token-balanced share, and per-token results are all-gathered back into [B, R].

Response token j of sequence i (prompt length P_i) is predicted at packed position P_i - 1 + j of
that sequence: `resp_idx` [b, R] maps the [b, R] response grid of a micro-batch onto its packed
per-token outputs (log-probs, entropies, values).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridengine.train.engine import MicroBatch
from hybridengine.models.attention import PackedInput
from hybridengine.parallel.tensor import all_gather_dim0
from hybridengine.rl.packing import balanced_partitions, equal_count_microbatches, \
    fixed_size_microbatches


@dataclass
class Batch:
    """B sequences = prompts × n responses. Per-sequence lists and [B, R] tensors (CPU)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    group: list[int]                      # prompt index: GRPO/RLOO groups
    data_source: list[str]
    ground_truth: list
    extra_info: list
    max_response_length: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def seqlens(self) -> list[int]:
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]

    @property
    def response_mask(self) -> torch.Tensor:
        if "response_mask" not in self.tensors:
            lens = torch.tensor([len(r) for r in self.response_ids])
            self.tensors["response_mask"] = (
                torch.arange(self.max_response_length)[None] < lens[:, None]).float()
        return self.tensors["response_mask"]

    def select(self, idx: list[int]) -> "Batch":
        pick = lambda xs: [xs[i] for i in idx]          # noqa: E731
        t = torch.tensor(idx, dtype=torch.long)
        return Batch(pick(self.prompt_ids), pick(self.response_ids), pick(self.group),
                     pick(self.data_source), pick(self.ground_truth), pick(self.extra_info),
                     self.max_response_length, {k: v[t] for k, v in self.tensors.items()})

    @staticmethod
    def concat(parts: list["Batch"]) -> "Batch":
        first = parts[0]
        cat = lambda name: [x for p in parts for x in getattr(p, name)]   # noqa: E731
        keys = set.intersection(*(set(p.tensors) for p in parts))
        return Batch(cat("prompt_ids"), cat("response_ids"), cat("group"), cat("data_source"),
                     cat("ground_truth"), cat("extra_info"), first.max_response_length,
                     {k: torch.cat([p.tensors[k] for p in parts]) for k in keys})


def build_microbatch(batch: Batch, idx: list[int], tp: int, fields: tuple[str, ...]) -> MicroBatch:
    """Pack sequences `idx` of the batch into one MicroBatch (SP-padded to a multiple of tp)."""
    seqs, resp_idx, offset = [], torch.zeros(len(idx), batch.max_response_length,
                                             dtype=torch.long), 0
    targets, rows = [], []
    for row, i in enumerate(idx):
        p, r = batch.prompt_ids[i], batch.response_ids[i]
        s = torch.tensor(p + r, dtype=torch.long)
        seqs.append(s)
        targets.append(torch.roll(s, -1))
        resp_idx[row, :len(r)] = offset + len(p) - 1 + torch.arange(len(r))
        rows.append(resp_idx[row, :len(r)])
        offset += len(s)
    packed = PackedInput.from_lengths(torch.cat(seqs), [len(s) for s in seqs], multiple_of=tp)
    t = torch.tensor(idx, dtype=torch.long)
    # the positions whose next token is a response token: the only log-probs RL reads
    tensors = {"targets": torch.cat(targets), "resp_idx": resp_idx,
               "resp_mask": batch.response_mask[t],
               # (one row at least: the loss keeps its path to the weights)
               "logprob_rows": torch.cat(rows) if any(map(len, rows)) else
               torch.zeros(1, dtype=torch.long)}
    tensors.update({f: batch.tensors[f][t] for f in fields})
    return MicroBatch(packed, tensors)


def dp_shards(batch: Batch, dp: int) -> list[list[int]]:
    """Token-balanced, equal-count split of the batch over DP ranks (same on every rank)."""
    if dp == 1:
        return [list(range(len(batch)))]
    return balanced_partitions(batch.seqlens, dp, equal_size=True)


def microbatch_plan(batch: Batch, shards: list[list[int]], micro_batch_size: int | None,
                    max_tokens: int | None, use_dynamic_bsz: bool) -> list[list[list[int]]]:
    """Per DP rank, lists of batch indices, one per micro-batch; the same count on every rank."""
    if use_dynamic_bsz:
        lens = batch.seqlens
        per_rank = [[lens[i] for i in s] for s in shards]
        plans = equal_count_microbatches(per_rank, max_tokens)
        return [[[s[j] for j in mb] for mb in plan] for s, plan in zip(shards, plans)]
    size = micro_batch_size or max(len(s) for s in shards)
    return [[[s[j] for j in mb] for mb in fixed_size_microbatches(len(s), size)] for s in shards]


def gather_response_tensor(local: list[torch.Tensor], plan: list[list[list[int]]],
                           batch_size: int, width: int, mesh, device) -> torch.Tensor:
    """All-gather over DP the per-micro-batch [b, R] results of every rank (in the order of its
    `plan` entry) into the batch's [B, R] grid, on every rank."""
    orders = [[i for mb in p for i in mb] for p in plan]
    mine = torch.cat(local).float() if local else torch.zeros(0, width)
    out = torch.zeros(batch_size, width, dtype=torch.float32)
    if mesh.dp == 1:
        out[torch.tensor(orders[0], dtype=torch.long)] = mine.cpu()
        return out
    n = max(len(o) for o in orders)
    mine = torch.nn.functional.pad(mine, (0, 0, 0, n - mine.shape[0])).to(device)
    gathered = all_gather_dim0(mine.contiguous(), mesh.dp_group).cpu()
    for r, o in enumerate(orders):
        out[torch.tensor(o, dtype=torch.long)] = gathered[r * n:r * n + len(o)]
    return out
