"""Blocks, transfers and buckets of the HybridEngine's transfer plan (hybrid.plan).

A Block is a rectangle copied from a training parameter to a generation parameter (2D views);
a Transfer is a Block that one member of a micro-DP group sends at an offset of its chunk of a
bucket. `bucket` places every member's sends into buckets: direct buckets (a section the members
hold as equal runs of whole rows, all-gathered in place) and flat chunks of `capacity` elements
(see hybrid.plan's module doc for why the order and the splits are what they are).
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridengine.models.hf import VOCAB_PARAMS


@dataclass(frozen=True)
class Block:
    """Copy src[src_row:+rows, src_col:+cols] -> dst[dst_row:+rows, dst_col:+cols] on 2D views
    of the parameters ([n] parameters are viewed as [n, 1])."""

    src: str
    dst: str
    src_row: int
    src_col: int
    dst_row: int
    dst_col: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class Transfer:
    """A Block sent by group member `member`, at `offset` elements into its chunk of `bucket`."""

    member: int
    block: Block
    bucket: int
    offset: int



def as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    return (shape[0], 1) if len(shape) == 1 else (shape[0], shape[1])


# --- bucketing ------------------------------------------------------------------------------------

def _fill_flat(stream: list[Block], capacity: int) -> list[tuple]:
    """One member's blocks -> [(block, bucket, offset)]: chunks filled to `capacity` elements,
    blocks split by rows at chunk ends. Every chunk is full but the last, so chunks of different
    members are equal and the all-gather pads nothing (but a stage imbalance at the tail)."""
    out, bucket, used = [], 0, 0
    for blk in stream:
        row = 0
        while row < blk.rows:
            fit = min((capacity - used) // blk.cols, blk.rows - row)
            if fit <= 0:
                bucket, used = bucket + 1, 0
                continue
            part = Block(blk.src, blk.dst, blk.src_row + row, blk.src_col, blk.dst_row + row,
                         blk.dst_col, fit, blk.cols) if fit < blk.rows else blk
            out.append((part, bucket, used))
            used, row = used + fit * blk.cols, row + fit
    return out


def _fill_per_tensor(stream: list[Block]) -> list[tuple]:
    """One bucket per training tensor (the stream is in _stream_order)."""
    bucket_of, used, out = {}, {}, []
    for blk in stream:
        b = bucket_of.setdefault(blk.src, len(bucket_of))
        out.append((blk, b, used.get(b, 0)))
        used[b] = used.get(b, 0) + blk.numel
    return out


def _stream_order(slots: list):
    """Sort key of a member's sends: layers first, then the vocabulary tensor, then the rest,
    each in Decoder order. Members' layer streams then line up at equal offsets even when their
    vocabulary shards differ (tp-padding), and pipeline stages pair tensors of equal size."""
    order = {s.name: k for k, s in enumerate(slots)}

    def key(blk: Block):
        kind = 0 if blk.src.startswith("layers.") else 1 if blk.src in VOCAB_PARAMS else 2
        return kind, order[blk.src], blk.src_row, blk.src_col
    return key


def _direct_sets(sends, members, min_numel: int) -> list[tuple[Block, ...]]:
    """Sections every member sends as whole rows of its training tensor, equal in size, filling
    consecutive rows of one generation tensor in member order: (block of member 0, 1, ...)."""
    widths = [{s.name: as_2d(s.shape)[1] for s in slots} for slots in members]

    def whole_rows(i: int, blk: Block) -> bool:
        return blk.src_col == 0 and blk.dst_col == 0 and blk.cols == widths[i][blk.src]

    by_start = [{(b.dst, b.dst_row): b for b in blocks if whole_rows(i, b)}
                for i, blocks in enumerate(sends)]
    sets = []
    for first in sends[0] if len(sends) > 1 else ():
        if first.numel < max(min_numel, 1) or not whole_rows(0, first):
            continue
        row = [first]
        for i in range(1, len(sends)):
            blk = by_start[i].get((first.dst, first.dst_row + i * first.rows))
            if blk is None or (blk.rows, blk.cols) != (first.rows, first.cols):
                break
            row.append(blk)
        if len(row) == len(sends):
            sets.append(tuple(row))
    return sets


def bucket(sends, members, mode: str, capacity: int, direct_min_numel: int | None):
    """Every member's sends -> (transfers, per-bucket chunk elements, per-bucket direct flags):
    direct buckets first (when direct_min_numel is set), then the flat buckets (naive mode: one
    per training tensor)."""
    transfers, fills, direct = [], {}, []
    if mode != "naive" and direct_min_numel is not None:
        taken = set()
        for blocks in _direct_sets(sends, members, direct_min_numel):
            b = len(direct)
            for i, blk in enumerate(blocks):
                transfers.append(Transfer(i, blk, b, 0))
                taken.add((i, blk))
            fills[b] = blocks[0].numel
            direct.append(True)
        sends = [[blk for blk in blocks if (i, blk) not in taken]
                 for i, blocks in enumerate(sends)]
    first = len(direct)
    # A row is the smallest unit a chunk holds: never let the capacity fall below one row.
    capacity = max([capacity] + [blk.cols for blocks in sends for blk in blocks])
    for i, (blocks, slots) in enumerate(zip(sends, members)):
        stream = sorted(blocks, key=_stream_order(slots))
        placed = _fill_per_tensor(stream) if mode == "naive" else _fill_flat(stream, capacity)
        for blk, b, off in placed:
            transfers.append(Transfer(i, blk, first + b, off))
            fills[first + b] = max(fills.get(first + b, 0), off + blk.numel)
    chunks = tuple(fills.get(b, 0) for b in range(max(fills, default=-1) + 1))
    direct += [False] * (len(chunks) - len(direct))
    return tuple(transfers), chunks, tuple(direct) if any(direct) else ()
