"""A prefill's host-side plan, in numpy: which packed token fills which cache row (static
layout: `prefill_plan`) or flat block slot (paged: `paged_prefill_plan`), and the padded layouts
of the dense and the cached-prefix prefill attention. Pure index arithmetic over the prompts'
lengths (no torch, no device); the model runners upload the arrays in one copy."""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np

from hybridengine.rollout.scheduler import Sequence

if TYPE_CHECKING:                # (annotations only: this module stays torch-free)
    from hybridengine.rollout.block_manager import BlockTables
    from hybridengine.rollout.paged_scheduler import PrefillGroup

# the dense prefill attention runs while the padded prompts hold at most this many times the
# prompt tokens; beyond, the varlen kernel
DENSE_MAX_PADDING = 1.5


def dense_width(max_len: int) -> int:
    """The padded length of a dense prefill: the longest prompt rounded up, to a power of two
    up to 64, then to a multiple of 64 (at most 63 padded rows more per prompt), so that
    prefills of prompts of nearby lengths share one attention shape. cuDNN builds an execution
    plan the first time it meets a shape: in the PPO seed step, whose prompts' longest length
    changes every step, that host work left the device idle 72 ms of a 146 ms prefill (H200,
    bench/RESULTS.md 2026-12-03 session 25)."""
    if max_len <= 64:       # (>= 2: a compiled dense prefill would specialise a width of 1)
        return max(2, 1 << (max_len - 1).bit_length())
    return -(-max_len // 64) * 64


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


def plan_dense(plan: dict[str, np.ndarray], max_len: int, attention: str, compiled: bool,
               force: bool | None = None) -> int | None:
    """The padded width of a dense prefill (plan["pad_index"] added), or None for the varlen
    one. force: that choice; None: dense when `attention` is "dense" and the padding pays.
    compiled: a pad index even where no prompt is padded (a compiled prefill takes one form)."""
    width = dense_width(max_len)
    dense = force if force is not None else attention == "dense" and dense_pays(plan, width)
    if not dense:
        return None
    add_pad_index(plan, width, always=compiled)
    return width


def paged_prefill_plan(groups: list[PrefillGroup], tables: BlockTables, vocab_size: int,
                       pad_row: int | None = None):
    """Host int64 arrays of a paged prefill (rows first: as prefill_plan, the per-sequence
    lists; then the packed tokens past each group's cached prefix, src -> dst flat slots), the
    longest packed group, and whether a group starts past a cached prefix. pad_row: append a
    1-token dummy group in that (scratch) row, writing to the scratch block (a compiled step
    specialises a dimension of size 1; see model_runner.prefill)."""
    ids, positions, cu, src, dst, seq_lens = [], [], [0], [], [], []
    per_seq = {k: [] for k in ("rows", "last_pos", "keys", "max_gen", "counts", "row_group")}
    for gi, g in enumerate(groups):
        off, n = cu[-1], len(g.tokens)
        ids.append(np.asarray(g.tokens[g.start:], dtype=np.int64))
        positions.append(np.arange(g.start, n, dtype=np.int64))
        s_src, s_dst = tables.prefill_slots(g.seqs[0].seq_id, len(g.seqs), g.start)
        src.append(s_src + off)
        dst.append(s_dst)
        cu.append(off + n - g.start)
        seq_lens.append(n)
        for s in g.seqs:
            for k, v in zip(per_seq, (s.slot, n - 1, s.key, s.max_gen, g.num_generated, gi)):
                per_seq[k].append(v)
    if pad_row is not None:
        # the dummy group: token 0 at position 0, written to the scratch block
        ids.append(np.zeros(1, dtype=np.int64))
        positions.append(np.zeros(1, dtype=np.int64))
        src.append(np.asarray([cu[-1]], dtype=np.int64))
        dst.append(np.asarray([tables.pad_block * tables.block_size], dtype=np.int64))
        cu.append(cu[-1] + 1)
        seq_lens.append(1)
        for k, v in zip(per_seq, (pad_row, 0, 0, 0, 0, len(groups))):
            per_seq[k].append(v)
    plan = {k: np.asarray(v, dtype=np.int64) for k, v in per_seq.items()}
    ids_np = np.concatenate(ids)
    real = cu[len(groups)]                      # the groups' tokens (not the dummy's)
    bad = np.flatnonzero((ids_np[:real] < 0) | (ids_np[:real] >= vocab_size))
    if bad.size:
        g = groups[int(np.searchsorted(cu, bad[0], side="right")) - 1]
        raise ValueError(f"prompt {g.seqs[0].prompt_index} has token id {ids_np[bad[0]]} "
                         f"outside the vocabulary [0, {vocab_size})")
    cu_np = np.asarray(cu, dtype=np.int64)
    plan.update(ids=ids_np, positions=np.concatenate(positions), cu=cu_np,
                src=np.concatenate(src), dst=np.concatenate(dst),
                last=cu_np[1:] - 1, seq_lens=np.asarray(seq_lens, dtype=np.int64))
    return plan, int(np.diff(cu_np).max()), any(g.start for g in groups)


def add_prefix_index(plan: dict[str, np.ndarray], groups: list[PrefillGroup],
                     tables: BlockTables) -> int:
    """The padded layout of paged_context.padded_prefix_attention: plan["key_slots"] [S·N] the
    flat slot of every position of each group (its first sample's table; the scratch block's
    past its length; the dummy group of paged_prefill_plan too) and plan["q_index"] [T] each
    packed token's s·N + position. Returns N, the longest group (all its tokens)."""
    lens = plan["seq_lens"]
    num, bs, N = len(lens), tables.block_size, int(lens.max())
    slots = np.full((num, N), tables.pad_block * bs, dtype=np.int64)
    for gi, g in enumerate(groups):
        table = np.asarray(tables.tables[g.seqs[0].seq_id], dtype=np.int64)
        p = np.arange(len(g.tokens))
        slots[gi, :len(p)] = table[p // bs] * bs + p % bs
    group_of = np.repeat(np.arange(num), np.diff(plan["cu"]))
    plan["key_slots"] = slots.reshape(-1)
    plan["q_index"] = group_of * N + plan["positions"]
    return N
