"""The generation shard's weights as full Hugging Face tensors, streamed in buckets.

vLLM's loader (reload_weights with is_checkpoint_format=True) takes HF-named full tensors and
slices its own TP shard out of each. At generation TP 1 the stream yields views of the gen
Decoder's parameters (no copy, no communication). At TP > 1 each tensor either travels by an
all-gather over the generation-TP group, in buckets ("gather"), or, when vLLM's TP group is ours
and its slice is this rank's shard, is handed over as a full-size tensor holding only this rank's
slice ("handoff"; the rest NaN, so a loader reading outside its slice would be loud). Stacked
experts go one by one under their HF names (experts.{e}.gate_proj / up_proj / down_proj, Mixtral's
w1 / w3 / w2), the names vLLM's Qwen3-MoE and Mixtral loaders take.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.distributed as dist

from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.models.hf import VOCAB_PARAMS, Piece, is_tp_replicated, param_plan
from hybridengine.models.moe import expert_views
from hybridengine.parallel.tensor import all_gather_flat, group_size


def _pieces(name: str, shape: torch.Size, cfg: ModelConfig, tp: int, rank: int) -> list[Piece]:
    """The HF slices of gen-TP shard `rank` of a parameter. Vocabulary rows follow the shard's
    real row count (the reshard plan keeps the training layout's padding, see hybrid.plan)."""
    if name not in VOCAB_PARAMS:
        return param_plan(name, cfg, tp, rank)
    start, stop = rank * shape[0], min((rank + 1) * shape[0], cfg.vocab_size)
    return [replace(param_plan(name, cfg, 1, 0)[0], start=start, stop=stop)] if stop > start \
        else []


def _split_local(name: str, t: torch.Tensor, cfg: ModelConfig):
    """A full (unsharded) parameter as HF tensors: views, no copy (qkv -> q, k, v; ...)."""
    offset = 0
    for p in _pieces(name, t.shape, cfg, 1, 0):
        n = p.stop - p.start
        yield p.name, t.narrow(p.local_dim, offset, n)
        offset += n


def _assemble(name: str, shards: list[torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every gen-TP rank's shard of one parameter -> its full HF tensors."""
    tp, parts = len(shards), {}
    for r, shard in enumerate(shards):
        offset = 0
        for p in _pieces(name, shard.shape, cfg, tp, r):
            n = p.stop - p.start
            parts.setdefault(p.name, []).append((p, shard.narrow(p.local_dim, offset, n)))
            offset += n
    out = {}
    for hf_name, chunks in parts.items():
        dim = chunks[0][0].hf_dim              # == local_dim for every Decoder parameter
        shape = list(chunks[0][1].shape)
        shape[dim] = max(p.stop for p, _ in chunks)
        full = chunks[0][1].new_empty(shape)
        for p, chunk in chunks:
            full.narrow(dim, p.start, p.stop - p.start).copy_(chunk)
        out[hf_name] = full
    return out


def _gathered(bucket: list[tuple[str, torch.Tensor]], group, cfg: ModelConfig, stats: dict):
    """One all-gather of a bucket of shards over the gen-TP group, reassembled into HF tensors."""
    tp = group_size(group)
    numel = sum(t.numel() for _, t in bucket)
    first = bucket[0][1]
    flat = torch.empty(numel, dtype=first.dtype, device=first.device)
    offset = 0
    for _, t in bucket:
        flat[offset:offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    out = flat.new_empty(tp * numel)
    all_gather_flat(out, flat, group)
    stats["gathered_bytes"] += out.numel() * out.element_size()
    chunks, offset = out.view(tp, numel), 0                        # [tp, numel]
    for name, t in bucket:
        shards = [chunks[r, offset:offset + t.numel()].view(t.shape) for r in range(tp)]
        offset += t.numel()
        yield from _assemble(name, shards, cfg).items()


def _handed_off(name: str, t: torch.Tensor, cfg: ModelConfig, tp: int, rank: int):
    """This rank's shard in full-size HF tensors whose other ranks' slices are NaN: the layout a
    TP-`rank` vLLM loader reads its own slice from. Never read elsewhere; if a loader did, NaN
    weights would say so loudly."""
    offset = 0
    for p in _pieces(name, t.shape, cfg, tp, rank):
        n = p.stop - p.start
        full_len = cfg.vocab_size if name in VOCAB_PARAMS else next(
            q.stop for q in param_plan(name, cfg, 1, 0) if q.name == p.name)
        shape = list(t.shape)
        shape[p.hf_dim] = full_len
        full = t.new_full(shape, math.nan)
        full.narrow(p.hf_dim, p.start, n).copy_(t.narrow(p.local_dim, offset, n))
        offset += n
        yield p.name, full


def hf_weight_stream(model: Decoder, group, bucket_mb: float, stats: dict | None = None,
                     handoff: bool = False, vocab_rows: int | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full-size tensor) for every weight of a generation Decoder shard (pp = 1),
    layers in order. gen-TP > 1: sharded parameters are all-gathered over `group` in buckets of
    `bucket_mb` (a collective: every member must consume the whole stream), or with handoff=True
    each rank's shard is placed in NaN-padded full-size tensors (no communication; only right
    when the rank's gen-TP rank is its vLLM TP rank). The vocabulary is handed off only when its
    shard has `vocab_rows` rows (vLLM's own split: ⌈V/64⌉·64 / t_g), else gathered."""
    tp, cfg = group_size(group), model.cfg
    rank = dist.get_rank(group) if tp > 1 else 0
    stats = stats if stats is not None else {}
    stats.setdefault("gathered_bytes", 0)
    max_bytes = max(1, int(bucket_mb * 2**20))
    bucket, size = [], 0
    for name, p in expert_views(model.named_parameters()):     # experts one by one
        if name.startswith("value_head.") or (name == "lm_head.weight"
                                              and cfg.tie_word_embeddings):
            continue
        t = p.detach()
        if tp == 1 or is_tp_replicated(name, cfg, tp):
            yield from _split_local(name, t, cfg)
        elif handoff and (name not in VOCAB_PARAMS or t.shape[0] == vocab_rows):
            yield from _handed_off(name, t, cfg, tp, rank)
        else:
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= max_bytes:
                yield from _gathered(bucket, group, cfg, stats)
                bucket, size = [], 0
    if bucket:
        yield from _gathered(bucket, group, cfg, stats)


