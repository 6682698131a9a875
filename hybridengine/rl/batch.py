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
from itertools import chain

import numpy as np
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
    """Pack sequences `idx` of the batch into one MicroBatch (SP-padded to a multiple of tp):
    prompt + response tokens back to back; targets: each token's successor within its sequence
    (its first token after its last); resp_idx: each response token's predicting position."""
    n, R = len(idx), batch.max_response_length
    prompts = [batch.prompt_ids[i] for i in idx]
    responses = [batch.response_ids[i] for i in idx]
    plen = np.fromiter(map(len, prompts), np.int64, n)
    rlen = np.fromiter(map(len, responses), np.int64, n)
    lens = plen + rlen
    ends = np.cumsum(lens)
    starts = ends - lens
    # one host array for the whole micro-batch (numpy, not a tensor a sequence: the update's
    # host work was ~14 ms a 64-sequence mini-batch on the CPU machine, while the device waited)
    tokens = np.fromiter(chain.from_iterable(chain(p, r) for p, r in zip(prompts, responses)),
                         np.int64, int(ends[-1]) if n else 0)
    targets = np.roll(tokens, -1)
    nonempty = lens > 0
    targets[ends[nonempty] - 1] = tokens[starts[nonempty]]
    cols = np.arange(R)
    in_resp = cols[None, :] < rlen[:, None]                                       # [n, R]
    resp_idx = np.where(in_resp, (starts + plen - 1)[:, None] + cols[None, :], 0)
    rows = resp_idx[in_resp]                                   # row-major: sequence by sequence
    positions = np.arange(len(tokens)) - np.repeat(starts, lens)
    packed = PackedInput.build(torch.from_numpy(tokens),
                               torch.from_numpy(np.concatenate([[0], ends])),
                               torch.from_numpy(positions), multiple_of=tp)
    t = torch.tensor(idx, dtype=torch.long)
    # the positions whose next token is a response token: the only log-probs RL reads
    tensors = {"targets": torch.from_numpy(targets), "resp_idx": torch.from_numpy(resp_idx),
               "resp_mask": batch.response_mask[t],
               # (one row at least: the loss keeps its path to the weights)
               "logprob_rows": torch.from_numpy(rows) if rows.size else
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
