"""One rank's part of a reshard plan, compiled: where each generation weight lives and which
copies fill it. Still no communication and no memory: hybrid.reshard allocates the arena and
the buckets and binds these copies to them. A direct bucket (hybrid.plan) has no copies: its
all-gather reads this member's training rows and writes a section of the arena.

A generation weight is either a training parameter itself ("shared": zero-copy) or a slice of
one flat arena (one allocation, 16-byte aligned slices; a stacked experts parameter's experts
back to back, in one aligned run); naive mode adds a second arena for the
generation shard cut out of the gathered full model. Copies are merged where memory allows:
adjacent rows of one training parameter pack as one copy; the column blocks (o_proj, down_proj)
that consecutive members send at equal offsets unpack as one strided copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridengine.hybrid.buckets import Block
from hybridengine.hybrid.plan import ReshardPlan
from hybridengine.models.hf import VOCAB_PARAMS
from hybridengine.models.moe import stacked_name

ALIGN_BYTES = 16      # every generation weight starts 16-byte aligned in the arena (GEMM loads)


def rect(t: torch.Tensor, row: int, col: int, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] window of a parameter's 2D view ([n] is [n, 1])."""
    t2 = t.view(-1, 1) if t.dim() == 1 else t
    return t2[row:row + rows, col:col + cols]


def numel(shape) -> int:
    """Elements of a shape."""
    return int(torch.Size(shape).numel())


class Copies:
    """A list of copies, bound to tensors once: the dense same-dtype pairs run as one foreach
    (its fast path needs equal strides), the strided rest one by one."""

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]):
        self.fast_dsts, self.fast_srcs, self.slow = [], [], []
        for d, s in zip(dsts, srcs):
            if d.is_contiguous() and s.is_contiguous() and d.dtype == s.dtype:
                self.fast_dsts.append(d)
                self.fast_srcs.append(s)
            else:
                self.slow.append((d, s))

    def run(self) -> None:
        if self.fast_dsts:
            torch._foreach_copy_(self.fast_dsts, self.fast_srcs)
        for d, s in self.slow:
            d.copy_(s)


@dataclass
class Program:
    """A plan compiled for one member, its training dtypes and the rollout dtype.

    place: target -> ("shared", training param) | ("arena", offset); gen_place (naive):
    gen param -> ("full", target) | ("arena", offset) in a second arena. unpack ops per bucket:
    (first member, number of members, offset, Block of the first member): the same block of
    consecutive members' chunks filling consecutive column ranges is one strided copy.
    """

    plan: ReshardPlan
    me: int
    place: dict[str, tuple]
    arena_numel: int
    local: list[Block]
    pack: list[list[tuple]]        # per bucket: (src, row, col, rows, cols, offset in my chunk)
    unpack: list[list[tuple]]
    gen_place: dict[str, tuple]
    gen_arena_numel: int
    busiest_bytes: int
    # direct buckets: bucket -> (src, src_row, rows, cols, dst, first dst row of the section)
    direct: dict[int, tuple] | None = None

    @property
    def flat_buckets(self) -> list[int]:
        """Buckets gathered through a buffer (packed, then unpacked)."""
        return [b for b in range(len(self.plan.chunk_numels)) if b not in (self.direct or {})]


