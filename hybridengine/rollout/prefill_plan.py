"""A prefill's host-side plan, in numpy: which packed token fills which cache row, and the
padded layout of the dense prefill attention. Pure index arithmetic over the prompts' lengths
(no torch, no device); rollout.model_runner uploads the arrays in one copy."""
from __future__ import annotations

import itertools

import numpy as np

from hybridengine.rollout.scheduler import Sequence

# the dense prefill attention runs while the padded prompts hold at most this many times the
# prompt tokens; beyond, the varlen kernel
DENSE_MAX_PADDING = 1.5


def prefill_plan(seqs: list[Sequence], vocab_size: int) -> tuple[dict[str, np.ndarray], int]:
    """Host-side int64 index arrays of a prefill, and the longest prompt: the packed distinct
    prompts (ids, positions, cu); for every sequence's cache row the packed token each position
    copies (src -> (dst_slot, dst_pos)); the last token of each prompt; per sequence its prompt
    (row_prompt), slot, last prompt position, random key and token budget. Built with numpy
    from the prompts' lengths: only the token ids pass through Python one by one; a token id
    outside [0, vocab_size) raises a ValueError naming its prompt."""
    groups: dict[int, list[Sequence]] = {}
    for s in seqs:
        groups.setdefault(s.prompt_index, []).append(s)
    members = list(groups.values())
    lens = np.array([len(m[0].prompt) for m in members], dtype=np.int64)
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    total = int(cu[-1])
    ids = np.fromiter(itertools.chain.from_iterable(m[0].prompt for m in members), np.int64,
                      total)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        m = members[int(np.searchsorted(cu, bad[0], side="right")) - 1][0]
        raise ValueError(f"prompt {m.prompt_index} has token id {ids[bad[0]]} outside the "
                         f"vocabulary [0, {vocab_size})")
    positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], lens)
    row_group = np.array([g for g, m in enumerate(members) for _ in m], dtype=np.int64)
    row_len = lens[row_group]
    dst_pos = np.arange(int(row_len.sum()), dtype=np.int64) - \
        np.repeat(np.cumsum(row_len) - row_len, row_len)
    src = np.repeat(cu[:-1][row_group], row_len) + dst_pos
    dst_slot = np.repeat(np.array([s.slot for m in members for s in m], dtype=np.int64), row_len)
    group_of = {s.seq_id: g for g, m in enumerate(members) for s in m}
    per_seq = {"slots": [s.slot for s in seqs], "last_pos": [len(s.prompt) - 1 for s in seqs],
               "keys": [s.key for s in seqs], "max_gen": [s.max_gen for s in seqs],
               "row_prompt": [group_of[s.seq_id] for s in seqs]}
    # slots first: at offset 0 of the runner's host-to-device buffer, as the decode step's
    # rows (the compiled commit takes both, and compiles again for a storage offset of 0 / 1)
    plan = {**{k: np.array(v, dtype=np.int64) for k, v in per_seq.items()}, "ids": ids,
            "positions": positions, "cu": cu, "src": src, "dst_slot": dst_slot,
            "dst_pos": dst_pos, "last": cu[1:] - 1}
    return plan, int(lens.max())


def dense_pays(plan: dict[str, np.ndarray], max_len: int) -> bool:
    """Whether padding every prompt to the longest costs at most DENSE_MAX_PADDING x the tokens."""
    num_prompts, num_tokens = len(plan["cu"]) - 1, int(plan["cu"][-1])
    return num_prompts * max_len <= DENSE_MAX_PADDING * num_tokens


def add_pad_index(plan: dict[str, np.ndarray], max_len: int, always: bool) -> None:
    """plan["pad_index"]: each packed token's place in the [prompts, max_len] padded layout;
    left out when no prompt is padded, unless `always` (a compiled prefill takes one form)."""
    num_prompts, num_tokens = len(plan["cu"]) - 1, int(plan["cu"][-1])
    if always or num_prompts * max_len != num_tokens:
        plan["pad_index"] = np.repeat(np.arange(num_prompts) * max_len,
                                      np.diff(plan["cu"])) + plan["positions"]
