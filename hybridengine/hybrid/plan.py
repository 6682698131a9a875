"""The HybridEngine's transfer plan: (training layout, generation layout, model) -> transfers.

Pure arithmetic, no communication and no tensor data (a meta-device Decoder names the
parameters), so every rank can plan every rank's part and tests can check the plan alone (STYLE
rule 6).

A micro-DP group (HybridFlow §5, see parallel.layout.GenLayout) is the s = t·p/t_g training ranks
(training TP ranks [j·t/t_g, (j+1)·t/t_g) of every pipeline stage) that together hold generation
shard j: TP rank j of t_g, all layers. Its members, in global-rank order (= all-gather chunk
order), each send a chunk of every bucket; one all-gather per bucket leaves every member with
every chunk, and each member builds the same generation shard out of them:

    shard description   every parameter of a shard as HF slices (hf.param_plan) at known offsets
                        (stacked experts: each expert's view a parameter of its own)
    matching            each slice of each generation parameter is cut into intervals; an interval
                        that every member holds is copied locally (a `local` Block, no transfer);
                        otherwise one holder sends it (a replicated interval is split evenly over
                        its holders, to balance the chunks)
    sharing             a generation parameter whose slices equal one of a member's training
                        parameters is that parameter on that member (zero-copy; always the case
                        when t_g = t and p = 1, where nothing moves at all)
    direct buckets      a section of a generation parameter that the members hold as equal,
                        consecutive runs of whole rows, in member order (q, k, v, gate, up and
                        the vocabulary rows when p = 1), of at least `direct_min_numel`
                        elements per member, is a bucket of its own: its all-gather reads each
                        member's training rows and writes the generation parameter in place,
                        with no copy on either side (hybrid.program)
    bucketing           the other sends fill flat chunks of `capacity` elements, split by
                        rows at chunk ends, layers first in training-parameter order (so a
                        member packs long runs of contiguous memory and members' layer blocks
                        sit at equal offsets)

Vocabulary: the generation shard keeps the training layout's padding (t·⌈V/t⌉ rows, shard
j = training shards j·k … (j+1)·k−1, k = t/t_g), so no row ever crosses a micro-DP group. This
equals the natural ⌈V/t_g⌉ split whenever t divides V (every Llama/Qwen vocabulary); otherwise
the generation embedding has up to t−1 zero pad rows instead of t_g−1 (hybrid.gen_model).

Tied embeddings with pp > 1: the first stage's embed_tokens is the only source; the last stage's
copy (`lm_head.weight`) is never read.

mode="naive" is the DS-Chat / verl baseline: the group is the whole model-parallel group (t·p
ranks), the target is the full model (tp = 1), one collective per training tensor, and each rank
then slices its generation shard out of the full model locally (`slices`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from hybridengine.hybrid.buckets import Block, Transfer, as_2d, bucket
from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.models.hf import VOCAB_PARAMS, Piece, param_plan
from hybridengine.models.moe import expert_views
from hybridengine.parallel.layout import GenLayout, Layout
from hybridengine.parallel.tensor import padded_vocab_size

MODES = ("zero_redundancy", "naive")


@dataclass(frozen=True)
class MemberPlan:
    """One member of the group: its training shard and what it does without communication."""

    pp_rank: int
    tp_rank: int
    params: dict[str, tuple[int, ...]]   # its training shard: Decoder names -> shapes
    shared: dict[str, str]               # target param -> identical training param (zero-copy)
    local: tuple[Block, ...]             # target intervals every member holds: copied locally


@dataclass(frozen=True)
class ReshardPlan:
    """The transfers of one group (identical for every data-parallel replica).

    target_params is what the group assembles: the generation shard, or in naive mode the full
    model, from which `slices` (local copies; `slice_shared`: identical tensors) cut gen_params.
    """

    mode: str
    layout: Layout
    gen_tp: int
    gen_tp_rank: int
    gen_params: dict[str, tuple[int, ...]]
    target_params: dict[str, tuple[int, ...]]
    members: tuple[MemberPlan, ...]
    transfers: tuple[Transfer, ...]
    chunk_numels: tuple[int, ...]        # elements of one member's chunk, per bucket
    slices: tuple[Block, ...] = ()
    slice_shared: dict[str, str] | None = None
    direct: tuple[bool, ...] = ()        # per bucket: a direct bucket (module doc)

    def is_direct(self, bucket: int) -> bool:
        return bool(self.direct) and self.direct[bucket]

    @property
    def num_members(self) -> int:
        return len(self.members)

    @property
    def num_collectives(self) -> int:
        return len(self.chunk_numels) if self.num_members > 1 else 0

    @property
    def received_numel(self) -> int:
        """Elements each member receives (= sends: an all-gather sends a chunk to s−1 peers)."""
        return (self.num_members - 1) * sum(self.chunk_numels)

    def member_index(self, pp_rank: int, tp_rank: int) -> int:
        for i, m in enumerate(self.members):
            if (m.pp_rank, m.tp_rank) == (pp_rank, tp_rank):
                return i
        raise ValueError(f"training rank (pp {pp_rank}, tp {tp_rank}) is not in this group")


# --- shard descriptions --------------------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    """One parameter of a shard: its HF slices and where each starts along local_dim."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[tuple[Piece, int], ...]