def _arena_layout(names_shapes, align: int) -> tuple[dict[str, int], int]:
    """Offsets of the weights, each aligned; consecutive experts of one stacked parameter
    (models.moe) back to back, so the generation model's stacked tensor is one view of them."""
    offsets, at = {}, 0
    items = list(names_shapes)
    for i, (name, shape) in enumerate(items):
        offsets[name] = at
        at += numel(shape)
        nxt = stacked_name(items[i + 1][0]) if i + 1 < len(items) else None
        here = stacked_name(name)
        if not (here and nxt and nxt == (here[0], here[1] + 1)):
            at = -(-at // align) * align
    return offsets, at


def compile_program(plan: ReshardPlan, me: int, dtypes: dict, dtype, align: int,
                    busiest: int) -> Program:
    """Compile member `me`'s part; `dtypes`: its training parameters' dtypes (a parameter is
    shared only when its dtype is the rollout dtype), `align`: arena alignment in elements,
    `busiest`: bytes the busiest rank receives (carried into the switch report)."""
    member = plan.members[me]
    place, in_arena = {}, []
    for name, shape in plan.target_params.items():
        src = member.shared.get(name)
        if src is not None and dtypes[src] == dtype:
            place[name] = ("shared", src)
        else:
            in_arena.append((name, shape))
    offsets, arena_numel = _arena_layout(in_arena, align)
    place.update({n: ("arena", o) for n, o in offsets.items()})
    gen_place, gen_numel = {}, 0
    if plan.mode == "naive":
        own = [(n, s) for n, s in plan.gen_params.items() if n not in plan.slice_shared]
        gen_offsets, gen_numel = _arena_layout(own, align)
        gen_place = {n: ("full", plan.slice_shared[n]) if n in plan.slice_shared
                     else ("arena", gen_offsets[n]) for n in plan.gen_params}
    local = [b for b in member.local if place[b.dst][0] == "arena"]
    return Program(plan, me, place, arena_numel, local, _pack_runs(plan, me),
                   _unpack_ops(plan, place), gen_place, gen_numel, busiest,
                   _direct_ops(plan, me, place))


def _direct_ops(plan: ReshardPlan, me: int, place: dict) -> dict[int, tuple]:
    """This member's part of each direct bucket: its training rows and the section they join."""
    ops = {}
    for t in plan.transfers:
        if not plan.is_direct(t.bucket):
            continue
        b = t.block
        if place[b.dst][0] != "arena":
            raise AssertionError(f"direct bucket {t.bucket} targets {b.dst}, which is not in "
                                 f"the arena")
        if t.member == 0:
            ops.setdefault(t.bucket, [None, None])[1] = (b.dst, b.dst_row)
        if t.member == me:
            ops.setdefault(t.bucket, [None, None])[0] = (b.src, b.src_row, b.rows, b.cols)
    return {k: (*mine, *section) for k, (mine, section) in ops.items()}


def _pack_runs(plan: ReshardPlan, me: int) -> list[list[tuple]]:
    """This member's sends per bucket as (src, row, col, rows, cols, offset), adjacent rows of
    one source merged into one copy."""
    runs: list[list[tuple]] = [[] for _ in plan.chunk_numels]
    cols_of = {n: (s[1] if len(s) == 2 else 1) for n, s in plan.members[me].params.items()}
    for t in plan.transfers:
        if t.member != me or plan.is_direct(t.bucket):
            continue
        b, out = t.block, runs[t.bucket]
        full_width = b.src_col == 0 and b.cols == cols_of[b.src]
        if out and full_width:
            src, row, col, rows, cols, off = out[-1]
            if src == b.src and col == 0 and cols == b.cols and row + rows == b.src_row \
                    and off + rows * cols == t.offset:
                out[-1] = (src, row, 0, rows + b.rows, cols, off)
                continue
        out.append((b.src, b.src_row, b.src_col, b.rows, b.cols, t.offset))
    return runs


def _unpack_ops(plan: ReshardPlan, place: dict) -> list[list[tuple]]:
    """Per bucket (first member, count, offset, Block of the first member): column blocks
    (o_proj, down_proj) that consecutive members send at the same offset into adjacent columns
    merge into one strided copy."""
    ops: list[list[tuple]] = [[] for _ in plan.chunk_numels]
    columns: dict[tuple, list] = {}
    for t in plan.transfers:
        b = t.block
        if place[b.dst][0] != "arena" or plan.is_direct(t.bucket):
            continue
        if b.cols < _as_cols(plan.target_params[b.dst]):
            key = (t.bucket, t.offset, b.dst, b.dst_row, b.rows, b.cols)
            columns.setdefault(key, []).append((t.member, b))
        else:
            ops[t.bucket].append((t.member, 1, t.offset, b))
    for (bucket, offset, *_), group in columns.items():
        group.sort(key=lambda mb: mb[0])
        start = 0
        for i in range(1, len(group) + 1):
            if i < len(group) and group[i][0] == group[i - 1][0] + 1 \
                    and group[i][1].dst_col == group[i - 1][1].dst_col + group[i][1].cols:
                continue
            ops[bucket].append((group[start][0], i - start, offset, group[start][1]))
            start = i
    return ops


def _as_cols(shape) -> int:
    return shape[1] if len(shape) == 2 else 1


def new_arena(size: int, shapes: dict, place: dict, dtype, device) -> torch.Tensor:
    """A flat arena of `size` elements for the weights placed in it; vocabulary ones zeroed."""
    arena = torch.empty(size, dtype=dtype, device=device)
    for name in VOCAB_PARAMS:          # their tp-pad rows are never written: zero, once
        if name in shapes and place[name][0] == "arena":
            arena[place[name][1]:place[name][1] + numel(shapes[name])].zero_()
    return arena


def weight_views(place: dict, shapes: dict, arena, others: dict) -> dict[str, torch.Tensor]:
    """Every weight of a placement as a tensor: an arena slice, or `others[name]` (shared)."""
    return {n: others[where] if kind in ("shared", "full") else
            arena[where:where + numel(shapes[n])].view(shapes[n])
            for n, (kind, where) in place.items()}