@functools.lru_cache(maxsize=64)
def _stage_params(cfg: ModelConfig, pp: int, pp_rank: int) -> tuple:
    """(name, full shape) of every parameter of a pipeline stage at tp = 1 (a meta Decoder),
    stacked experts one by one (their per-expert views, models.moe)."""
    model = Decoder(cfg, None, False, pp_rank, pp, device="meta")
    return model.layer_start, tuple((n, tuple(p.shape))
                                    for n, p in expert_views(model.named_parameters()))


def shard_slots(cfg: ModelConfig, tp: int, tp_rank: int, pp: int = 1, pp_rank: int = 0,
                vocab_tp: int | None = None) -> list[Slot]:
    """Every parameter of the (tp_rank of tp, stage pp_rank of pp) Decoder shard as HF slices.

    Vocabulary rows follow the ⌈V/vocab_tp⌉ partition of `vocab_tp` ranks (default tp): shard r
    of tp holds partitions r·k … (r+1)·k−1, k = vocab_tp/tp.
    """
    layer_start, params = _stage_params(cfg, pp, pp_rank)
    slots = []
    for name, full in params:
        if name in VOCAB_PARAMS:
            base = vocab_tp or tp
            k, rows = base // tp, padded_vocab_size(cfg.vocab_size, base) // base
            first = tp_rank * k * rows
            pieces = [(pc, pc.start - first) for a in range(tp_rank * k, (tp_rank + 1) * k)
                      for pc in param_plan(name, cfg, base, a)]
            slots.append(Slot(name, (k * rows, full[1]), tuple(pieces)))
            continue
        plan = param_plan(name, cfg, tp, tp_rank, layer_start)
        dim, at, pieces = plan[0].local_dim, 0, []
        for pc in plan:
            pieces.append((pc, at))
            at += pc.stop - pc.start
        shape = tuple(at if d == dim else s for d, s in enumerate(full))
        slots.append(Slot(name, shape, tuple(pieces)))
    return slots


def _is_source(cfg: ModelConfig, name: str) -> bool:
    # The tied head copy of the last stage mirrors the first stage's embedding: never a source.
    return not (cfg.tie_word_embeddings and name == "lm_head.weight")


# --- matching -------------------------------------------------------------------------------------

def _block(tslot: Slot, tpiece: Piece, toff: int, src: tuple, lo: int, hi: int) -> Block:
    sslot, spiece, soff = src
    if spiece.local_dim != tpiece.local_dim:
        raise ValueError(f"{sslot.name} and {tslot.name} shard {tpiece.name} on different dims")
    s_at, t_at, n = soff + lo - spiece.start, toff + lo - tpiece.start, hi - lo
    (s_rows, s_cols), (t_rows, t_cols) = as_2d(sslot.shape), as_2d(tslot.shape)
    if tpiece.local_dim == 0:
        if s_cols != t_cols:
            raise ValueError(f"{sslot.name} {sslot.shape} cannot fill {tslot.name} {tslot.shape}")
        return Block(sslot.name, tslot.name, s_at, 0, t_at, 0, n, s_cols)
    if s_rows != t_rows:
        raise ValueError(f"{sslot.name} {sslot.shape} cannot fill {tslot.name} {tslot.shape}")
    return Block(sslot.name, tslot.name, 0, s_at, 0, t_at, s_rows, n)


def _match(cfg: ModelConfig, targets: list[Slot], members: list[list[Slot]]):
    """Cut every target slice into intervals and pick their sources.

    Returns (sends, local): per member, the Blocks it sends / copies from itself.
    """
    index: dict[str, list] = {}
    for i, slots in enumerate(members):
        for slot in slots:
            if _is_source(cfg, slot.name):
                for pc, off in slot.pieces:
                    index.setdefault(pc.name, []).append((i, (slot, pc, off)))
    sends, local = [[] for _ in members], [[] for _ in members]
    for tslot in targets:
        for tpc, toff in tslot.pieces:
            cands = [(i, s) for i, s in index.get(tpc.name, ()) if s[1].hf_dim == tpc.hf_dim
                     and s[1].start < tpc.stop and tpc.start < s[1].stop]
            edges = {tpc.start, tpc.stop}
            for _, s in cands:
                edges |= {min(max(x, tpc.start), tpc.stop) for x in (s[1].start, s[1].stop)}
            cuts = sorted(edges)
            for lo, hi in zip(cuts, cuts[1:]):
                holders: dict[int, tuple] = {}
                for i, s in cands:
                    if s[1].start <= lo and hi <= s[1].stop:
                        holders.setdefault(i, s)
                if not holders:
                    raise ValueError(f"no training shard of the group holds {tpc.name}[{lo}:{hi}]")
                if len(holders) == len(members):
                    for i, s in holders.items():
                        _push(local[i], _block(tslot, tpc, toff, s, lo, hi))
                    continue
                cut = [lo + (hi - lo) * q // len(holders) for q in range(len(holders) + 1)]
                for (i, s), a, b in zip(holders.items(), cut, cut[1:]):
                    if b > a:
                        _push(sends[i], _block(tslot, tpc, toff, s, a, b))
    return sends, local


def _push(blocks: list[Block], blk: Block) -> None:
    joined = _joined(blocks[-1], blk) if blocks else None
    if joined is None:
        blocks.append(blk)
    else:
        blocks[-1] = joined


def _joined(a: Block, b: Block) -> Block | None:
    """a and b as one Block when b continues a in both source and target (q, k, v of one
    shard: one block whenever the generation shard keeps them adjacent)."""
    if (a.src, a.dst) != (b.src, b.dst):
        return None
    if (a.src_col, a.dst_col, a.cols) == (b.src_col, b.dst_col, b.cols) \
            and a.src_row + a.rows == b.src_row and a.dst_row + a.rows == b.dst_row:
        return Block(a.src, a.dst, a.src_row, a.src_col, a.dst_row, a.dst_col, a.rows + b.rows,
                     a.cols)
    if (a.src_row, a.dst_row, a.rows) == (b.src_row, b.dst_row, b.rows) \
            and a.src_col + a.cols == b.src_col and a.dst_col + a.cols == b.dst_col:
        return Block(a.src, a.dst, a.src_row, a.src_col, a.dst_row, a.dst_col, a.rows,
                     a.cols + b.cols)
    return None


def _shared(targets: list[Slot], slots: list[Slot], cfg: ModelConfig) -> dict[str, str]:
    """Targets identical (same slices, same shape) to one of this member's training params."""
    by_key = {(s.shape, s.pieces): s.name for s in slots if _is_source(cfg, s.name)}
    return {t.name: by_key[(t.shape, t.pieces)] for t in targets if (t.shape, t.pieces) in by_key}


# --- the plan -------------------------------------------------------------------------------------

def group_members(layout: Layout, gen_tp: int, gen_tp_rank: int,
                  mode: str) -> list[tuple[int, int]]:
    """(pp_rank, tp_rank) of the group's members in global-rank (= chunk) order."""
    if mode == "naive":
        tps = range(layout.tp)
    else:
        k = layout.tp // gen_tp
        tps = range(gen_tp_rank * k, (gen_tp_rank + 1) * k)
    return sorted((pp, tp) for pp in range(layout.pp) for tp in tps)


def plan_reshard(cfg: ModelConfig, gen_layout: GenLayout, gen_tp_rank: int, *,
                 mode: str = "zero_redundancy", max_bucket_numel: int = 128 << 20,
                 direct_min_numel: int | None = None) -> ReshardPlan:
    """Plan the switch of the micro-DP group of generation TP rank `gen_tp_rank` (see module doc)
    from `gen_layout.train` to `gen_layout` (whose constructor checked t_g against (t, p)).

    max_bucket_numel: elements of one gathered (flat) bucket (all members' chunks).
    direct_min_numel: sections of at least this many elements per member become direct
    buckets (any size: no buffer holds them); None: none do.
    """
    if mode not in MODES:
        raise ValueError(f"reshard mode={mode!r} is not one of {MODES}")
    layout, gen_tp = gen_layout.train, gen_layout.tp
    if not 0 <= gen_tp_rank < gen_tp:
        raise ValueError(f"gen_tp_rank={gen_tp_rank} outside [0, {gen_tp})")
    cfg.check_tp(gen_tp)
    coords = group_members(layout, gen_tp, gen_tp_rank, mode)
    members = [shard_slots(cfg, layout.tp, tp, layout.pp, pp) for pp, tp in coords]
    gen = shard_slots(cfg, gen_tp, gen_tp_rank, vocab_tp=layout.tp)
    target = shard_slots(cfg, 1, 0) if mode == "naive" else gen
    sends, local = _match(cfg, target, members)
    target_shapes = {s.name: s.shape for s in target}
    capacity = max(1, max_bucket_numel // len(members))
    transfers, chunks, direct = bucket(sends, members, mode, capacity, direct_min_numel)
    slices, slice_shared = (), None
    if mode == "naive":
        _, (own,) = _match(cfg, gen, [target])     # one member holding everything: all local
        slices, slice_shared = tuple(own), _shared(gen, target, cfg)
    plans = tuple(MemberPlan(pp, tp, {s.name: s.shape for s in slots}, _shared(target, slots, cfg),
                             tuple(loc)) for (pp, tp), slots, loc in zip(coords, members, local))
    return ReshardPlan(mode, layout, gen_tp, gen_tp_rank, {s.name: s.shape for s in gen},
                       target_shapes, plans, transfers, chunks, slices, slice_shared, direct)


def plan_for_rank(cfg: ModelConfig, gen_layout: GenLayout, rank: int, **kw):
    """(plan, member index) of a global rank."""
    _, gen_tp_rank, _ = gen_layout.coords(rank)
    pp_rank, _, tp_rank = gen_layout.train.coords(rank)
    plan = plan_reshard(cfg, gen_layout, gen_tp_rank, **kw)
    return plan, plan.member_index(pp_rank, tp_rank)


def max_received_numel(cfg: ModelConfig, gen_layout: GenLayout, **kw) -> int:
    """Elements received by the busiest rank of the world (every group's plan)."""
    return max(plan_reshard(cfg, gen_layout, j, **kw).received_numel
               for j in range(gen_layout.tp))

